"""Router statistics of the MoE forward (`hidden_states(..., router_logits=True)`): the logits the
routing really used, on padded, rotated (cudnn/rolled path) and packed rows; the z-loss and
expert-load helpers against NumPy."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl_llm import models
from jaxrl_llm.models import _decoder
from test_models_hf import loaded


def _recorded_router_logits(model, ids, mask, monkeypatch):
    """Every layer's router logits as `SparseMLP.router_logits` returned them, recorded eagerly on
    the per-layer layout (a Python loop of layers, no scan): [L, b, t, E]."""
    graphdef, state = nnx.split(model)
    pure = models.unstack_layers(nnx.to_pure_dict(state))
    per = models.abstract_model(model.config, layer_layout="per_layer")
    g, s = nnx.split(per)
    nnx.replace_by_pure_dict(s, pure)
    per = nnx.merge(g, s)
    seen = []
    original = _decoder.SparseMLP.router_logits

    def record(self, x):
        out = original(self, x)
        seen.append(np.asarray(out))
        return out

    monkeypatch.setattr(_decoder.SparseMLP, "router_logits", record)
    _, per_layer = per.hidden_states(jnp.asarray(ids), attention_mask=jnp.asarray(mask), router_logits=True)
    b, t = ids.shape
    recorded = np.stack([x.reshape(b, t, -1) for x in seen])
    np.testing.assert_array_equal(np.asarray(per_layer), recorded)  # the per-layer loop's output
    return recorded


def _batch():
    ids = np.array([[0, 0, 5, 6, 7, 8, 9, 3], [4, 5, 6, 7, 8, 2, 0, 0]], np.int32)
    mask = np.array([[0, 0, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 0, 0]], np.int32)
    return ids, mask


@pytest.mark.parametrize("impl", ["xla", "rolled"])
def test_router_logits_are_the_ones_the_routing_used(impl, monkeypatch):
    model = loaded("qwen3_moe")
    cfg = dataclasses.replace(model.config, train_attention=impl)
    graphdef, state = nnx.split(model)
    ids, mask = _batch()
    ref = _recorded_router_logits(model, ids, mask, monkeypatch)
    monkeypatch.undo()
    m = nnx.merge(graphdef, state)
    m.model.config = cfg
    h, logits = m.hidden_states(jnp.asarray(ids), attention_mask=jnp.asarray(mask), router_logits=True)
    h0 = m.hidden_states(jnp.asarray(ids), attention_mask=jnp.asarray(mask))
    np.testing.assert_array_equal(np.asarray(h), np.asarray(h0))  # the hidden states are untouched
    assert logits.shape == (cfg.num_hidden_layers, 2, 8, cfg.num_experts) and logits.dtype == jnp.float32
    real = mask != 0
    np.testing.assert_allclose(np.asarray(logits)[:, real], ref[:, real], atol=1e-5)


def test_router_logits_of_a_packed_row_equal_each_sequence_alone():
    model = loaded("qwen3_moe")
    ids, mask = _batch()
    _, alone = model.hidden_states(jnp.asarray(ids), attention_mask=jnp.asarray(mask), router_logits=True)
    a, b = ids[0, 2:], ids[1, :6]  # the two rows' real tokens, packed into one row with ids 1, 2
    packed_ids = np.concatenate([a, b, [0, 0]])[None].astype(np.int32)
    seg = np.array([[1] * 6 + [2] * 6 + [0, 0]], np.int32)
    _, packed = model.hidden_states(jnp.asarray(packed_ids), attention_mask=jnp.asarray(seg),
                                    positions=models.segment_positions(jnp.asarray(seg)), packed=2,
                                    router_logits=True)
    packed, alone = np.asarray(packed), np.asarray(alone)
    np.testing.assert_allclose(packed[:, 0, :6], alone[:, 0, 2:], atol=1e-5)
    np.testing.assert_allclose(packed[:, 0, 6:12], alone[:, 1, :6], atol=1e-5)


def test_dense_model_refuses_router_logits():
    dense = models.init_model(models.ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
                                                 num_hidden_layers=1, num_attention_heads=2,
                                                 num_key_value_heads=1, head_dim=8))
    with pytest.raises(ValueError, match="router_logits=True needs a mixture-of-experts model"):
        dense.hidden_states(jnp.ones((1, 4), jnp.int32), router_logits=True)


def test_z_loss_and_expert_load_match_numpy():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(3, 2, 5, 6)).astype(np.float32) * 2
    mask = np.array([[1, 1, 1, 0, 0], [0, 1, 1, 1, 1]], np.int32)
    real = mask != 0
    z = np.log(np.exp(logits).sum(-1))
    np.testing.assert_allclose(models.router_z_loss(jnp.asarray(logits), jnp.asarray(mask)),
                               (z[:, real] ** 2).mean(), rtol=1e-5)
    load = np.asarray(models.expert_load(jnp.asarray(logits), 2, jnp.asarray(mask)))
    counts = np.zeros((3, 6))
    for layer in range(3):
        for row, col in zip(*np.nonzero(real)):
            for e in np.argsort(-logits[layer, row, col])[:2]:
                counts[layer, e] += 1
    np.testing.assert_allclose(load, counts / counts.sum(-1, keepdims=True), rtol=1e-6)
    np.testing.assert_allclose(load.sum(-1), 1.0, rtol=1e-6)


def test_router_logits_gradient_is_the_same_under_remat():
    model = loaded("qwen3_moe")
    graphdef, state = nnx.split(model)
    ids, mask = (jnp.asarray(x) for x in _batch())

    def loss(p, remat):
        m = nnx.merge(graphdef, p)
        m.model.config = dataclasses.replace(m.model.config, remat=remat)
        h, logits = m.hidden_states(ids, attention_mask=mask, router_logits=True)
        return 1e-3 * jnp.sum(h * (mask[..., None] != 0)) + models.load_balancing_loss(logits, 2, mask) \
            + models.router_z_loss(logits, mask)

    plain = jax.grad(lambda p: loss(p, "none"))(state)
    remat = jax.grad(lambda p: loss(p, "full"))(state)
    for a, b in zip(jax.tree.leaves(plain), jax.tree.leaves(remat)):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=1e-6)
