"""Packed rows (sequence packing): several sequences concatenated into one row, the attention
mask holding segment ids (1, 2, 3, ... per sequence, 0 padding) and positions restarting per
sequence. Every training attention path runnable on CPU (xla, rolled = the cuDNN path's XLA
stand-in, splash in Pallas interpret mode) gives each sequence of a pack the logits and the
gradients it has alone; 0/1 masks behave as before packing existed."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl_llm import models
from jaxrl_llm.models import _decoder

CONFIG = models.ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, model_type="qwen2",
                            attention_bias=True, dtype="float32", param_dtype="float32", remat="dots")
LENGTHS = (5, 3, 6)  # three sequences of different lengths
T = 18               # pack length: 14 real tokens + 4 padding


def _model(impl, value_head=False):
    cls = models.ValueModel if value_head else models.CausalLM
    return cls(CONFIG.replace(train_attention=impl), rngs=nnx.Rngs(params=0))


def _rows():
    rng = np.random.default_rng(0)
    return [rng.integers(1, 64, (n,)).astype(np.int32) for n in LENGTHS]


def _pack(rows):
    """Two pack rows: the three sequences then padding; a single sequence (id 1) after left padding."""
    ids, seg = np.zeros((2, T), np.int32), np.zeros((2, T), np.int32)
    at = 0
    for s, row in enumerate(rows, start=1):
        ids[0, at:at + len(row)], seg[0, at:at + len(row)] = row, s
        at += len(row)
    ids[1, 4:4 + len(rows[2])], seg[1, 4:4 + len(rows[2])] = rows[2], 1
    return jnp.asarray(ids), jnp.asarray(seg)


def _spans():
    starts = np.cumsum((0,) + LENGTHS[:-1])
    return [(int(a), int(a) + n) for a, n in zip(starts, LENGTHS)]


def test_segment_positions_restart_in_every_segment():
    seg = jnp.asarray([[1, 1, 1, 2, 2, 3, 0, 0], [0, 0, 1, 1, 1, 0, 0, 0], [1, 1, 0, 1, 2, 2, 0, 0]])
    want = [[0, 1, 2, 0, 1, 0, 0, 0], [0, 0, 0, 1, 2, 0, 0, 0], [0, 1, 0, 2, 0, 1, 0, 0]]
    np.testing.assert_array_equal(np.asarray(models.segment_positions(seg)), want)
    got = np.asarray(models.default_positions(seg))  # the default when positions are None
    np.testing.assert_array_equal(got[seg != 0], np.asarray(want)[seg != 0])


def test_zero_one_masks_keep_their_mask_and_positions():
    """Random 0/1 masks (holes included): the dense mask and the default positions are the
    pre-packing formulas, at padding too."""
    mask = jnp.asarray(np.random.default_rng(3).integers(0, 2, (6, 11)), jnp.int32)
    t = mask.shape[1]
    old_mask = jnp.tril(jnp.ones((t, t), bool))[None] & mask.astype(bool)[:, None, :]
    np.testing.assert_array_equal(np.asarray(models.causal_padding_mask(mask)), np.asarray(old_mask))
    old_positions = jnp.maximum(jnp.cumsum(mask, axis=-1) - 1, 0)
    np.testing.assert_array_equal(np.asarray(models.default_positions(mask)), np.asarray(old_positions))


def test_causal_padding_mask_does_not_cross_segments():
    seg = jnp.asarray([[1, 1, 2, 2, 0]])
    want = np.array([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [0, 0, 1, 0, 0], [0, 0, 1, 1, 0], [1, 1, 1, 1, 0]], bool)
    np.testing.assert_array_equal(np.asarray(models.causal_padding_mask(seg))[0], want)


def test_segment_runs_are_cudnns_packed_layout():
    seg = jnp.asarray([[1, 1, 1, 2, 2, 3, 0, 0], [0, 0, 1, 1, 1, 0, 0, 0]])
    offsets, lengths = _decoder._segment_runs(seg)
    assert offsets.shape == (2, 9) and lengths.shape == (2, 8)
    np.testing.assert_array_equal(np.asarray(offsets[:, :4]), [[0, 3, 5, -1], [2, -1, -1, -1]])
    np.testing.assert_array_equal(np.asarray(lengths[:, :4]), [[3, 2, 1, -1], [3, -1, -1, -1]])
    assert np.all(np.asarray(offsets[:, 4:]) == -1) and np.all(np.asarray(lengths[:, 4:]) == -1)
    real_query = (np.asarray(seg) != 0)[:, :, None]  # the runs mask and the segment mask agree there
    np.testing.assert_array_equal(np.asarray(_decoder._runs_mask(offsets, lengths, 8)) & real_query,
                                  np.asarray(models.causal_padding_mask(seg)) & real_query)


@pytest.mark.parametrize("impl", ["xla", "rolled", "splash"])
def test_each_sequence_of_a_pack_has_the_logits_it_has_alone(impl):
    rows = _rows()
    ids, seg = _pack(rows)
    model = _model(impl)
    alone = [np.asarray(jax.jit(lambda i: _model("xla")(i))(jnp.asarray(r)[None]))[0] for r in rows]
    run = jax.jit(lambda i, m, p: model(i, attention_mask=m, positions=p, packed=True))
    for positions in (models.segment_positions(seg), None):  # given, and the default
        got = np.asarray(run(ids, seg, positions))
        for (a, b), ref in zip(_spans(), alone):
            np.testing.assert_allclose(got[0, a:b], ref, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(got[1, 4:4 + LENGTHS[2]], alone[2], rtol=1e-5, atol=1e-5)
        assert np.all(np.isfinite(got))


def test_each_sequence_of_a_pack_has_the_values_it_has_alone():
    rows = _rows()
    ids, seg = _pack(rows)
    got = np.asarray(_model("rolled", value_head=True)(ids, attention_mask=seg, packed=True))
    for (a, b), r in zip(_spans(), rows):
        ref = np.asarray(_model("xla", value_head=True)(jnp.asarray(r)[None]))[0]
        np.testing.assert_allclose(got[0, a:b], ref, rtol=1e-5, atol=1e-5)


def _token_loss(model, ids, mask, positions, packed, weights):
    """Sum over tokens of weight * log p(next token), where the next token is of the same sequence."""
    lp = jax.nn.log_softmax(model(ids, attention_mask=mask, positions=positions, packed=packed), axis=-1)
    nxt = jnp.take_along_axis(lp[:, :-1], ids[:, 1:, None], axis=-1)[..., 0]
    same = (mask[:, 1:] == mask[:, :-1]) & (mask[:, 1:] != 0)
    return jnp.sum(jnp.where(same, weights[:, :-1] * nxt, 0.0))


@pytest.mark.parametrize("impl", ["xla", "rolled", "splash"])
def test_pack_gradients_equal_the_sum_of_each_sequences_gradients(impl):
    rows = _rows()
    ids, seg = _pack(rows)
    weights = jnp.asarray(np.random.default_rng(1).normal(size=(2, T)), jnp.float32)
    graphdef, params = nnx.split(_model(impl))
    packed_loss = lambda p: _token_loss(nnx.merge(graphdef, p), ids, seg,  # noqa: E731
                                        models.segment_positions(seg), True, weights)
    got = jax.jit(jax.grad(packed_loss))(params)

    ref_def, ref_params = nnx.split(_model("xla"))

    def rows_loss(p):
        total, m = 0.0, nnx.merge(ref_def, p)
        for (a, b), r in zip(_spans(), rows):
            one = jnp.asarray(r)[None]
            total = total + _token_loss(m, one, jnp.ones_like(one), None, False, weights[:1, a:b])
        one = jnp.asarray(rows[2])[None]
        return total + _token_loss(m, one, jnp.ones_like(one), None, False, weights[1:, 4:4 + LENGTHS[2]])

    ref = jax.jit(jax.grad(rows_loss))(ref_params)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)


def test_cudnn_packed_path_zeroes_gradients_at_padding():
    """cuDNN's packed backward gives NaN dq/dk/dv outside every run (H200, JAX 0.11.2); the packed
    path passes q, k, v through an identity whose gradient is zero at padding, so no NaN reaches
    the weights."""
    real = jnp.asarray([[True, False, True, False]])
    nan_at_padding = jnp.asarray([1.0, jnp.nan, 1.0, jnp.nan])[None, :, None, None]
    g = jax.grad(lambda x: jnp.sum(_decoder._zero_cotangent_at_padding(x, real) * nan_at_padding))(
        jnp.ones((1, 4, 2, 3)))
    np.testing.assert_array_equal(np.asarray(g)[0, :, 0, 0], [1.0, 0.0, 1.0, 0.0])


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="cuDNN flash attention needs a GPU")
def test_cudnn_packed_layout_equals_the_segment_mask_on_gpu():
    """cudnn with packed=True (cuDNN's packed layout: per-row run offsets and lengths) against xla's
    segment mask, bf16: logits of real tokens and gradients of the per-token loss."""
    rows = _rows()
    ids, seg = _pack(rows)
    weights = jnp.asarray(np.random.default_rng(1).normal(size=(2, T)), jnp.float32)
    positions = models.segment_positions(seg)
    real = np.asarray(seg) != 0
    out, grads = {}, {}
    for impl in ("xla", "cudnn"):
        model = models.CausalLM(CONFIG.replace(train_attention=impl, dtype="bfloat16", head_dim=16),
                                rngs=nnx.Rngs(params=0))
        graphdef, params = nnx.split(model)
        out[impl] = np.asarray(jax.jit(lambda p: nnx.merge(graphdef, p)(
            ids, attention_mask=seg, positions=positions, packed=True))(params))
        grads[impl] = jax.jit(jax.grad(lambda p: _token_loss(nnx.merge(graphdef, p), ids, seg, positions,
                                                             True, weights)))(params)
    assert "cudnn" in str(jax.jit(lambda p: nnx.merge(graphdef, p)(
        ids, attention_mask=seg, positions=positions, packed=True)).lower(params).compile().as_text()).lower()
    np.testing.assert_allclose(out["cudnn"][real], out["xla"][real], rtol=0.05, atol=0.05)
    for a, b in zip(jax.tree.leaves(grads["cudnn"]), jax.tree.leaves(grads["xla"])):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=0.1, atol=0.05)
