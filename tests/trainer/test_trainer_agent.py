"""Agent rollouts in the trainer (`rollout.multi_turn`): a step through the real request-level
server, the loss with tool-token holes in the mask, and validation through the same loops."""
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm.config import load_config
from jaxrl_llm.trainer import RLTrainer
from jaxrl_llm.trainer import _batch as B
from jaxrl_llm.workers import HostWorker
from trainer_helpers import ROOT

TOOLS = os.path.join(ROOT, "configs", "quickstart_tools.py")


def tools_run(tmp_path, **extra):
    o = {"trainer.default_local_dir": str(tmp_path / "run"),
         "trainer.progress_bar": False, "trainer.plot": False, "trainer.logger": "jsonl",
         "trainer.async_save": False, **extra}
    return load_config(f"{TOOLS}:tiny,local", [f"{k}={v}" for k, v in o.items()])


@pytest.fixture(scope="module")
def started(tmp_path_factory):
    trainer = RLTrainer(tools_run(tmp_path_factory.mktemp("agent")))
    trainer.call0(HostWorker.start_rl, trainer.config.trainer.total_training_steps)
    yield trainer
    trainer.close()


def test_agent_step_runs_through_the_server_and_reports_turns(started):
    m = started.train_step()
    for key in ("num_turns/mean", "tool_calls/mean", "tool_errors/total",
                "agent/tool_agent/generate_s/mean", "agent/tokenization_mismatch/mean",
                "reward/num_errors", "actor/pg_loss", "response_length/mean"):
        assert key in m, key
    assert m["num_turns/min"] >= 1 and np.isfinite(m["actor/pg_loss"])
    # the engine's log-probs of the model tokens are the trainer's (fp32, on-policy)
    assert m["rollout/logprob_abs_diff/mean"] < 1e-4
    worker = started.group.workers[0]
    assert worker.server.stats["requests_finished"] >= 8


def _holey_batch(trainer):
    """A real agent rollout, then 3 response tokens of every row turned into 'tool tokens'
    (mask 0, attention kept: one contiguous run)."""
    examples = next(trainer.loader)
    gen = trainer._agent_generate(examples, trainer.config.rollout, seed=5)
    batch = B.rollout_batch(examples, gen, n=trainer.config.rollout.n, pad_token_id=trainer.pad_id,
                            max_prompt_length=trainer.config.data.max_prompt_length)
    mask = batch.response_mask.copy()
    lengths = batch.attention_mask[:, -mask.shape[1]:].sum(-1)
    assert (lengths >= 6).all(), "every response must be long enough to punch a hole in"
    mask[:, 2:5] = 0
    batch.response_mask = mask
    batch.old_log_probs = trainer.call0(HostWorker.compute_old_log_prob, batch)["old_log_probs"]
    rng = np.random.default_rng(0)
    batch.advantages = rng.normal(size=mask.shape).astype(np.float32) * mask
    return batch


def test_holes_in_the_loss_mask_change_nothing_and_the_loss_is_the_masked_mean(started):
    batch = _holey_batch(started)
    actor = started.group.workers[0].actor
    saved = jax.tree.map(jnp.copy, actor.state)
    rows = batch["responses"].shape[0]
    first = started.call0(HostWorker.update_actor, batch, mini_rows=rows, seed=1)
    after_first = jax.tree.map(np.asarray, actor.state)
    # on-policy, one mini-batch: ratio 1, so the token-mean loss is -mean(A) over mask-1 tokens
    mask = batch["response_mask"].astype(np.float64)
    expected = -(batch["advantages"] * mask).sum() / mask.sum()
    assert first["actor/pg_loss"] == pytest.approx(expected, rel=1e-4, abs=1e-6)
    # garbage in the holes (advantages, old log-probs) must not change the update
    other = batch.select(np.arange(batch.rows))  # a copy
    holes = (batch["attention_mask"][:, -mask.shape[1]:] == 1) & (batch["response_mask"] == 0)
    other.advantages = np.where(holes, 100.0, batch.advantages).astype(np.float32)
    other.old_log_probs = np.where(holes, -50.0, batch.old_log_probs).astype(np.float32)
    actor.state = saved
    second = started.call0(HostWorker.update_actor, other, mini_rows=rows, seed=1)
    assert second["actor/pg_loss"] == pytest.approx(first["actor/pg_loss"], rel=1e-6)
    for a, b in zip(jax.tree.leaves(after_first), jax.tree.leaves(actor.state)):
        np.testing.assert_array_equal(a, np.asarray(b))
    started.call0(HostWorker.sync_weights)


def test_validation_uses_the_agent_loops(started):
    val = started.validate()
    assert [k for k in val if k.startswith("val-core/")] == ["val-core/arithmetic/reward/mean@1"]
    assert 0.0 <= val["val-core/arithmetic/reward/mean@1"] <= 1.0


def test_validation_generations_keep_the_turns_of_a_conversation_apart(started):
    import json

    started.validate(step=7)
    path = os.path.join(started.config.trainer.default_local_dir, "val_generations.jsonl")
    rows = [r for r in map(json.loads, open(path)) if r["training/global_step"] == 7]
    assert 0 < len(rows) <= started.config.trainer.log_val_generations
    for row in rows:
        assert {"prompt", "response", "score", "ground_truth"} <= set(row)  # the single-turn fields
        turns = row["turns"]
        assert all(set(t) == {"role", "content"} and isinstance(t["content"], str) for t in turns)
        roles = [t["role"] for t in turns]
        assert roles[0] in ("system", "user") and "assistant" in roles
        assert set(roles) <= {"system", "user", "assistant", "tool"}
        # the model's turns are its own text, not the prompt or tool output run together
        assert all(t["content"] in row["response"] for t in turns if t["role"] == "assistant")


def test_multi_turn_with_one_step_off_policy_runs_the_agent_loops_through_the_rollouter(tmp_path):
    """The batch driver's one-step-off pipeline has no agent loops: separate_async one batch
    ahead with multi-turn rows is the rollouter's (once refused)."""
    run = tools_run(tmp_path, **{"placement.mode": "separate", "placement.one_step_off_policy": True,
                                 "mesh.fsdp": 4})
    assert run.trainer.v1.trainer_mode == "separate_async" and run.rollout_source == "buffer"
    assert tools_run(tmp_path, **{"placement.mode": "separate", "placement.one_step_off_policy": True,
                                  "mesh.fsdp": 4, "rollout.multi_turn.enable": False}).rollout_source == "one_step_off"


def test_token_level_scores_land_on_the_last_model_token():
    mask = np.array([[1, 1, 0, 0, 1, 0], [1, 0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0]], np.int32)
    out = B.token_level_scores(np.array([2.0, 3.0, 4.0], np.float32), mask)
    assert out[0].tolist() == [0, 0, 0, 0, 2.0, 0] and out[1].tolist() == [3.0, 0, 0, 0, 0, 0]
    assert not out[2].any()
