"""The Pallas TPU kernels (`jaxrl_llm.models._kernels`) against the XLA math they replace, in
Pallas interpret mode on CPU: splash causal attention with segment ids vs `attend` with the
padding mask, the decode kernel vs `attend_one`, for one and several kv heads and sequence
lengths that are not whole kernel blocks."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm.models import _decoder, _kernels


def _normal(rng, shape):
    return jnp.asarray(rng.normal(size=shape), jnp.float32)


def test_splash_equals_padding_mask_attention_on_real_tokens():
    rng = np.random.default_rng(0)
    b, t, h, kvh, d = 3, 40, 4, 2, 16  # t is padded to a 128 block inside
    q, k, v = _normal(rng, (b, t, h, d)), _normal(rng, (b, t, kvh, d)), _normal(rng, (b, t, kvh, d))
    mask = np.ones((b, t), np.int32)
    mask[0, :5], mask[0, 30:] = 0, 0  # left + right padding
    mask[1, 35:] = 0
    mask[2, 10:13] = 0  # a hole: segment ids need no contiguous run
    got = jax.jit(_kernels.splash_causal)(q, k, v, jnp.asarray(mask))
    want = _decoder.attend(q, k, v, _decoder.causal_padding_mask(jnp.asarray(mask)))
    real = mask.astype(bool)
    np.testing.assert_allclose(np.asarray(got)[real], np.asarray(want)[real], atol=2e-6, rtol=0)


@pytest.mark.parametrize("kvh", [1, 2])
def test_decode_kernel_equals_one_query_attention(kvh):
    rng = np.random.default_rng(1)
    b, h, d, s = 3, 4, 16, 48
    q = _normal(rng, (b, 1, h, d))
    k, v = _normal(rng, (b, s, kvh, d)), _normal(rng, (b, s, kvh, d))
    lengths = jnp.asarray([1, 17, s], jnp.int32)  # one slot, a partial block, the whole cache
    got = jax.jit(_kernels.decode_attention)(q, k, v, lengths)
    want = _decoder.attend_one(q, k, v, lengths)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-6, rtol=0)
    # slots past a row's length do not matter
    noisy = k.at[0, 1:].set(1e3)
    np.testing.assert_allclose(np.asarray(jax.jit(_kernels.decode_attention)(q, noisy, v, lengths))[0],
                               np.asarray(got)[0], atol=0, rtol=0)


@pytest.mark.parametrize("plan", [None, {"splits": 3, "block": 16}], ids=["one_split", "three_splits"])
def test_triton_decode_kernel_equals_one_query_attention(plan):
    """The GPU (Pallas Triton) decode kernel, interpret mode: one split and several merged splits
    (a split can be empty: row 1's one slot), rows of one slot, a partial block, the whole
    cache and an empty row (output 0); slots past a row's length may hold anything, NaN included."""
    rng = np.random.default_rng(2)
    b, h, kvh, d, s = 4, 6, 2, 16, 48
    q = _normal(rng, (b, 1, h, d))
    k, v = _normal(rng, (b, s, kvh, d)), _normal(rng, (b, s, kvh, d))
    lengths = jnp.asarray([17, 1, s, 0], jnp.int32)
    run = jax.jit(lambda *a: _kernels.triton_decode_attention(*a, plan=plan))
    got = np.asarray(run(q, k, v, lengths))
    want = np.asarray(_decoder.attend_one(q, k, v, lengths))
    np.testing.assert_allclose(got[:3], want[:3], atol=2e-6, rtol=0)
    np.testing.assert_array_equal(got[3], 0.0)
    past = (jnp.arange(s)[None, :, None, None] >= lengths[:, None, None, None])
    noisy_k, noisy_v = jnp.where(past, 1e4, k), jnp.where(past, jnp.nan, v)
    np.testing.assert_array_equal(np.asarray(run(q, noisy_k, noisy_v, lengths)), got)


def test_triton_decode_plan_splits_only_long_caches_and_names_bad_lengths():
    assert _kernels.triton_decode_plan(256, 2, 768) == {"block": 64, "splits": 1, "num_warps": 4, "num_stages": 2}
    assert _kernels.triton_decode_plan(64, 2, 768)["num_stages"] == 3  # 128 programs: deeper pipeline
    assert _kernels.triton_decode_plan(8, 2, 32768)["splits"] == 16  # 16 programs -> 256 >= 132 SMs
    with pytest.raises(ValueError, match="multiple of 16"):
        _kernels.triton_decode_plan(4, 2, 40)
    with pytest.raises(ValueError, match="splits=5"):
        _kernels.triton_decode_plan(4, 2, 48, splits=5)


def test_auto_decode_attention_on_gpu_is_triton_where_the_kernel_applies(monkeypatch):
    """decode_attention='auto' with the GPU as target: triton for bf16/fp16, a power-of-two
    head_dim and a cache length that is a multiple of 16; cuDNN otherwise; einsum in fp32 or for
    several new tokens per row."""
    from jaxrl_llm.models import ModelConfig

    monkeypatch.setattr(_kernels, "target_platform", lambda: "gpu")
    config = ModelConfig(vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                         num_attention_heads=1, num_key_value_heads=1)
    pick = lambda dtype, d, s, t=1: _decoder._decode_attention_impl(config, t, dtype, d, s)  # noqa: E731
    assert pick(jnp.bfloat16, 128, 768) == "triton"
    assert pick(jnp.float16, 64, 1024) == "triton"
    assert pick(jnp.bfloat16, 128, 770) == "cudnn"  # cache length not a multiple of 16
    assert pick(jnp.bfloat16, 80, 768) == "cudnn"  # head_dim not a power of two
    assert pick(jnp.float32, 128, 768) == "einsum"
    assert pick(jnp.bfloat16, 128, 768, t=2) == "einsum"
    assert _decoder._decode_attention_impl(config.replace(decode_attention="cudnn"), 1, jnp.bfloat16, 128, 768) == "cudnn"


def test_triton_decode_kernel_under_a_mesh_runs_per_shard():
    """Under `sharding.use_rules` the kernel runs per device on its rows and kv heads (rollout
    rules: cache rows over data, kv heads over tensor) and gives the unsharded result."""
    import sharding
    from jax.sharding import NamedSharding

    rng = np.random.default_rng(4)
    b, h, kvh, d, s = 4, 8, 2, 16, 32
    q = _normal(rng, (b, 1, h, d))
    k, v = _normal(rng, (b, s, kvh, d)), _normal(rng, (b, s, kvh, d))
    lengths = jnp.asarray([3, 32, 17, 9], jnp.int32)
    want = np.asarray(_decoder.attend_one(q, k, v, lengths))
    mesh = sharding.make_mesh({"data": 2, "tensor": 2}, devices=jax.devices()[:4])
    rules = sharding.get_rules("rollout")
    with sharding.use_rules(mesh, rules):
        put = lambda x, axes: jax.device_put(x, NamedSharding(mesh, sharding.logical_to_spec(axes, rules)))  # noqa: E731
        args = (put(q, ("batch", None, "heads", "head_dim")), put(k, ("cache_batch", "cache_length", "kv_heads", "head_dim")),
                put(v, ("cache_batch", "cache_length", "kv_heads", "head_dim")), put(lengths, ("cache_batch",)))
        got = jax.jit(_kernels.triton_decode_attention)(*args)
        assert len(got.sharding.device_set) == 4
    np.testing.assert_allclose(np.asarray(got), want, atol=2e-6, rtol=0)


def test_decode_kernels_refuse_rules_that_split_the_cache_length():
    """A rule table that shards `cache_length` would hand each device part of every row's cache:
    both decode kernels refuse it, naming the dim, instead of attending over a part."""
    import sharding

    rules = tuple((name, "data" if name == "cache_length" else axes) for name, axes in sharding.get_rules("rollout"))
    mesh = sharding.make_mesh({"data": 2}, devices=jax.devices()[:2])
    rng = np.random.default_rng(5)
    q, k = _normal(rng, (2, 1, 4, 16)), _normal(rng, (2, 32, 2, 16))
    lengths = jnp.asarray([3, 32], jnp.int32)
    for kernel in (_kernels.decode_attention, _kernels.triton_decode_attention):
        with sharding.use_rules(mesh, rules), pytest.raises(ValueError, match="'cache_length' dim whole"):
            kernel(q, k, k, lengths)
