"""The full forward's rotated attention path (`TRAIN_ATTENTION` cudnn on GPU) equals the
padding-mask path: rows are rotated so real tokens start at 0, attention is causal with per-row
lengths, hidden states are rotated back. On CPU the "rolled" mode runs the same rotation with
XLA's attention kernel, so this checks everything but the cuDNN kernel itself."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import sharding
from jaxrl_llm import models
from jaxrl_llm.models import _decoder


@pytest.fixture
def model():
    cfg = models.ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, model_type="qwen2",
                             attention_bias=True, dtype="float32", param_dtype="float32", remat="dots")
    return models.CausalLM(cfg, rngs=nnx.Rngs(params=0))


def _batch():
    """verl layout: left-padded prompts + right-padded responses; one row has no padding."""
    rng = np.random.default_rng(0)
    ids = rng.integers(1, 64, (4, 12)).astype(np.int32)
    mask = np.ones((4, 12), np.int32)
    mask[0, :3] = 0                   # left padding
    mask[1, 9:] = 0                   # right padding
    mask[2, :2], mask[2, 10:] = 0, 0  # both
    ids[mask == 0] = 0
    return jnp.asarray(ids), jnp.asarray(mask)


def _with(impl, fn):
    old = _decoder.TRAIN_ATTENTION
    _decoder.TRAIN_ATTENTION = impl
    try:
        return fn()
    finally:
        _decoder.TRAIN_ATTENTION = old


def test_rolled_forward_equals_padding_mask_forward(model):
    ids, mask = _batch()
    ref = _with("xla", lambda: jax.jit(lambda i, m: model(i, attention_mask=m))(ids, mask))
    got = _with("rolled", lambda: jax.jit(lambda i, m: model(i, attention_mask=m))(ids, mask))
    real = np.asarray(mask, bool)
    np.testing.assert_allclose(np.asarray(got)[real], np.asarray(ref)[real], rtol=2e-5, atol=2e-5)
    hidden = _with("rolled", lambda: model.hidden_states(ids, attention_mask=mask))
    assert np.all(np.asarray(hidden)[~real] == 0) and np.all(np.isfinite(np.asarray(got)))


def test_rolled_forward_gradients_equal_padding_mask_gradients(model):
    ids, mask = _batch()
    graphdef, params = nnx.split(model)
    weights = jnp.asarray(np.random.default_rng(1).normal(size=(4, 12)), jnp.float32) * mask

    def loss(p):
        m = nnx.merge(graphdef, p)
        lp = jax.nn.log_softmax(m(ids, attention_mask=mask), axis=-1)
        return jnp.sum(weights[:, :-1] * jnp.take_along_axis(lp[:, :-1], ids[:, 1:, None], axis=-1)[..., 0])

    ref = _with("xla", lambda: jax.jit(jax.grad(loss))(params))
    got = _with("rolled", lambda: jax.jit(jax.grad(loss))(params))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)


def test_rolled_forward_on_a_sharded_mesh(model):
    ids, mask = _batch()
    ref = _with("xla", lambda: np.asarray(model(ids, attention_mask=mask)))
    mesh = sharding.make_mesh((2, 2, 2))
    graphdef, state = nnx.split(model)
    state = sharding.reshard(state, sharding.state_shardings(state, mesh, "train"))
    with sharding.use_rules(mesh, "train"):
        got = _with("rolled", lambda: np.asarray(
            jax.jit(lambda s, i, m: nnx.merge(graphdef, s)(i, attention_mask=m))(state, ids, mask)))
    real = np.asarray(mask, bool)
    np.testing.assert_allclose(got[real], ref[real], rtol=2e-5, atol=2e-5)


def test_unknown_train_attention_is_named():
    with pytest.raises(ValueError, match="TRAIN_ATTENTION must be"):
        _with("flash", lambda: _decoder._train_attention_impl(jnp.bfloat16, 64))
    assert _with("auto", lambda: _decoder._train_attention_impl(jnp.bfloat16, 64)) == "xla"  # CPU


def test_worker_batches_with_padding_between_real_tokens_are_refused():
    from jaxrl_llm.workers._step import check_contiguous_mask

    _, mask = _batch()
    check_contiguous_mask(np.asarray(mask))  # left, right, both, none: fine
    bad = np.asarray(mask).copy()
    bad[3, 5] = 0
    with pytest.raises(ValueError, match="attention_mask row 3 has padding between real tokens"):
        check_contiguous_mask(bad)
