"""LoRA in the actor role: only adapters train (and own optimizer state), the reference is the
base with adapters off, the merged sync serves the current adapters, and a step is the same on
1 and 8 devices."""
import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import rollout
import sharding
from jaxrl_llm import models
from jaxrl_llm.config import load_config
from jaxrl_llm.workers._common import build_model
from jaxrl_llm.workers._roles import ActorWorker

QUICKSTART = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "quickstart.py")
VOCAB = 20


@pytest.fixture(scope="module")
def tiny():
    c = load_config(f"{QUICKSTART}:tiny,local")
    lora = dataclasses.replace(c.actor.lora, rank=4, alpha=8.0)
    optim = dataclasses.replace(c.actor.optim, lr=1e-2, weight_decay=0.0)
    return dataclasses.replace(c, actor=dataclasses.replace(c.actor, lora=lora, optim=optim))


def _batch(rows=8, p=4, t=4, vocab=VOCAB, seed=0):
    rng = np.random.default_rng(seed)
    prompts = rng.integers(1, vocab, size=(rows, p)).astype(np.int32)
    responses = rng.integers(1, vocab, size=(rows, t)).astype(np.int32)
    response_mask = np.ones((rows, t), np.int32)
    attention = np.concatenate([np.ones((rows, p), np.int32), response_mask], axis=1)
    return {"input_ids": np.concatenate([prompts, responses], 1), "attention_mask": attention,
            "position_ids": np.maximum(np.cumsum(attention, 1) - 1, 0).astype(np.int32),
            "responses": responses, "response_mask": response_mask,
            "advantages": rng.normal(size=(rows, t)).astype(np.float32)}


def _actor(cfg, mesh, rank=None):
    model = build_model(cfg.model, vocab_size=VOCAB, mesh=mesh)
    lora = cfg.actor.lora if rank is None else dataclasses.replace(cfg.actor.lora, rank=rank)
    base = jax.tree.map(jnp.copy, nnx.state(model, nnx.Param))
    models.add_lora(model, models.LoraSpec(lora.rank, lora.alpha, lora.target_modules), mesh=mesh)
    actor = ActorWorker(model, dataclasses.replace(cfg.actor, lora=lora), mesh=mesh, total_steps=4,
                        temperature=1.0)
    return actor, base


@pytest.fixture(scope="module")
def shared(tiny):
    """One rank-4 LoRA actor on 8 devices (fsdp) shared by the tests (its compiled steps are the
    slow part); `reset()` puts back its initial adapters and optimizer state."""
    mesh = sharding.make_mesh(sharding.MeshConfig(1, -1, 1))
    actor, base = _actor(tiny, mesh)
    initial = jax.tree.map(jnp.copy, actor.state)

    def reset():
        actor.state = jax.tree.map(jnp.copy, initial)
        return actor

    return mesh, actor, base, reset


def _nbytes(tree):
    return sum(x.nbytes for x in jax.tree.leaves(tree))


def _train(actor, batch):
    batch = dict(batch, **actor.compute_log_prob(batch))
    return actor.update(batch, mini_rows=8, seed=0)


def test_lora_trains_only_adapters_and_adam_state_scales_with_adapter_size(tiny, shared):
    mesh, _, base, reset = shared
    actor = reset()
    wide, _ = _actor(tiny, mesh, rank=8)  # sizes only (no step)
    sizes = {r: (_nbytes(a.state.params), _nbytes(a.state.opt_state)) for r, a in ((4, actor), (8, wide))}
    adapters = nnx.to_flat_state(actor.state.params)
    assert adapters and all(str(path[-1]) in ("lora_a", "lora_b") for path, _ in adapters)
    before = jax.tree.map(jnp.copy, actor.state.params)
    _train(actor, _batch())
    # the base is bit-for-bit what it was; the adapters moved
    for a, b in zip(jax.tree.leaves(actor.frozen[0]), jax.tree.leaves(base)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    old = dict(nnx.to_flat_state(before))
    # B starts at 0, so the first step's gradient reaches only B (dL/dA = x^T g B^T = 0)
    moved = [not np.array_equal(np.asarray(v.get_value()), np.asarray(old[path].get_value()))
             for path, v in nnx.to_flat_state(actor.state.params) if str(path[-1]) == "lora_b"]
    assert moved and all(moved)
    for rank, (adapter, opt) in sizes.items():
        assert adapter < _nbytes(base) / 2
        # AdamW: two moments per adapter element (+ a few scalar counters), nothing for the base
        assert 2 * adapter <= opt <= 2 * adapter + 64, (rank, adapter, opt)
    assert sizes[8][0] == 2 * sizes[4][0]  # adapters scale with the rank, and so does Adam
    assert abs(sizes[8][1] - 2 * sizes[4][1]) <= 64


def test_lora_reference_is_the_base_model_with_adapters_off(tiny, shared):
    mesh, _, _, reset = shared
    actor = reset()
    batch = _batch()
    plain = build_model(tiny.model, vocab_size=VOCAB, mesh=mesh)  # same seed: the base weights
    full = ActorWorker(plain, dataclasses.replace(tiny.actor, lora=dataclasses.replace(
        tiny.actor.lora, rank=0)), mesh=mesh, total_steps=1, temperature=1.0)
    expected = full.compute_log_prob(batch)["old_log_probs"]
    _train(actor, batch)
    ref = actor.compute_ref_log_prob(batch)["ref_log_prob"]
    np.testing.assert_allclose(ref, expected, atol=1e-5)
    now = actor.compute_log_prob(batch)["old_log_probs"]
    assert np.abs(now - ref).max() > 1e-3  # the trained policy has moved away from the reference


def _seq_batch(prompts, out):
    """Actor batch (left-padded prompts + responses) for the engine's sampled responses."""
    p = max(len(q) for q in prompts)
    rows = len(prompts)
    ids = np.zeros((rows, p), np.int32)
    mask = np.zeros((rows, p), np.int32)
    for i, q in enumerate(prompts):
        ids[i, p - len(q):] = q
        mask[i, p - len(q):] = 1
    attention = np.concatenate([mask, out.response_mask], 1).astype(np.int32)
    return {"input_ids": np.concatenate([ids, out.responses], 1).astype(np.int32),
            "attention_mask": attention,
            "position_ids": np.maximum(np.cumsum(attention, 1) - 1, 0).astype(np.int32),
            "responses": out.responses.astype(np.int32), "response_mask": out.response_mask}


def test_merged_sync_serves_the_current_adapters_never_stale_ones(shared):
    mesh, _, _, reset = shared
    actor = reset()
    engine = rollout.Engine.from_model(models.merged_model(actor.model()), mesh=mesh,
                                       max_concurrent_decodes=8, max_prefill_length=16,
                                       max_target_length=32)
    driver = rollout.RolloutDriver(engine, steps_per_sync=4)
    prompts = [[3, 5, 7, 9], [4, 6, 8, 10], [11, 12, 13, 14], [2, 3, 2, 3]] * 2
    sampling = rollout.SamplingParams(temperature=1.0)
    for k in range(2):
        # new adapters (B nonzero): the engine must serve exactly these after a sync
        key = jax.random.key(10 + k)
        actor.state = dataclasses.replace(actor.state, params=jax.tree.map(
            lambda x: x + 0.3 * jax.random.normal(key, x.shape, x.dtype), actor.state.params))
        stats = engine.update_params(actor.rollout_params(engine.config.param_dtype))
        assert not stats["zero_copy"]
        out = driver.generate(prompts, n=1, max_new_tokens=6, sampling=sampling, seed=k)
        batch = _seq_batch(prompts, out)
        mask = out.response_mask.astype(bool)
        trainer = actor.compute_log_prob(batch)["old_log_probs"]
        np.testing.assert_allclose(out.rollout_log_probs[mask], trainer[mask], atol=2e-4)
        if k == 1:  # and they are not what the previous adapters would give
            assert np.abs(previous.compute(batch)[mask] - trainer[mask]).max() > 1e-2
        previous = _Frozen(actor)


class _Frozen:
    """The actor's log-probs with a snapshot of its current adapters."""

    def __init__(self, actor):
        self.actor, self.params = actor, jax.tree.map(jnp.copy, actor.state.params)

    def compute(self, batch):
        now = self.actor.state
        self.actor.state = dataclasses.replace(now, params=self.params)
        try:
            return self.actor.compute_log_prob(batch)["old_log_probs"]
        finally:
            self.actor.state = now


def test_lora_step_is_the_same_on_1_and_8_devices(tiny, shared):
    _, eight, _, reset = shared
    one, _ = _actor(tiny, sharding.make_mesh(sharding.MeshConfig(1, 1, 1), devices=jax.devices()[:1]))
    results = []
    for actor in (one, reset()):
        m = _train(actor, _batch())
        results.append((m, jax.tree.map(np.asarray, nnx.to_pure_dict(actor.state.params))))
    (m1, p1), (m8, p8) = results
    for k in ("actor/pg_loss", "actor/grad_norm"):
        np.testing.assert_allclose(m1[k], m8[k], rtol=1e-4)
    for a, b in zip(jax.tree.leaves(p1), jax.tree.leaves(p8)):
        np.testing.assert_allclose(a, b, atol=1e-5)


def test_lora_adapters_follow_the_sharding_of_their_kernels():
    cfg = models.ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                             num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=8)
    mesh = sharding.make_mesh(sharding.MeshConfig(1, 2, 4))
    model = sharding.init_sharded(lambda: models.init_model(cfg), mesh, "train")
    models.add_lora(model, models.LoraSpec(rank=4, alpha=8.0), mesh=mesh)
    attn, mlp = model.model.layers.self_attn, model.model.layers.mlp
    for p, n_in in ((attn.q_proj, 1), (attn.o_proj, 2), (mlp.down_proj, 1)):
        kernel = p["kernel"].get_value().sharding.spec
        kernel = tuple(kernel) + (None,) * (p["kernel"].ndim - len(kernel))
        a = p["lora_a"].get_value().sharding.spec
        b = p["lora_b"].get_value().sharding.spec
        a = tuple(a) + (None,) * (p["lora_a"].ndim - len(a))
        b = tuple(b) + (None,) * (p["lora_b"].ndim - len(b))
        assert a == kernel[:1 + n_in] + (None,)  # layers, input dims, then the unsharded rank
        assert b == kernel[:1] + (None,) + kernel[1 + n_in:]  # layers, rank, output dims
    assert any(s is not None for s in attn.q_proj["lora_b"].get_value().sharding.spec)
