"""Mixture-of-experts decoders (Qwen3-MoE, Mixtral): parity with transformers on tiny fixtures
(scripts/make_model_fixtures.py), exact save round trips, greedy generation through the rollout
engine, and the grouped-matmul dispatch against a dense per-expert reference."""
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file

from jaxrl_llm import models
from jaxrl_llm.models import _decoder
from test_models_hf import copy_fixture, fixture, forward, loaded, params, reference

MOE = ["qwen3_moe", "mixtral", "qwen3_moe_mixed"]  # mixed: dense layers 0, 2, 3 and sparse layer 1


@pytest.mark.parametrize("name", MOE)
def test_moe_logits_match_transformers_within_1e_4(name):
    model = loaded(name)
    ref = reference(name)
    logits = forward(model, ref["input_ids"])
    assert logits.shape == ref["logits"].shape
    assert np.abs(logits - ref["logits"]).max() <= 1e-4


def test_moe_config_fields_are_read():
    q, m = loaded("qwen3_moe").config, loaded("mixtral").config
    assert (q.model_type, q.num_experts, q.num_experts_per_tok, q.moe_intermediate_size) == ("qwen3_moe", 4, 2, 48)
    assert q.qk_norm and not q.norm_topk_prob and q.intermediate_size == 64
    assert (m.model_type, m.num_experts, m.num_experts_per_tok, m.moe_intermediate_size) == ("mixtral", 4, 2, 64)
    assert m.norm_topk_prob and not m.qk_norm
    experts = loaded("qwen3_moe").model.layers.mlp.experts
    assert experts.gate_proj["kernel"][...].shape == (2, 4, 32, 48)  # [layers, experts, embed, f]
    assert experts.down_proj["kernel"].get_metadata()["logical_axes"] == ("layers", "expert", "mlp", "embed")


@pytest.mark.parametrize("name", MOE)
def test_moe_save_writes_exactly_the_tensors_transformers_wrote(name, tmp_path):
    model = loaded(name)
    models.save_pretrained(model, tmp_path / "out")
    ours = load_file(tmp_path / "out" / "model.safetensors")
    theirs = load_file(os.path.join(fixture(name), "model.safetensors"))
    assert sorted(ours) == sorted(theirs)
    for key in theirs:
        assert ours[key].dtype == theirs[key].dtype and ours[key].shape == theirs[key].shape, key
        np.testing.assert_array_equal(ours[key], theirs[key], err_msg=key)
    hf = json.loads((tmp_path / "out" / "config.json").read_text())
    original = json.loads(open(os.path.join(fixture(name), "config.json")).read())
    for key, value in original.items():
        if key not in ("transformers_version",):
            assert hf[key] == value, (name, key)
    assert models.config_from_hf(hf) == model.config
    # sharded save and reload: the same parameters
    models.save_pretrained(model, tmp_path / "sharded", max_shard_size="20KB")
    back = models.from_pretrained(tmp_path / "sharded")
    a, b = params(model), params(back)
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


@pytest.mark.parametrize("name", MOE)
def test_moe_greedy_argmax_reproduces_recorded_hf_generate(name):
    gen = json.loads(open(os.path.join(fixture(name), "generate.json")).read())
    buf = np.zeros(reference(name)["input_ids"].shape, np.int32)
    lengths = [len(c["prompt"]) for c in gen["cases"]]
    for row, c in enumerate(gen["cases"]):
        buf[row, : lengths[row]] = c["prompt"]
    for k in range(gen["max_new_tokens"]):
        logits = forward(loaded(name), buf)
        for row, n in enumerate(lengths):
            buf[row, n + k] = int(np.argmax(logits[row, n + k - 1]))
    for row, c in enumerate(gen["cases"]):
        assert buf[row, lengths[row]: lengths[row] + gen["max_new_tokens"]].tolist() == c["output"]


@pytest.mark.parametrize("name,layout", [("qwen3_moe", "per_layer"), ("mixtral", "per_layer"),
                                         ("qwen3_moe", "per_layer_fused"), ("mixtral", "stacked"),
                                         ("qwen3_moe_mixed", "per_layer_fused"), ("qwen3_moe_mixed", "stacked")])
def test_moe_rollout_engine_greedy_equals_hf_generate(name, layout):
    """The engine's prefill/decode (every layer layout) go through the same SparseMLP."""
    import rollout

    gen = json.loads(open(os.path.join(fixture(name), "generate.json")).read())
    engine = rollout.Engine.from_pretrained(fixture(name), max_concurrent_decodes=2, max_prefill_length=16,
                                            max_target_length=32, dtype="float32", temperature=0.0,
                                            layer_layout=layout)
    assert engine.layer_layout == layout
    batch = rollout.RolloutDriver(engine, steps_per_sync=4).generate(
        [c["prompt"] for c in gen["cases"]], n=1, max_new_tokens=gen["max_new_tokens"],
        sampling=rollout.SamplingParams(temperature=0.0), seed=0)
    for i, c in enumerate(gen["cases"]):
        assert batch.responses[i].tolist() == c["output"], f"{name} case {i}"


def test_moe_fused_layout_round_trips_and_leaves_experts_alone():
    model = loaded("qwen3_moe")
    from flax import nnx

    pure = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    fused = models.convert_layers(pure, "per_layer_fused")
    assert models.params_layout(fused) == "per_layer_fused"
    assert set(fused["model"]["layers"][1]["mlp"]) == {"gate", "experts"}
    back = models.convert_layers(fused, "stacked")
    for a, b in zip(jax.tree.leaves(pure), jax.tree.leaves(back)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_grouped_experts_equal_a_dense_per_expert_loop():
    rng = np.random.default_rng(0)
    T, e, f, E, k = 13, 8, 6, 5, 2
    x = rng.normal(size=(T, e)).astype(np.float32)
    kern = tuple(rng.normal(size=s).astype(np.float32) for s in ((E, e, f), (E, e, f), (E, f, e)))
    logits = rng.normal(size=(T, E)).astype(np.float32)
    for normalize in (True, False):
        w, ids = _decoder.route(jnp.asarray(logits), k, normalize)
        got = np.asarray(_decoder.grouped_experts(jnp.asarray(x), ids, kern))
        p = np.exp(logits - logits.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        top = np.argsort(-p, axis=-1)[:, :k]
        np.testing.assert_array_equal(np.asarray(ids), top)
        want_w = np.take_along_axis(p, top, -1)
        if normalize:
            want_w /= want_w.sum(-1, keepdims=True)
        np.testing.assert_allclose(np.asarray(w), want_w, rtol=1e-6)
        for t in range(T):
            for j in range(k):
                g, u, d = (m[top[t, j]] for m in kern)
                h = x[t] @ g
                want = (h / (1 + np.exp(-h)) * (x[t] @ u)) @ d
                np.testing.assert_allclose(got[t, j], want, rtol=1e-5, atol=1e-5)


def test_moe_gradient_flows_to_every_used_expert_and_the_router():
    model = loaded("mixtral")
    from flax import nnx

    graphdef, state = nnx.split(model)
    ids = jnp.asarray(reference("mixtral")["input_ids"])

    def loss(s):
        return jnp.mean(nnx.merge(graphdef, s)(ids) ** 2)

    grads = nnx.to_pure_dict(jax.grad(loss)(state))
    moe = grads["model"]["layers"]["block_sparse_moe"]
    assert np.abs(np.asarray(moe["gate"]["kernel"])).max() > 0
    assert (np.abs(np.asarray(moe["experts"]["w2"]["kernel"])).sum(axis=(2, 3)) > 0).all()  # 32 tokens x top-2


def test_bad_moe_configs_are_refused_naming_the_fields(tmp_path):
    folder = copy_fixture("qwen3_moe", tmp_path)
    hf = json.loads((folder / "config.json").read_text())
    with pytest.raises(ValueError, match=r"config.json: mlp_only_layers=\[0, 1\].*no layer of the 2 is sparse"):
        models.config_from_hf(dict(hf, mlp_only_layers=[0, 1]))
    with pytest.raises(ValueError,
                       match=r"config.json: mlp_only_layers=\[2\]: \[2\] not in 0..num_hidden_layers - 1 = 1"):
        models.config_from_hf(dict(hf, mlp_only_layers=[2]))
    with pytest.raises(ValueError, match=r"decoder_sparse_step=0 must be an int >= 1"):
        models.config_from_hf(dict(hf, decoder_sparse_step=0))
    assert models.config_from_hf(dict(hf, decoder_sparse_step=2)).sparse_layers == (1,)
    with pytest.raises(ValueError, match="sliding_window"):
        models.config_from_hf(dict(json.loads(open(os.path.join(fixture("mixtral"), "config.json")).read()),
                                   sliding_window=4096))
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        models.ModelConfig(vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                           num_attention_heads=2, num_key_value_heads=1, model_type="mixtral",
                           num_experts=2, num_experts_per_tok=3, moe_intermediate_size=8)


def test_missing_expert_tensor_is_named(tmp_path):
    from test_models_hf import _rewrite_tensors

    folder = copy_fixture("qwen3_moe", tmp_path)
    _rewrite_tensors(folder, lambda t: t.pop("model.layers.1.mlp.experts.3.up_proj.weight"))
    with pytest.raises(ValueError, match=r"missing .*model\.layers\.1\.mlp\.experts\.3\.up_proj\.weight"):
        models.from_pretrained(folder)


def test_lora_on_moe_attention_only_and_expert_targets_refused():
    model = models.from_pretrained(fixture("qwen3_moe"))
    with pytest.raises(ValueError, match=r"\['gate_proj', 'up_proj', 'down_proj'\].*q_proj"):
        models.add_lora(model, models.LoraSpec(rank=2, alpha=4))
    models.add_lora(model, models.LoraSpec(rank=2, alpha=4, target_modules=("q_proj", "v_proj")))
    ref = reference("qwen3_moe")
    assert np.abs(forward(model, ref["input_ids"]) - ref["logits"]).max() <= 1e-4  # B = 0 at init


def test_moe_forward_is_the_same_on_every_mesh():
    """Expert weights placed by the train and rollout rules (expert dim on fsdp: expert parallel where
    fsdp > 1; `mlp` on tensor)."""
    import sharding
    from flax import nnx
    from jax.sharding import NamedSharding

    ref = reference("qwen3_moe")
    ids = np.concatenate([ref["input_ids"]] * 4)  # batch 8
    want = forward(loaded("qwen3_moe"), ids)
    for rules, shape in [(sharding.TRAIN_RULES, (8, 1, 1)), (sharding.TRAIN_RULES, (1, 4, 2)),
                         (sharding.TRAIN_RULES, (2, 2, 2)), (sharding.ROLLOUT_RULES, (2, 2, 2))]:
        mesh = sharding.make_mesh(shape)
        model = models.from_pretrained(fixture("qwen3_moe"), mesh=mesh, rules=rules)
        graphdef, state = nnx.split(model)
        with sharding.use_rules(mesh, rules):
            x = jax.device_put(ids, NamedSharding(mesh, sharding.logical_to_spec(("batch", "length"), rules)))
            got = np.asarray(jax.jit(lambda s, i: nnx.merge(graphdef, s)(i))(state, x))
        assert np.abs(got - want).max() <= 1e-5, shape


def _np_balance_loss_and_grad(logits, k, mask):
    """NumPy: transformers' load_balancing_loss_func and its gradient w.r.t. the logits."""
    E = logits.shape[-1]
    flat = logits.reshape(-1, E).astype(np.float64)
    w = np.broadcast_to(mask, logits.shape[:-1]).reshape(-1).astype(np.float64)
    p = np.exp(flat - flat.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    top = np.argsort(-p, axis=-1)[:, :k]
    counts = np.zeros_like(p)
    for j in range(k):
        counts[np.arange(len(p)), top[:, j]] += 1
    frac = (counts * w[:, None]).sum(0) / w.sum()
    mean_prob = (p * w[:, None]).sum(0) / w.sum()
    loss = E * np.sum(frac * mean_prob)
    c = E * frac * w[:, None] / w.sum()  # d loss / d p[t, e]
    grad = p * (c - (p * c).sum(-1, keepdims=True))  # through the softmax
    return loss, grad.reshape(logits.shape)


@pytest.mark.parametrize("masked", [False, True])
def test_load_balancing_loss_and_gradient_match_numpy(masked):
    rng = np.random.default_rng(1)
    L, b, t, E, k = 2, 3, 5, 4, 2
    logits = rng.normal(size=(L, b, t, E)).astype(np.float32)
    mask = (rng.random((b, t)) > 0.3).astype(np.int32) if masked else np.ones((b, t), np.int32)
    want, want_grad = _np_balance_loss_and_grad(logits, k, mask)
    fn = lambda x: models.load_balancing_loss(x, k, jnp.asarray(mask) if masked else None)  # noqa: E731
    loss, grad = jax.value_and_grad(fn)(jnp.asarray(logits))
    np.testing.assert_allclose(float(loss), want, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(grad), want_grad, rtol=1e-4, atol=1e-7)
    # perfectly balanced routing: uniform logits give the minimum, top_k
    assert abs(float(models.load_balancing_loss(jnp.zeros((1, 2, 8, E)), k)) - k) < 1e-6


def test_moe_bf16_and_value_head_round_trip(tmp_path):
    model = models.from_pretrained(fixture("mixtral"), dtype=jnp.bfloat16)
    ref = reference("mixtral")
    assert np.abs(forward(model, ref["input_ids"]) - ref["logits"]).max() < 0.25  # bf16 round-off
    value = models.from_pretrained(fixture("qwen3_moe"), value_head=True, seed=1)
    assert isinstance(value, models.ValueModel) and value.config.is_moe
    models.save_pretrained(value, tmp_path / "v")
    hf = json.loads((tmp_path / "v" / "config.json").read_text())
    assert hf["architectures"] == ["Qwen3MoeForTokenClassification"]
    back = models.from_pretrained(tmp_path / "v")
    a, b = params(value), params(back)
    assert a.keys() == b.keys() and "score/kernel" in a
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)
