"""Weight sync: zero-copy when layouts match, one reshard otherwise; sampling-function properties."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import rollout
import sharding
from jaxrl_llm.models import ModelConfig, abstract_model, init_model

# heads, kv_heads, mlp and vocab divisible by 8 so the tensor=8 rollout mesh is valid.
WIDE = ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=8, num_key_value_heads=8, model_type="qwen3", qk_norm=True)
PROMPTS = [[5, 9, 17, 3], [40, 2], [77, 12, 90, 31, 6, 8]]
GREEDY = rollout.SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def train_params():
    """A model placed by the train rules on an fsdp=8 mesh, as the trainer holds it."""
    mesh = sharding.make_mesh((1, 8, 1))
    model = sharding.init_sharded(lambda: init_model(WIDE, seed=4), mesh, "train")
    return mesh, nnx.split(model, nnx.Param)


def _leaves(tree):
    return jax.tree.leaves(tree)


def _same_buffers(a, b):
    for ours, theirs in zip(_leaves(a), _leaves(b)):
        assert ours is theirs
        assert ours.addressable_shards[0].data.unsafe_buffer_pointer() == \
            theirs.addressable_shards[0].data.unsafe_buffer_pointer()


def _q_kernel(engine, layer=0):
    layers = engine.params["model"]["layers"]
    if engine.layer_layout == "per_layer":
        return layers[layer]["self_attn"]["q_proj"]["kernel"]
    return layers["self_attn"]["q_proj"]["kernel"][layer]


def test_zero_copy_sync_shares_the_trainers_buffers(train_params):
    mesh, (graphdef, params) = train_params
    engine = rollout.Engine.from_model((graphdef, params), rules="train", max_concurrent_decodes=8,
                                       max_prefill_length=16, max_target_length=32)
    assert engine.mesh is mesh  # mesh=None -> the params' own mesh
    assert engine.layer_layout == "stacked"  # auto: the trainer's buffers can be shared
    assert engine.shares_weights(params)  # what the ahead-of-time compile asks, without arrays
    stats = engine.update_params(params)
    assert stats["zero_copy"] and stats["bytes_moved"] == 0 and stats["bytes_total"] > 0
    _same_buffers(engine.params, params)
    # a dtype change is not zero-copy: auto splits the layers during the cast (per_layer)
    cast = rollout.Engine.from_model((graphdef, params), rules="train", max_concurrent_decodes=8,
                                     max_prefill_length=16, max_target_length=32, dtype="bfloat16")
    assert cast.layer_layout == "per_layer" and not cast.shares_weights(params)
    stats = cast.update_params(params)
    assert not stats["zero_copy"] and stats["bytes_moved"] == stats["bytes_total"] > 0
    assert stats["bytes_total"] == sum(x.nbytes for x in _leaves(params)) // 2  # fp32 -> bf16
    assert stats["num_copied"] == len(_leaves(cast.params)) > len(_leaves(params))
    assert all(x.dtype == jnp.bfloat16 for x in _leaves(cast.params))
    np.testing.assert_array_equal(
        np.asarray(_q_kernel(cast, 1)),
        np.asarray(params["model"]["layers"]["self_attn"]["q_proj"]["kernel"][...][1].astype(jnp.bfloat16)))
    # on GPU auto takes the fused per-layer layout for such a copying sync (faster decode there);
    # shareable params stay stacked on any platform
    from rollout._weights import resolve_layout
    pure, bf16 = nnx.to_pure_dict(params), jnp.bfloat16
    assert resolve_layout("auto", pure, cast._layout_shardings, bf16, "gpu") == "per_layer_fused"
    assert resolve_layout("auto", pure, cast._layout_shardings, bf16, "cpu") == "per_layer"
    assert resolve_layout("auto", pure, engine._layout_shardings, jnp.float32, "gpu") == "stacked"


@pytest.mark.parametrize("layout", ["per_layer", "per_layer_fused"])
def test_sync_in_layer_chunks_equals_the_one_program_sync(train_params, monkeypatch, layout):
    """A per-layer target is written by one program per SYNC_LAYERS_PER_PROGRAM layers (host work
    overlaps the device copy): same arrays, shardings and stats as the whole program, also when
    the second call takes its decisions from the cache."""
    from rollout import _weights
    _, (_, params) = train_params
    pure = nnx.to_pure_dict(params)
    mesh = sharding.make_mesh((1, 1, 8))
    abstract = {k: nnx.to_pure_dict(sharding.state_shardings(
        nnx.split(abstract_model(WIDE.replace(dtype=jnp.bfloat16, param_dtype=jnp.bfloat16),
                                                 layer_layout=k), nnx.Param)[1], mesh, sharding.get_rules("rollout")))
        for k in ("stacked", "per_layer", "per_layer_fused")}
    monkeypatch.setattr(_weights, "SYNC_LAYERS_PER_PROGRAM", 1)
    chunked = _weights.WeightSync(layout, abstract, jnp.bfloat16, mesh)
    assert len(chunked._parts) == WIDE.num_hidden_layers
    whole = jax.tree.leaves(chunked._relayout(pure))
    for _ in range(2):
        new, stats = chunked(pure)
        assert jax.tree.structure(new) == jax.tree.structure(abstract[layout])
        for a, b in zip(jax.tree.leaves(new), whole):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
            assert a.sharding.is_equivalent_to(b.sharding, a.ndim)
        assert stats == {"bytes_moved": sum(x.nbytes for x in whole), "bytes_total": sum(x.nbytes for x in whole),
                         "num_copied": len(whole), "fresh": True, "donated": False}


def _pointers(tree):
    return [s.data.unsafe_buffer_pointer() for x in _leaves(tree) for s in x.addressable_shards]


@pytest.mark.parametrize("layout", ["per_layer", "per_layer_fused"])
def test_a_relayout_sync_writes_into_the_engines_previous_weights(train_params, monkeypatch, layout):
    """A relayout sync donates the weights an earlier one made (no buffer freed or allocated):
    same buffers, same values as without donation. A reference kept to any part of them keeps
    them intact (no donation), as does a sync whose weights may alias the caller's."""
    from rollout import _weights
    monkeypatch.setattr(_weights, "SYNC_LAYERS_PER_PROGRAM", 1)  # one donating program per layer
    _, (graphdef, params) = train_params
    engine = rollout.Engine.from_model((graphdef, params), max_concurrent_decodes=8, max_prefill_length=16,
                                       max_target_length=32, dtype="bfloat16", layer_layout=layout)
    want = [np.array(x, copy=True) for x in _leaves(engine.params)]

    def check_values():  # (a loop variable left over here would be a reference kept)
        for a, b in zip(_leaves(engine.params), want):
            np.testing.assert_array_equal(np.asarray(a), b)

    first = _pointers(engine.params)
    assert engine.update_params(params)["donated"]
    assert _pointers(engine.params) == first
    check_values()

    for view in (lambda p: p, lambda p: p["model"]["layers"][1]):  # a caller's view of all, of one layer
        kept = view(engine.params)
        assert not engine.update_params(params)["donated"]
        assert not any(x.is_deleted() for x in _leaves(kept))
        assert _pointers(engine.params) != _pointers(kept)
        del kept
    own = engine.params
    engine.update_params(own)  # the same layout: the engine now holds the caller's arrays
    assert not engine.update_params(params)["donated"]
    assert not any(x.is_deleted() for x in _leaves(own))
    del own
    with pytest.raises(ValueError, match="does not match the engine's model"):
        engine.update_params({"model": {}})
    engine.check_params()  # a bad tree leaves the weights as they were
    check_values()
    monkeypatch.setattr(_weights, "SYNC_DONATE", False)
    before = _pointers(engine.params)
    engine.update_params(params)
    assert _pointers(engine.params) != before
    check_values()


@pytest.mark.parametrize("layer_layout", ["per_layer", "per_layer_fused", "stacked"])
def test_handing_the_engine_its_own_params_moves_zero_bytes(train_params, layer_layout):
    _, (graphdef, params) = train_params
    engine = rollout.Engine.from_model((graphdef, params), max_concurrent_decodes=8,
                                       max_prefill_length=16, max_target_length=32,
                                       dtype="bfloat16", layer_layout=layer_layout)
    own = engine.params
    stats = engine.update_params(own)
    assert stats["zero_copy"] and stats["bytes_moved"] == 0 and stats["num_copied"] == 0
    assert stats["bytes_total"] == sum(x.nbytes for x in _leaves(own)) > 0
    _same_buffers(engine.params, own)


def test_resharded_sync_fsdp_to_tensor_gives_identical_generations(train_params):
    """train fsdp 1x8x1 -> rollout tensor 1x1x8 and 1x2x4 (per-layer) on 8 CPU devices: same greedy
    tokens as a stacked 1-device engine."""
    _, (graphdef, params) = train_params
    single = rollout.Engine.from_model(
        (graphdef, jax.device_put(params, jax.devices()[0])), max_concurrent_decodes=4,
        max_prefill_length=16, max_target_length=32)
    assert single.layer_layout == "stacked"
    a = rollout.RolloutDriver(single).generate(PROMPTS, n=2, max_new_tokens=8, sampling=GREEDY)
    for shape in [(1, 1, 8), (1, 2, 4)]:
        tp = rollout.Engine.from_model((graphdef, params), mesh=sharding.make_mesh(shape),
                                       max_concurrent_decodes=4, max_prefill_length=16,
                                       max_target_length=32)
        assert tp.layer_layout == "per_layer"
        stats = tp.update_params(params)
        assert not stats["zero_copy"] and stats["bytes_moved"] == stats["bytes_total"] > 0
        q = _q_kernel(tp)
        assert q.sharding.spec == jax.sharding.PartitionSpec(None, "tensor", None)
        assert q.addressable_shards[0].data.shape == (64, 8 // shape[2], 8)
        b = rollout.RolloutDriver(tp).generate(PROMPTS, n=2, max_new_tokens=8, sampling=GREEDY)
        np.testing.assert_array_equal(a.responses, b.responses)
        np.testing.assert_allclose(a.rollout_log_probs, b.rollout_log_probs, atol=1e-4)
    # the fused projections on the tensor-sharded mesh: same tokens and log-probs
    fused = rollout.Engine.from_model((graphdef, params), mesh=sharding.make_mesh((1, 2, 4)),
                                      max_concurrent_decodes=4, max_prefill_length=16,
                                      max_target_length=32, layer_layout="per_layer_fused")
    c = rollout.RolloutDriver(fused).generate(PROMPTS, n=2, max_new_tokens=8, sampling=GREEDY)
    np.testing.assert_array_equal(a.responses, c.responses)
    np.testing.assert_allclose(a.rollout_log_probs, c.rollout_log_probs, atol=1e-4)

    # New weights take effect and the KV cache buffers survive the sync (tp: the 1x2x4 engine).
    driver = rollout.RolloutDriver(tp)
    driver.generate(PROMPTS, n=1, max_new_tokens=8, sampling=GREEDY)
    cache_before = [x.shape for x in driver._state.cache.k]
    new_params = jax.tree.map(lambda x: x * 1.5, params)
    tp.update_params(new_params)
    after = driver.generate(PROMPTS, n=2, max_new_tokens=8, sampling=GREEDY)
    assert not np.array_equal(after.responses, b.responses)
    assert [x.shape for x in driver._state.cache.k] == cache_before
    with pytest.raises(ValueError, match="does not match"):
        tp.update_params({"model": {}})


def test_bf16_per_layer_sync_from_fp32_trainer_params_changes_outputs(train_params):
    """The normal RL sync: the trainer's stacked fp32 params -> per-layer bf16, every step."""
    _, (graphdef, params) = train_params
    engine = rollout.Engine.from_model((graphdef, params), mesh=sharding.make_mesh((1, 1, 8)),
                                       max_concurrent_decodes=4, max_prefill_length=16,
                                       max_target_length=32, dtype="bfloat16")
    assert engine.layer_layout == "per_layer"
    driver = rollout.RolloutDriver(engine)
    before = driver.generate(PROMPTS, n=1, max_new_tokens=8, sampling=GREEDY)
    stats = engine.update_params(jax.tree.map(lambda x: x * 1.5, params))
    assert stats["bytes_moved"] == stats["bytes_total"] > 0 and not stats["zero_copy"]
    after = driver.generate(PROMPTS, n=1, max_new_tokens=8, sampling=GREEDY)
    assert not np.array_equal(before.responses, after.responses)
    assert all(x.dtype == jnp.bfloat16 for x in driver._state.cache.k)


def test_per_layer_sync_across_device_sets_gives_identical_generations(train_params):
    """Separate placement: trainer on devices 0-3 (fsdp), rollout on devices 4-7 (tensor)."""
    _, (graphdef, params) = train_params
    devices = jax.devices()
    train_mesh = sharding.make_mesh((1, 4, 1), devices=devices[:4])
    train = sharding.reshard(params, sharding.state_shardings(params, train_mesh, "train"))
    rollout_mesh = sharding.make_mesh((1, 1, 4), devices=devices[4:])
    engine = rollout.Engine.from_model((graphdef, train), mesh=rollout_mesh, max_concurrent_decodes=4,
                                       max_prefill_length=16, max_target_length=32)
    assert engine.layer_layout == "per_layer"
    stats = engine.update_params(train)
    assert stats["bytes_moved"] == stats["bytes_total"] > 0
    assert {d for x in _leaves(engine.params) for d in x.sharding.device_set} == set(devices[4:])
    single = rollout.Engine.from_model((graphdef, jax.device_put(params, devices[0])),
                                       max_concurrent_decodes=4, max_prefill_length=16,
                                       max_target_length=32)
    a = rollout.RolloutDriver(single).generate(PROMPTS, n=1, max_new_tokens=6, sampling=GREEDY)
    b = rollout.RolloutDriver(engine).generate(PROMPTS, n=1, max_new_tokens=6, sampling=GREEDY)
    np.testing.assert_array_equal(a.responses, b.responses)


def test_engine_refuses_to_run_on_donated_weights(train_params):
    _, (graphdef, params) = train_params
    own = jax.tree.map(lambda x: x + 0, params)
    engine = rollout.Engine.from_model((graphdef, own), rules="train", max_concurrent_decodes=8,
                                       max_prefill_length=16, max_target_length=32)
    jax.tree.leaves(own)[0].delete()  # what a donating train step does to a shared buffer
    with pytest.raises(RuntimeError, match="update_params"):
        rollout.RolloutDriver(engine).generate(PROMPTS, n=1, max_new_tokens=4)


# ------------------------------------------------------------------------------------ sampling
_DRAW = jax.jit(jax.vmap(rollout.sample, in_axes=(None, 0, None, None, None)))
N_DRAWS = 256


def _draw(logits, temperature, top_k, top_p, seed=0):
    """N_DRAWS samples per row: tokens, log_probs [N_DRAWS, b] (one compile for every setting)."""
    b = logits.shape[0]
    keys = jax.random.split(jax.random.key(seed), N_DRAWS * b).reshape(N_DRAWS, b)
    return _DRAW(logits, keys, jnp.full((b,), temperature, jnp.float32),
                 jnp.full((b,), top_k, jnp.int32), jnp.full((b,), top_p, jnp.float32))


def test_top_k_and_top_p_never_emit_a_filtered_token():
    logits = jax.random.normal(jax.random.key(1), (4, 48)) * 2.0
    toks, _ = _draw(logits, 1.0, 4, 1.0)
    topk = np.argsort(-np.asarray(logits), axis=-1)[:, :4]
    for row in range(4):
        assert set(np.asarray(toks[:, row]).tolist()) <= set(topk[row].tolist())
        assert len(set(np.asarray(toks[:, row]).tolist())) > 1
    toks, _ = _draw(logits, 1.0, -1, 0.6)
    probs = np.asarray(jax.nn.softmax(logits, axis=-1))
    for row in range(4):
        order = np.argsort(-probs[row])
        keep = order[: int(np.searchsorted(np.cumsum(probs[row][order]), 0.6) + 1)]
        assert set(np.asarray(toks[:, row]).tolist()) <= set(keep.tolist())
    unfiltered, _ = _draw(logits, 1.0, -1, 1.0)
    assert len(set(np.asarray(unfiltered[:, 0]).tolist())) > 8


def test_temperature_to_zero_matches_greedy_and_log_probs_are_pre_filter():
    logits = jax.random.normal(jax.random.key(2), (4, 48)) * 3.0
    greedy = np.argmax(np.asarray(logits), axis=-1)
    cold, _ = _draw(logits, 1e-4, -1, 1.0)
    assert (np.asarray(cold) == greedy[None]).all()
    toks, lp = _draw(logits, 0.0, 3, 0.5)
    assert (np.asarray(toks) == greedy[None]).all()
    want = np.asarray(jax.nn.log_softmax(logits, -1))[np.arange(4), greedy]
    np.testing.assert_allclose(np.asarray(lp)[0], want, atol=1e-6)
    toks, lp = _draw(logits, 2.0, 2, 1.0)
    full = np.asarray(jax.nn.log_softmax(logits / 2.0, -1))
    np.testing.assert_allclose(np.asarray(lp), np.take_along_axis(full[None], np.asarray(toks)[..., None], -1)[..., 0], atol=1e-6)


@pytest.mark.parametrize("chunk", [7, 1024])  # several vocabulary chunks, and one
def test_sampled_frequencies_follow_the_filtered_softmax(monkeypatch, chunk):
    monkeypatch.setattr(rollout._sampling, "_CHUNK", chunk)
    logits = jax.random.normal(jax.random.key(3), (2, 48)) * 1.5
    draws = jax.jit(jax.vmap(rollout.sample, in_axes=(None, 0, None, None, None)))
    keys = jax.random.split(jax.random.key(4), 4096 * 2).reshape(4096, 2)
    b = logits.shape[0]
    for top_k, top_p in ((-1, 1.0), (6, 0.8)):
        toks, _ = draws(logits, keys, jnp.full((b,), 0.7, jnp.float32), jnp.full((b,), top_k, jnp.int32),
                        jnp.full((b,), top_p, jnp.float32))
        scaled = np.asarray(logits, np.float64) / 0.7
        for row in range(b):
            p = np.exp(scaled[row] - scaled[row].max())
            p /= p.sum()
            order = np.argsort(-p)
            keep = order[:top_k] if top_k > 0 else order
            q = np.cumsum(p[keep]) / p[keep].sum()  # top-p over the top-k tokens' renormalised mass
            keep = keep[: int(np.searchsorted(q, top_p) + 1)] if top_p < 1 else keep
            want = np.zeros_like(p)
            want[keep] = p[keep] / p[keep].sum()
            got = np.bincount(np.asarray(toks[:, row]), minlength=48) / toks.shape[0]
            assert np.abs(got - want).max() < 0.03, (top_k, top_p, row)
            assert got[want == 0].sum() == 0
