"""The actor's real update path (`_host._meshes` from the config, ActorWorker's micro-batched
jit step) on a mesh with `mesh.context=2`: the same log-probs, loss and updated policy as
without the context axis (tiny quickstart model, fp32 on CPU)."""
import os

import numpy as np
import pytest

from jaxrl_llm.config import ConfigError, load_config
from jaxrl_llm.workers import _host
from jaxrl_llm.workers._common import build_model
from jaxrl_llm.workers._roles import ActorWorker

QUICKSTART = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "quickstart.py")


def _batch(rows=8, p=4, t=4, vocab=20):
    rng = np.random.default_rng(0)
    prompts = rng.integers(1, vocab, size=(rows, p)).astype(np.int32)
    responses = rng.integers(1, vocab, size=(rows, t)).astype(np.int32)
    prompt_mask = np.ones((rows, p), np.int32)
    prompt_mask[0, :2] = 0  # left-padded prompts
    response_mask = np.ones((rows, t), np.int32)
    response_mask[1, 2:] = 0  # right-padded responses
    response_mask[3] = 0
    attention = np.concatenate([prompt_mask, response_mask], axis=1)
    ids = np.concatenate([prompts, responses], 1) * attention
    return {"input_ids": ids, "attention_mask": attention,
            "position_ids": np.maximum(np.cumsum(attention, 1) - 1, 0).astype(np.int32),
            "responses": responses * response_mask, "response_mask": response_mask,
            "advantages": rng.normal(size=(rows, t)).astype(np.float32) * response_mask}


def _one_update(context: int, packed: bool = False):
    extra = ["actor.use_dynamic_bsz=True", "actor.ppo_max_token_len_per_device=128"] if packed else []
    run = load_config(f"{QUICKSTART}:tiny,local", [f"mesh.context={context}", "model.dtype=float32", *extra])
    mesh, _ = _host._meshes(run)
    assert mesh.shape["context"] == context and mesh.shape["fsdp"] == 8 // context
    actor = ActorWorker(build_model(run.model, vocab_size=20, mesh=mesh), run.actor, mesh=mesh,
                        total_steps=1, temperature=1.0)
    assert actor.update_budget[0] == (128 if packed else 0) == actor.log_prob_budget[0]
    batch = _batch()
    batch["old_log_probs"] = actor.compute_log_prob(batch)["old_log_probs"]
    metrics = actor.update(batch, mini_rows=8, seed=0)
    return batch["old_log_probs"], metrics, actor.compute_log_prob(batch)["old_log_probs"]


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_actor_update_with_mesh_context_2_equals_context_1(packed):
    """packed: token-budget micro-batches of packed rows (`actor.use_dynamic_bsz`, pack length 128)."""
    before, metrics, after = _one_update(2, packed)
    want_before, want_metrics, want_after = _one_update(1, packed)
    np.testing.assert_allclose(before, want_before, atol=1e-5)
    assert np.abs(after - before).max() > 1e-4  # the update moved the policy
    np.testing.assert_allclose(after, want_after, atol=1e-5)
    for key in ("actor/pg_loss", "actor/grad_norm"):
        np.testing.assert_allclose(metrics[key], want_metrics[key], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("override, match", [
    ("mesh.context=0", "mesh.context must be >= 1"),
    ("placement.rollout_mesh.context=2", "placement.rollout_mesh.context must be 1"),
])
def test_bad_context_sizes_are_named(override, match):
    with pytest.raises(ConfigError, match=match):
        load_config(f"{QUICKSTART}:tiny,local", [override])
