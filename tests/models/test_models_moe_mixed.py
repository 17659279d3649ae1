"""Qwen3-MoE with dense layers among the sparse ones (`mlp_only_layers`, `decoder_sparse_step`):
the stacked layout's segment scans (`layer_segments`) against the per-layer loop, both layer plans
(runs of one kind, repeats of a period), router outputs over the sparse layers only, the weight
conversions, gradients under remat and expert parallelism on a mesh. HF parity, save round trips,
greedy generation and the engine are in test_models_moe.py (fixture `qwen3_moe_mixed`)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import sharding
from jaxrl_llm import models
from jaxrl_llm.models import _decoder
from test_models_hf import fixture, loaded, reference

D, S = False, True  # layer kinds: dense, sparse


def _config(mlp_only_layers=(), decoder_sparse_step=1, **kw):
    return models.ModelConfig(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, model_type="qwen3_moe", qk_norm=True, num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=48, norm_topk_prob=True, train_attention="xla",
        mlp_only_layers=mlp_only_layers, decoder_sparse_step=decoder_sparse_step, **kw)


def test_layer_segments_take_the_plan_with_fewer_layer_bodies():
    assert _decoder.layer_segments((S, S, S, S)) == [(0, 4, (S,))]
    assert _decoder.layer_segments((D, S, D, S, D, S)) == [(0, 3, (D, S))]  # period 2: 2 bodies, not 6
    assert _decoder.layer_segments((D, S, S, S, S, S)) == [(0, 1, (D,)), (1, 5, (S,))]  # runs: 2, not 6
    assert _decoder.layer_segments((D, S, D, D)) == [(0, 1, (D,)), (1, 1, (S,)), (2, 2, (D,))]
    assert _decoder.layer_segments((D, D, S, D, D, S)) == [(0, 2, (D, D, S))]
    for kinds in [(D, S, D, D), (S, D, D, S, S), (D, S) * 3, (S,)]:  # the plan covers the layers in order
        flat = [k for _, reps, pattern in _decoder.layer_segments(kinds) for k in pattern * reps]
        assert tuple(flat) == kinds


def test_layer_kinds_follow_transformers_and_bad_values_are_named():
    assert _config(decoder_sparse_step=2).sparse_layers == (1, 3)
    assert _config(mlp_only_layers=[0, 0]).mlp_only_layers == (0,)  # a list from a config file: a tuple
    c = loaded("qwen3_moe_mixed").config
    assert (c.sparse_layers, c.dense_layers, c.mixed_layers) == ((1,), (0, 2, 3), True)
    assert loaded("qwen3_moe").config.mixed_layers is False
    layers = loaded("qwen3_moe_mixed").model.layers
    assert layers.mlp.experts.gate_proj["kernel"][...].shape == (1, 4, 32, 48)  # the one sparse layer
    assert layers.dense_mlp.gate_proj["kernel"][...].shape == (3, 32, 64)
    assert layers.self_attn.q_proj["kernel"][...].shape[0] == 4
    with pytest.raises(ValueError, match=r"qwen3_moe feature, not 'mixtral'"):
        models.ModelConfig(vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=2,
                           num_attention_heads=2, num_key_value_heads=1, model_type="mixtral", num_experts=2,
                           num_experts_per_tok=1, moe_intermediate_size=8, mlp_only_layers=(0,))
    with pytest.raises(ValueError, match=r"mlp_only_layers=3 must be a list"):
        _config(mlp_only_layers=3)


@pytest.mark.parametrize("dense,step", [((0,), 1), ((), 2)], ids=["runs", "period"])
def test_segment_scans_equal_the_per_layer_loop(dense, step):
    """Hidden states, sparse-layer router logits, recorded experts and replay of given experts: the
    stacked model (one scan per segment) and the per-layer model on the same weights."""
    c = _config(dense, step)
    stacked = models.init_model(c, seed=1)
    pure = nnx.to_pure_dict(nnx.state(stacked, nnx.Param))
    per = nnx.merge(nnx.split(models.abstract_model(c, layer_layout="per_layer"), nnx.Param)[0],
                    models.unstack_layers(pure, c.sparse_layers))
    assert [type(layer.mlp).__name__ for layer in per.model.layers] == [
        "SparseMLP" if i in c.sparse_layers else "MLP" for i in range(4)]
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 96, (2, 12)), jnp.int32)
    h, logits = stacked.hidden_states(ids, router_logits=True)
    h_p, logits_p = per.hidden_states(ids, router_logits=True)
    assert logits.shape == (len(c.sparse_layers), 2, 12, 4)
    np.testing.assert_allclose(h, h_p, atol=1e-5, rtol=0)
    np.testing.assert_allclose(logits, logits_p, atol=1e-5, rtol=0)
    unrolled = nnx.merge(nnx.split(models.abstract_model(c.replace(layer_unroll=0)), nnx.Param)[0], pure)
    np.testing.assert_allclose(unrolled.hidden_states(ids), h, atol=1e-5, rtol=0)  # every segment unrolled
    hp, cache, rec = stacked.prefill(ids, record_experts=True)
    _, cache_p, rec_p = per.prefill(ids, record_experts=True)
    assert rec.shape == (len(c.sparse_layers), 2, 12, 2) and cache.k.shape[0] == 4
    np.testing.assert_array_equal(rec, rec_p)
    np.testing.assert_allclose(np.stack(cache_p.k), cache.k, atol=1e-5, rtol=0)
    # replaying other experts changes the output the same way in both layouts
    given = jnp.moveaxis((rec + 1) % 4, 0, 2)  # [b, t, S, k], still k distinct ids per token
    h_r = stacked.hidden_states(ids, routed_experts=given)
    np.testing.assert_allclose(h_r, per.hidden_states(ids, routed_experts=given), atol=1e-5, rtol=0)
    assert np.abs(np.asarray(h_r - h)).max() > 1e-3
    # the weight conversions are exact, the fused layout included
    back = models.stack_layers(models.unstack_layers(pure, c.sparse_layers))
    fused = models.convert_layers(pure, "per_layer_fused", c.sparse_layers)
    assert set(fused["model"]["layers"][0]["mlp"]) == ({"gate", "experts"} if 0 in c.sparse_layers
                                                      else {"gate_up_proj", "down_proj"})
    for other in (back, models.convert_layers(fused, "stacked")):
        assert jax.tree.structure(other) == jax.tree.structure(pure)
        for a, b in zip(jax.tree.leaves(other), jax.tree.leaves(pure)):
            np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match="pass sparse_layers=config.sparse_layers"):
        models.unstack_layers(pure)
    with pytest.raises(ValueError, match=r"sparse_layers=\[0\] gives 1 sparse and 3 dense layers of 4"):
        models.unstack_layers(pure, (0,))


def test_gradients_under_remat_equal_no_remat_and_reach_every_mlp():
    ids = jnp.asarray(reference("qwen3_moe_mixed")["input_ids"])
    grads = []
    for remat in ("none", "full"):
        graphdef, state = nnx.split(models.from_pretrained(fixture("qwen3_moe_mixed"), remat=remat))
        grads.append(nnx.to_pure_dict(jax.jit(jax.grad(
            lambda s: jnp.mean(jax.nn.log_softmax(nnx.merge(graphdef, s)(ids))[..., 3])))(state)))
    for a, b in zip(jax.tree.leaves(grads[0]), jax.tree.leaves(grads[1])):
        np.testing.assert_allclose(a, b, atol=1e-7, rtol=1e-5)
    layers = grads[0]["model"]["layers"]
    assert (np.abs(layers["dense_mlp"]["down_proj"]["kernel"]).sum(axis=(1, 2)) > 0).all()  # 3 dense layers
    assert np.abs(layers["mlp"]["gate"]["kernel"]).max() > 0


def test_expert_parallel_mesh_equals_one_device():
    """Experts over fsdp=4 beside data=2 (8 CPU devices): logits and gradients of one device."""
    from test_models_expert_parallel import _loss_and_grads

    ids = np.concatenate([reference("qwen3_moe_mixed")["input_ids"]] * 4)
    want_logits, want_grads, _ = _loss_and_grads(models.from_pretrained(fixture("qwen3_moe_mixed")), ids)
    mesh = sharding.make_mesh((2, 4, 1))
    model = models.from_pretrained(fixture("qwen3_moe_mixed"), mesh=mesh, rules="train")
    assert model.model.layers.mlp.experts.gate_proj["kernel"][...].addressable_shards[0].data.shape[1] == 1
    logits, grads, hlo = _loss_and_grads(model, ids, mesh, "train")
    assert "reduce_scatter" in hlo
    np.testing.assert_allclose(logits, want_logits, atol=2e-5, rtol=0)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6 + 1e-4 * np.abs(np.asarray(b)).max(),
                                   rtol=0)


def test_int8_engine_quantizes_the_dense_layers_mlps_and_leaves_the_experts():
    """The stacked engine's weight sync quantizes the `dense_mlp` stack like a dense model's MLP
    (the experts stay in the param dtype) and decodes through the segment scans."""
    import rollout

    engine = rollout.Engine.from_pretrained(fixture("qwen3_moe_mixed"), max_concurrent_decodes=2,
                                            max_prefill_length=16, max_target_length=32, dtype="float32",
                                            temperature=0.0, layer_layout="stacked", quantization="int8")
    layers = engine.params["model"]["layers"]
    assert layers["dense_mlp"]["down_proj"]["kernel"].dtype == jnp.int8
    assert layers["dense_mlp"]["down_proj"]["scale"].shape == (3, 32)  # [dense layers, out]
    assert layers["mlp"]["experts"]["down_proj"]["kernel"].dtype == jnp.float32
    batch = rollout.RolloutDriver(engine, steps_per_sync=4).generate(
        [[5, 17, 42], [71, 3]], n=1, max_new_tokens=6, sampling=rollout.SamplingParams(temperature=0.0), seed=0)
    assert (batch.response_lengths == 6).all()
