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
