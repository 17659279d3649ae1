"""The actor role's update on a tiny model: the loss normalisers it hands the policy losses, and
the optimizer's weight-decay mask."""
import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import sharding
from jaxrl_llm.config import load_config
from jaxrl_llm.workers._common import build_model, build_optimizer
from jaxrl_llm.workers._roles import ActorWorker

QUICKSTART = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "quickstart.py")


@pytest.fixture(scope="module")
def tiny():
    return load_config(f"{QUICKSTART}:tiny,local")


def _batch(rows=8, p=4, t=4, empty=(1, 5), vocab=20, seed=0):
    rng = np.random.default_rng(seed)
    prompts = rng.integers(1, vocab, size=(rows, p)).astype(np.int32)
    responses = rng.integers(1, vocab, size=(rows, t)).astype(np.int32)
    response_mask = np.ones((rows, t), np.int32)
    response_mask[list(empty)] = 0
    attention = np.concatenate([np.ones((rows, p), np.int32), response_mask], axis=1)
    return {"input_ids": np.concatenate([prompts, responses], 1), "attention_mask": attention,
            "position_ids": np.maximum(np.cumsum(attention, 1) - 1, 0).astype(np.int32),
            "responses": responses, "response_mask": response_mask}


def test_geo_mean_update_averages_over_all_rows_including_empty_ones(tiny):
    # 8 rows, 2 of them empty; advantage 1 everywhere and log-probs equal to old ones (ratio 1):
    # verl's GMPO loss is -(sum over rows of mean_t A) / all rows = -6/8 (not -6/6).
    mesh = sharding.make_mesh(sharding.MeshConfig(1, -1, 1))
    cfg = dataclasses.replace(tiny.actor, policy_loss="geo_mean",
                              optim=dataclasses.replace(tiny.actor.optim, lr=0.0))
    model = build_model(tiny.model, vocab_size=20, mesh=mesh)
    actor = ActorWorker(model, cfg, mesh=mesh, total_steps=1, temperature=1.0)
    batch = _batch()
    batch["old_log_probs"] = actor.compute_log_prob(batch)["old_log_probs"]
    batch["advantages"] = batch["response_mask"].astype(np.float32)
    m = actor.update(batch, mini_rows=8, seed=0)  # 8 rows over 8 devices: micro-batches of 8
    np.testing.assert_allclose(m["actor/pg_loss"], -6 / 8, rtol=1e-4)


def _one_adamw_step(optim):
    params = {"bias": jnp.ones((4,)), "norm": jnp.ones((4,)), "kernel": jnp.ones((4, 4))}
    tx, _ = build_optimizer(optim, total_steps=10)
    grads = jax.tree.map(jnp.zeros_like, params)  # only the decay moves parameters
    updates, _ = tx.update(grads, tx.init(params), params)
    return optax.apply_updates(params, updates)


def test_adamw_decays_matrices_but_not_norms_or_biases_by_default(tiny):
    optim = dataclasses.replace(tiny.actor.optim, lr=0.1, weight_decay=0.5, clip_grad=0.0)
    assert optim.weight_decay_1d is False  # the default is the usual mask
    new = _one_adamw_step(optim)
    np.testing.assert_allclose(new["kernel"], 1 - 0.1 * 0.5)
    np.testing.assert_allclose(new["bias"], 1.0)
    np.testing.assert_allclose(new["norm"], 1.0)
    everything = _one_adamw_step(dataclasses.replace(optim, weight_decay_1d=True))
    np.testing.assert_allclose(everything["bias"], 1 - 0.1 * 0.5)


def test_adam_moments_are_sharded_like_their_parameters(tiny):
    """jit(tx.init) alone put every moment on one device, and the trainer then replicated them on
    the mesh (8 bytes per parameter on every device); each moment must live where its parameter
    does, and the step counts replicated on the mesh."""
    from jaxrl_llm.workers._common import init_train_state

    mesh = sharding.make_mesh((1, 4, 2))
    model = build_model(tiny.model, vocab_size=128, mesh=mesh)
    params = nnx.state(model, nnx.Param)
    tx, _ = build_optimizer(tiny.actor.optim, 10)
    state = init_train_state(params, tx, mesh)
    by_shape = {}
    for p in jax.tree.leaves(params):
        by_shape.setdefault((p.shape, p.sharding.spec), p)
    moments = [x for x in jax.tree.leaves(state.opt_state) if x.ndim > 0]
    assert len(moments) == 2 * len(jax.tree.leaves(params))  # mu and nu
    sharded = [x for x in moments if any(s is not None for s in x.sharding.spec)]
    assert sharded, "no moment is sharded"
    for x in moments:
        assert x.sharding.mesh == mesh and (x.shape, x.sharding.spec) in by_shape
    for x in jax.tree.leaves(state.opt_state):
        assert x.sharding.mesh == mesh
