"""The full forward's attention choices (`ModelConfig.train_attention`) equal the padding-mask
path ("xla") on real tokens:
- the rotated path (cudnn on GPU): rows are rotated so real tokens start at 0, attention is causal
  with per-row lengths, hidden states are rotated back. On CPU the "rolled" mode runs the same
  rotation with XLA's attention kernel, so this checks everything but the cuDNN kernel itself;
- "splash" (TPU): the Pallas splash kernel with segment ids = the attention mask, run here in
  Pallas interpret mode, forward and gradients, also under shard_map on a mesh.
The choice is part of the config, so a changed choice is a new compilation."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import sharding
from jaxrl_llm import models
from jaxrl_llm.models import _decoder


CONFIG = models.ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, model_type="qwen2",
                            attention_bias=True, dtype="float32", param_dtype="float32", remat="dots")


def _model(impl):
    """The same weights (seed 0) with attention `impl`."""
    return models.CausalLM(CONFIG.replace(train_attention=impl), rngs=nnx.Rngs(params=0))


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


def test_rolled_forward_equals_padding_mask_forward():
    ids, mask = _batch()
    ref = jax.jit(lambda i, m: _model("xla")(i, attention_mask=m))(ids, mask)
    rolled = _model("rolled")
    got = jax.jit(lambda i, m: rolled(i, attention_mask=m))(ids, mask)
    real = np.asarray(mask, bool)
    np.testing.assert_allclose(np.asarray(got)[real], np.asarray(ref)[real], rtol=2e-5, atol=2e-5)
    hidden = rolled.hidden_states(ids, attention_mask=mask)
    assert np.all(np.asarray(hidden)[~real] == 0) and np.all(np.isfinite(np.asarray(got)))


def _grads(impl, ids, mask):
    graphdef, params = nnx.split(_model(impl))
    weights = jnp.asarray(np.random.default_rng(1).normal(size=(4, 12)), jnp.float32) * mask

    def loss(p):
        m = nnx.merge(graphdef, p)
        lp = jax.nn.log_softmax(m(ids, attention_mask=mask), axis=-1)
        return jnp.sum(weights[:, :-1] * jnp.take_along_axis(lp[:, :-1], ids[:, 1:, None], axis=-1)[..., 0])

    return jax.jit(jax.grad(loss))(params)


@pytest.mark.parametrize("impl", ["rolled", "splash"])
def test_forward_gradients_equal_padding_mask_gradients(impl):
    ids, mask = _batch()
    ref, got = _grads("xla", ids, mask), _grads(impl, ids, mask)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("impl", ["rolled", "splash"])
def test_forward_on_a_sharded_mesh_equals_padding_mask_forward(impl):
    """On a (2, 2, 2) mesh; splash runs under shard_map (rows over data x fsdp, heads over tensor)."""
    ids, mask = _batch()
    ref = np.asarray(_model("xla")(ids, attention_mask=mask))
    mesh = sharding.make_mesh((2, 2, 2))
    graphdef, state = nnx.split(_model(impl))
    state = sharding.reshard(state, sharding.state_shardings(state, mesh, "train"))
    with sharding.use_rules(mesh, "train"):
        got = np.asarray(jax.jit(lambda s, i, m: nnx.merge(graphdef, s)(i, attention_mask=m))(state, ids, mask))
    real = np.asarray(mask, bool)
    np.testing.assert_allclose(got[real], ref[real], rtol=2e-5, atol=2e-5)


def test_splash_forward_allows_padding_between_real_tokens():
    """Segment ids need no contiguous run: a hole in a row's mask is padding like any other."""
    ids, mask = _batch()
    mask = mask.at[3, 5].set(0)
    ref, got = (np.asarray(jax.jit(lambda i, m, model=_model(impl): model(i, attention_mask=m))(ids, mask))
                for impl in ("xla", "splash"))
    real = np.asarray(mask, bool)
    np.testing.assert_allclose(got[real], ref[real], rtol=2e-5, atol=2e-5)


def test_changing_the_attention_choice_is_a_new_compilation():
    """The choice lives in the config (the graphdef, a static argument), so a jit keyed on it
    compiles again and the new program has the kernel; a module global was read at trace time
    and a cached program was silently reused."""
    ids, mask = _batch()
    run = jax.jit(lambda g, s, i, m: nnx.merge(g, s)(i, attention_mask=m), static_argnums=0)
    programs = {}
    for impl in ("xla", "splash"):
        graphdef, state = nnx.split(_model(impl))
        programs[impl] = str(jax.make_jaxpr(run.__wrapped__, static_argnums=0)(graphdef, state, ids, mask))
        run(graphdef, state, ids, mask)
    assert run._cache_size() == 2
    assert "pallas_call" in programs["splash"] and "pallas_call" not in programs["xla"]


def test_unknown_attention_choices_are_named():
    with pytest.raises(ValueError, match="train_attention='flash'"):
        CONFIG.replace(train_attention="flash")
    with pytest.raises(ValueError, match="decode_attention='flash'"):
        CONFIG.replace(decode_attention="flash")
    with pytest.raises(ValueError, match="decode_unroll"):
        CONFIG.replace(decode_unroll=-1)
    assert _decoder._train_attention_impl(CONFIG) == "xla"  # auto on CPU
    tpu_shaped = CONFIG.replace(num_attention_heads=1, num_key_value_heads=1, head_dim=128)
    assert _decoder._train_attention_impl(tpu_shaped) == "xla"  # auto: only on a TPU mesh


def test_worker_batches_with_padding_between_real_tokens_are_refused():
    from jaxrl_llm.workers._step import check_contiguous_mask

    _, mask = _batch()
    check_contiguous_mask(np.asarray(mask))  # left, right, both, none: fine
    bad = np.asarray(mask).copy()
    bad[3, 5] = 0
    with pytest.raises(ValueError, match="attention_mask row 3 has padding between real tokens"):
        check_contiguous_mask(bad)
