"""The MoE router terms of the actor update (`model.moe.aux_loss_coef`, `model.moe.z_loss_coef`,
the `moe/expert_load/*` metrics) on the tiny Qwen3-MoE fixture, one CPU device, fp32."""
import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import sharding
from jaxrl_llm import models
from jaxrl_llm.config import MoeConfig, load_config
from jaxrl_llm.workers._common import build_model
from jaxrl_llm.workers._roles import ActorWorker
from jaxrl_llm.workers._step import denominators

QUICKSTART = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "quickstart.py")
FIXTURE = os.path.join(os.path.dirname(__file__), "..", "fixtures", "models", "qwen3_moe")
E, K, L = 4, 2, 2  # the fixture's experts, top-k, layers


@pytest.fixture(scope="module")
def tiny():
    return load_config(f"{QUICKSTART}:tiny,local")


def _mesh():
    return sharding.make_mesh((1, 1, 1), devices=jax.devices()[:1])


def _actor(tiny, *, aux=0.0, z=0.0, lr=1e-3, micro=4, remove_padding=False):
    cfg = dataclasses.replace(tiny.actor, ppo_micro_batch_size_per_device=micro, use_dynamic_bsz=False,
                              optim=dataclasses.replace(tiny.actor.optim, lr=lr, warmup_steps=0))
    model = models.from_pretrained(FIXTURE)  # a fresh copy: the update donates its state
    return ActorWorker(model, cfg, mesh=_mesh(), total_steps=4, temperature=1.0,
                       remove_padding=remove_padding, moe=MoeConfig(aux_loss_coef=aux, z_loss_coef=z))


def _batch(rows=8, p=6, t=10, vocab=96, seed=0):
    """Left-padded prompts, right-padded responses (under 80 % real tokens, so packing packs)."""
    rng = np.random.default_rng(seed)
    plen, rlen = rng.integers(2, p + 1, rows), rng.integers(1, t + 1, rows)
    ids = np.zeros((rows, p + t), np.int32)
    attn = np.zeros((rows, p + t), np.int32)
    for r in range(rows):
        attn[r, p - plen[r]:p + rlen[r]] = 1
    ids[attn > 0] = rng.integers(1, vocab, int(attn.sum()))
    resp_mask = attn[:, p:].copy()
    return {"input_ids": ids, "attention_mask": attn,
            "position_ids": np.maximum(np.cumsum(attn, 1) - 1, 0).astype(np.int32),
            "responses": ids[:, p:].copy(), "response_mask": resp_mask,
            "old_log_probs": np.zeros((rows, t), np.float32),
            "advantages": rng.normal(size=(rows, t)).astype(np.float32) * resp_mask}


def _router_logits(model, b):
    _, logits = model.hidden_states(jnp.asarray(b["input_ids"]), attention_mask=jnp.asarray(b["attention_mask"]),
                                    positions=jnp.asarray(b["position_ids"]), router_logits=True)
    return logits


def test_router_terms_added_equal_coef_times_the_reference_losses_value_and_gradient(tiny):
    batch = _batch()
    m = {k: jnp.asarray(v) for k, v in batch.items()}
    denoms = denominators(m["response_mask"])
    off, on = _actor(tiny), _actor(tiny, aux=0.5, z=0.25)
    graphdef, params = nnx.split(off.model())

    def loss(actor):
        return lambda p: actor._loss(nnx.merge(graphdef, p), m, denoms)

    (l_off, m_off), g_off = jax.value_and_grad(loss(off), has_aux=True)(params)
    (l_on, m_on), g_on = jax.value_and_grad(loss(on), has_aux=True)(params)

    def reference(p):
        logits = _router_logits(nnx.merge(graphdef, p), batch)
        mask = m["attention_mask"]
        return 0.5 * models.load_balancing_loss(logits, K, mask) + 0.25 * models.router_z_loss(logits, mask)

    ref, g_ref = jax.value_and_grad(reference)(params)
    np.testing.assert_allclose(l_on - l_off, ref, rtol=1e-5)
    logits = _router_logits(off.model(), batch)
    np.testing.assert_allclose(m_on["moe_aux_loss"], models.load_balancing_loss(logits, K, m["attention_mask"]),
                               rtol=1e-6)
    np.testing.assert_allclose(m_off["moe_z_loss"], models.router_z_loss(logits, m["attention_mask"]), rtol=1e-6)
    # the difference of the gradients is the reference terms' gradient, and it reaches the router
    gate = lambda g: np.asarray(g["model"]["layers"]["mlp"]["gate"]["kernel"][...])  # noqa: E731
    diff, want = gate(g_on) - gate(g_off), gate(g_ref)
    assert np.abs(want).max() > 1e-4
    np.testing.assert_allclose(diff, want, atol=1e-6 * np.abs(want).max() + 1e-8, rtol=1e-3)
    # a micro-batch of half the rows adds its own terms times its share of the response tokens
    half = {k: v[:4] for k, v in m.items()}
    share = float(half["response_mask"].sum() / m["response_mask"].sum())
    assert 0.2 < share < 0.8
    d = (on._loss(nnx.merge(graphdef, params), half, denoms)[0]
         - off._loss(nnx.merge(graphdef, params), half, denoms)[0])
    logits = _router_logits(off.model(), {k: v[:4] for k, v in batch.items()})
    mask = half["attention_mask"]
    want = 0.5 * models.load_balancing_loss(logits, K, mask) + 0.25 * models.router_z_loss(logits, mask)
    np.testing.assert_allclose(d, share * want, rtol=1e-5)


def test_zero_coefficients_leave_the_update_bit_exact(tiny):
    batch = _batch(seed=1)
    with_terms, without = _actor(tiny), _actor(tiny)
    without._router = False  # the update as before the feature: no router logits read at all
    a = with_terms.update(batch, mini_rows=8, seed=0)
    b = without.update(batch, mini_rows=8, seed=0)
    for x, y in zip(jax.tree.leaves(with_terms.state.params), jax.tree.leaves(without.state.params)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert {k for k in a if "moe" not in k} == set(b) and not any("moe" in k for k in b)
    for k in b:
        assert a[k] == b[k], k


def test_expert_load_metrics_match_numpy_counts(tiny):
    batch = _batch(seed=2)
    actor = _actor(tiny, lr=0.0, micro=4)  # two micro-batches: rows 0-3 and 4-7
    logits = np.asarray(_router_logits(actor.model(), batch))
    metrics = actor.update(batch, mini_rows=8, seed=0)
    per_micro = []
    for rows in (slice(0, 4), slice(4, 8)):
        real = batch["attention_mask"][rows] != 0
        counts = np.zeros((L, E))
        for layer in range(L):
            top = np.argsort(-logits[layer, rows][real], axis=-1, kind="stable")[:, :K]
            counts[layer] = np.bincount(top.ravel(), minlength=E)
        load = counts / counts.sum(-1, keepdims=True) * E
        per_micro.append((load.min(-1), load.max(-1), load.std(-1) / load.mean(-1)))
    for i in range(L):
        for j, name in enumerate(("min", "max", "cv")):
            want = np.mean([pm[j][i] for pm in per_micro])
            np.testing.assert_allclose(metrics[f"moe/expert_load/layer_{i}/{name}"], want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(metrics["moe/expert_load/min"], np.mean([pm[0].min() for pm in per_micro]), rtol=1e-5)
    np.testing.assert_allclose(metrics["moe/expert_load/max"], np.mean([pm[1].max() for pm in per_micro]), rtol=1e-5)
    assert "actor/moe_aux_loss" in metrics and "actor/moe_z_loss" in metrics


def test_packed_rows_give_the_padded_router_terms(tiny):
    batch = _batch(seed=3)
    padded = _actor(tiny, aux=0.1, lr=0.0, micro=8).update(batch, mini_rows=8, seed=0)
    packed = _actor(tiny, aux=0.1, lr=0.0, micro=8, remove_padding=True).update(batch, mini_rows=8, seed=0)
    for k in ("actor/moe_aux_loss", "actor/moe_z_loss", "moe/expert_load/layer_0/cv", "moe/expert_load/max"):
        np.testing.assert_allclose(packed[k], padded[k], rtol=1e-4, err_msg=k)


def test_dense_model_refuses_router_coefficients_and_logs_no_moe_metrics(tiny):
    mesh = _mesh()
    model = build_model(tiny.model, vocab_size=20, mesh=mesh)
    with pytest.raises(ValueError, match=r"model.moe.z_loss_coef=0.1 needs a mixture-of-experts model"):
        ActorWorker(model, tiny.actor, mesh=mesh, total_steps=1, temperature=1.0,
                    moe=MoeConfig(aux_loss_coef=0.0, z_loss_coef=0.1))
    actor = ActorWorker(model, tiny.actor, mesh=mesh, total_steps=1, temperature=1.0)
    assert actor._router is False


@pytest.mark.parametrize("field", ["aux_loss_coef", "z_loss_coef"])
def test_negative_router_coefficients_are_refused(field):
    from jaxrl_llm.config import ConfigError

    with pytest.raises(ConfigError, match=rf"model\.moe\.{field} must be >= 0, got -0.1"):
        load_config(f"{QUICKSTART}:tiny,local", [f"model.moe.{field}=-0.1"])
    assert getattr(load_config(f"{QUICKSTART}:tiny,local").model.moe, field) == 0.0  # the default: off
