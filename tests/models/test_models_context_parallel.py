"""Context parallelism: with the sequence split over the `context` mesh axis (attention all-to-all
under shard_map), logits and parameter gradients equal those of the unsplit sequence, for
verl-style padded rows and packed rows, under remat (8 fake CPU devices, fp32)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding

import sharding
from jaxrl_llm import models

# 8 query heads over 2 kv heads: context 4 repeats the kv heads (4 % 4 == 0 for q, 2 % 4 != 0 for kv)
CONFIG = models.ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                            num_attention_heads=8, num_key_value_heads=2, head_dim=8, model_type="qwen2",
                            attention_bias=True, dtype="float32", param_dtype="float32", remat="dots")
T = 16


def _padded():
    """verl layout: left-padded prompts + right-padded responses; one row has no padding."""
    rng = np.random.default_rng(0)
    ids = rng.integers(1, 64, (4, T)).astype(np.int32)
    mask = np.ones((4, T), np.int32)
    mask[0, :5] = 0                    # left padding across the first context shard boundary
    mask[1, 11:] = 0                   # right padding
    mask[2, :2], mask[2, 13:] = 0, 0   # both
    ids[mask == 0] = 0
    return ids, mask, None


def _packed():
    """Packed rows: segment ids 1, 2, 3 ... (runs crossing shard boundaries), 0 padding at the end;
    positions restart per segment."""
    seg = np.zeros((4, T), np.int32)
    for row, lengths in enumerate([(3, 6, 7), (16,), (5, 5, 3), (9, 2)]):
        start = 0
        for i, n in enumerate(lengths):
            seg[row, start:start + n] = i + 1
            start += n
    ids = np.random.default_rng(2).integers(1, 64, (4, T)).astype(np.int32) * (seg != 0)
    return ids, seg, np.asarray(models.segment_positions(jnp.asarray(seg)))


def _mesh(context: int):
    return sharding.make_mesh(sharding.MeshConfig(data=1, fsdp=2, tensor=1, context=context),
                              devices=jax.devices()[:2 * context])


def _logits_and_grads(context, batch, *, impl="xla", remat="dots"):
    """(logits [b, t, v], grads) of a token-weighted log-likelihood on a (fsdp 2, context) mesh."""
    ids, mask, positions = batch
    packed = positions is not None
    model = models.CausalLM(CONFIG.replace(train_attention=impl, remat=remat), rngs=nnx.Rngs(params=0))
    graphdef, state = nnx.split(model)
    mesh = _mesh(context)
    state = sharding.reshard(state, sharding.state_shardings(state, mesh, "train"))
    weights = np.random.default_rng(1).normal(size=ids.shape).astype(np.float32) * (mask != 0)
    row_spec = NamedSharding(mesh, sharding.logical_to_spec(("batch", "length"), "train", mesh))
    args = [jax.device_put(jnp.asarray(x), row_spec) for x in (ids, mask, weights)]
    pos = None if positions is None else jax.device_put(jnp.asarray(positions), row_spec)

    def forward(p, ids, mask, pos):
        return nnx.merge(graphdef, p)(ids, attention_mask=mask, positions=pos, packed=packed)

    def loss(p, ids, mask, weights, pos):
        lp = jax.nn.log_softmax(forward(p, ids, mask, pos), axis=-1)
        picked = jnp.take_along_axis(lp[:, :-1], ids[:, 1:, None], axis=-1)[..., 0]
        return jnp.sum(weights[:, 1:] * picked)

    with sharding.use_rules(mesh, "train"):
        lowered = jax.jit(forward).lower(state, args[0], args[1], pos)
        # the context-parallel attention ran (not jit's own handling of a split sequence)
        assert ("all_to_all" in lowered.as_text()) == (context > 1)
        logits = lowered.compile()(state, args[0], args[1], pos)
        grads = jax.jit(jax.grad(loss))(state, *args, pos)
    return np.asarray(logits), jax.tree.map(np.asarray, grads)


def _assert_equal(got, want, mask):
    real = mask != 0
    assert np.abs(want[0][real]).max() > 0.1
    np.testing.assert_allclose(got[0][real], want[0][real], rtol=0, atol=1e-5)
    flat_want = jax.tree.leaves(want[1])
    assert max(np.abs(g).max() for g in flat_want) > 1e-3
    for g, w in zip(jax.tree.leaves(got[1]), flat_want):
        np.testing.assert_allclose(g, w, rtol=0, atol=1e-5)


@pytest.mark.parametrize("make_batch", [_padded, _packed], ids=["padded", "packed"])
def test_logits_and_gradients_equal_on_1_2_4_context_shards(make_batch):
    batch = make_batch()
    want = _logits_and_grads(1, batch)
    for context in (2, 4):
        _assert_equal(_logits_and_grads(context, batch), want, batch[1])


@pytest.mark.parametrize("remat", ["none", "full"])
def test_context_parallel_gradients_under_each_remat_policy(remat):
    batch = _padded()
    _assert_equal(_logits_and_grads(2, batch, remat=remat), _logits_and_grads(1, batch, remat=remat), batch[1])


@pytest.mark.parametrize("impl", ["rolled", "splash"])
def test_context_parallel_kernels_equal_xla(impl):
    """The cuDNN path's CPU stand-in ("rolled": masks by each row's runs) and the TPU splash
    kernel (interpreted on CPU) on 2 context shards, packed rows."""
    batch = _packed()
    _assert_equal(_logits_and_grads(2, batch, impl=impl), _logits_and_grads(1, batch), batch[1])


def test_the_context_axis_shards_activations_and_parameters():
    mesh = _mesh(2)
    assert sharding.logical_to_spec(("batch", "length", "embed"), "train", mesh) == \
        jax.sharding.PartitionSpec(("data", "fsdp"), "context", None)
    assert sharding.logical_to_spec(("vocab", "embed"), "train", mesh) == \
        jax.sharding.PartitionSpec("tensor", ("fsdp", "context"))
    assert sharding.logical_to_spec(("batch", "length"), "rollout", mesh) == \
        jax.sharding.PartitionSpec(("data", "fsdp"), None)
    one = _mesh(1)  # context 1: every spec is what it was before the axis existed
    assert sharding.logical_to_spec(("vocab", "embed"), "train", one) == jax.sharding.PartitionSpec("tensor", "fsdp")
    assert sharding.logical_to_spec(("batch", "length"), "train", one) == \
        jax.sharding.PartitionSpec(("data", "fsdp"), None)


def test_a_sequence_length_that_does_not_split_is_named():
    ids, mask, _ = _padded()
    ids, mask = ids[:, :15], mask[:, :15]
    model = models.CausalLM(CONFIG, rngs=nnx.Rngs(params=0))
    with sharding.use_rules(_mesh(2), "train"), \
            pytest.raises(ValueError, match="sequence length 15 is not a multiple of mesh.context=2"):
        jax.jit(lambda i, m: model(i, attention_mask=m))(ids, mask)


@pytest.mark.parametrize("rows, heads, context, match", [
    (3, 8, 2, "3 rows do not split over the 2 data-parallel devices"),
    (4, 6, 4, "6 query heads per tensor shard do not split over mesh.context=4"),
])
def test_rows_and_heads_that_do_not_split_are_named(rows, heads, context, match):
    ids, mask, _ = _padded()
    model = models.CausalLM(CONFIG.replace(num_attention_heads=heads), rngs=nnx.Rngs(params=0))
    with sharding.use_rules(_mesh(context), "train"), pytest.raises(ValueError, match=match):
        jax.jit(lambda i, m: model(i, attention_mask=m))(ids[:rows], mask[:rows])
