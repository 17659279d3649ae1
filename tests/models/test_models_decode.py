"""The two layer layouts: a per-layer model (`layer_layout="per_layer"`, the rollout engine's decode
layout) gives the stacked model's logits, prefill cache and decode steps under every decode
attention choice; `unstack_layers` / `stack_layers` convert the weights exactly."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl_llm import models
from jaxrl_llm.models import KVCache

CONFIG = models.ModelConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                            num_attention_heads=4, num_key_value_heads=2, model_type="qwen3",
                            qk_norm=True)


@pytest.fixture(scope="module")
def pair():
    """(stacked model, per-layer model with the same weights via unstack_layers)."""
    stacked = models.init_model(CONFIG, seed=2)
    pure = nnx.to_pure_dict(nnx.state(stacked, nnx.Param))
    graphdef, _ = nnx.split(models.abstract_model(CONFIG, layer_layout="per_layer"), nnx.Param)
    return stacked, nnx.merge(graphdef, models.unstack_layers(pure))


@pytest.fixture(scope="module")
def ids():
    return jnp.asarray(np.random.default_rng(0).integers(0, 96, (3, 12)), jnp.int32)


def test_per_layer_params_have_no_layers_axis_and_round_trip_exactly(pair):
    stacked, per = pair
    assert stacked.model.layer_layout == "stacked" and per.model.layer_layout == "per_layer"
    for _, var in nnx.to_flat_state(nnx.state(per.model.layers, nnx.Param)):
        assert "layers" not in var.get_metadata()["logical_axes"]
    q = per.model.layers[2].self_attn.q_proj["kernel"][...]
    assert q.shape == (32, 4, 8)
    np.testing.assert_array_equal(q, stacked.model.layers.self_attn.q_proj["kernel"][...][2])
    pure = nnx.to_pure_dict(nnx.state(stacked, nnx.Param))
    back = models.stack_layers(models.unstack_layers(pure))
    assert jax.tree.structure(back) == jax.tree.structure(pure)
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(pure)):
        np.testing.assert_array_equal(a, b)
    assert models.count_params(per) == models.count_params(stacked)


def test_per_layer_full_forward_and_prefill_equal_stacked(pair, ids):
    stacked, per = pair
    np.testing.assert_allclose(per(ids), stacked(ids), atol=1e-5, rtol=0)
    _, cache_s = stacked.prefill(ids)
    _, cache_p = per.prefill(ids)
    assert cache_p.per_layer and not cache_s.per_layer and len(cache_p.k) == 3
    np.testing.assert_allclose(np.stack(cache_p.k), cache_s.k, atol=1e-5, rtol=0)
    np.testing.assert_allclose(np.stack(cache_p.v), cache_s.v, atol=1e-5, rtol=0)


def _as(model, **changes):
    """The same weights under a config with `changes` (e.g. another kernel choice)."""
    config = model.config.replace(**changes)
    graphdef, _ = nnx.split(models.abstract_model(config, layer_layout=model.model.layer_layout), nnx.Param)
    return nnx.merge(graphdef, nnx.to_pure_dict(nnx.state(model, nnx.Param)))


@pytest.mark.parametrize("impl", ["einsum", "reduce", "auto", "pallas", "triton"])
def test_per_layer_decode_equals_stacked_decode_and_full_forward(pair, ids, impl):
    """Rows at different cache offsets; two decode steps; every attention choice available on CPU
    (pallas, triton: the TPU and GPU decode kernels in Pallas interpret mode)."""
    stacked, per = (_as(m, decode_attention=impl) for m in pair)
    full = stacked(ids)  # [b, 12, v]
    index = jnp.asarray([4, 7, 9], jnp.int32)
    s = 16
    prefix = ids[:, :9]
    _, pre = stacked.prefill(prefix)
    pad5 = [(0, 0), (0, 0), (0, s - 9), (0, 0), (0, 0)]
    cache_s = KVCache(jnp.pad(pre.k, pad5), jnp.pad(pre.v, pad5))
    cache_p = KVCache(tuple(cache_s.k), tuple(cache_s.v))  # slots >= index are overwritten / masked
    for step in range(2):
        pos = index + step
        tok = jnp.take_along_axis(ids, pos[:, None], axis=1)
        h_s, cache_s = stacked.decode(tok, positions=pos[:, None], cache=cache_s, cache_index=pos)
        h_p, cache_p = per.decode(tok, positions=pos[:, None], cache=cache_p, cache_index=pos)
        want = jnp.take_along_axis(full, pos[:, None, None], axis=1)
        np.testing.assert_allclose(per.logits(h_p), want, atol=1e-4, rtol=0)
        np.testing.assert_allclose(per.logits(h_p), stacked.logits(h_s), atol=1e-5, rtol=0)
        assert isinstance(cache_p.k, tuple) and cache_p.k[0].shape == (3, s, 2, 8)
        np.testing.assert_allclose(np.stack(cache_p.k), cache_s.k, atol=1e-5, rtol=0)


@pytest.mark.parametrize("impl", ["auto", "triton"])
def test_per_layer_decode_is_one_jitted_program_updating_donated_caches(pair, ids, impl):
    """Jitted with the cache donated: the per-layer buffers are consumed and fresh ones returned
    (triton: the kernel writes the new token into the aliased cache itself)."""
    per = _as(pair[1], decode_attention=impl)
    graphdef, state = nnx.split(per)
    _, pre = per.prefill(ids[:, :8])
    cache = KVCache(tuple(jnp.pad(k, [(0, 0), (0, 8), (0, 0), (0, 0)]) for k in pre.k),
                    tuple(jnp.pad(v, [(0, 0), (0, 8), (0, 0), (0, 0)]) for v in pre.v))
    step = jax.jit(lambda st, c, t, i: nnx.merge(graphdef, st).decode(t, positions=i[:, None], cache=c,
                                                                       cache_index=i), donate_argnums=(1,))
    index = jnp.full((3,), 8, jnp.int32)
    old = cache.k[0]
    _, new = step(state, cache, ids[:, 8:9], index)
    assert old.is_deleted() and len(new.k) == 3
    np.testing.assert_allclose(new.k[0][:, :8], pre.k[0], atol=0)
    for layer in new.k + new.v:  # the new token in slot 8, nothing after it
        assert np.all(np.abs(np.asarray(layer[:, 8])).sum(axis=(-1, -2)) > 0)
        np.testing.assert_array_equal(layer[:, 9:], 0.0)


def test_decode_rejects_a_cache_in_the_other_layout(pair, ids):
    stacked, per = pair
    _, pre = stacked.prefill(ids)
    with pytest.raises(ValueError, match="layout"):
        per.decode(ids[:, :1], positions=ids[:, :1], cache=pre, cache_index=jnp.zeros(3, jnp.int32))
    with pytest.raises(ValueError, match="layer_layout"):
        models.init_model(CONFIG, layer_layout="unrolled")


@pytest.mark.parametrize("config", [CONFIG, CONFIG.replace(model_type="qwen2", qk_norm=False, attention_bias=True)],
                         ids=["qwen3_qk_norm", "qwen2_bias"])
def test_fused_projection_layout_equals_stacked_and_round_trips(config, ids):
    """per_layer_fused (one qkv and one gate/up matmul per layer): same logits, cache and decode
    step as the stacked model; convert_layers back to stacked is exact."""
    stacked = models.init_model(config, seed=3)
    pure = nnx.to_pure_dict(nnx.state(stacked, nnx.Param))
    if config.attention_bias:  # non-zero biases, so their fusion is checked too
        pure = jax.tree.map(lambda x: x + 0.1 * jax.random.normal(jax.random.key(0), x.shape, x.dtype), pure)
        stacked = nnx.merge(nnx.split(stacked, nnx.Param)[0], pure)
    fused_pure = models.convert_layers(pure, "per_layer_fused")
    assert models.params_layout(fused_pure) == "per_layer_fused"
    assert set(fused_pure["model"]["layers"][0]["self_attn"]) >= {"qkv_proj", "o_proj"}
    graphdef, _ = nnx.split(models.abstract_model(config, layer_layout="per_layer_fused"), nnx.Param)
    fused = nnx.merge(graphdef, fused_pure)
    assert fused.model.layer_layout == "per_layer_fused"
    np.testing.assert_allclose(fused(ids), stacked(ids), atol=1e-5, rtol=0)
    _, cache_s = stacked.prefill(ids[:, :8])
    _, cache_f = fused.prefill(ids[:, :8])
    np.testing.assert_allclose(np.stack(cache_f.k), cache_s.k, atol=1e-5, rtol=0)
    index = jnp.full((3,), 8, jnp.int32)
    pad = lambda x: jnp.pad(x, [(0, 0), (0, 4), (0, 0), (0, 0)])  # noqa: E731
    h_s, _ = stacked.decode(ids[:, 8:9], positions=index[:, None], cache_index=index,
                            cache=KVCache(jax.vmap(pad)(cache_s.k), jax.vmap(pad)(cache_s.v)))
    h_f, _ = fused.decode(ids[:, 8:9], positions=index[:, None], cache_index=index,
                          cache=KVCache(tuple(map(pad, cache_f.k)), tuple(map(pad, cache_f.v))))
    np.testing.assert_allclose(h_f, h_s, atol=1e-5, rtol=0)
    back = models.convert_layers(fused_pure, "stacked")
    assert jax.tree.structure(back) == jax.tree.structure(pure)
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(pure)):
        np.testing.assert_array_equal(a, b)
