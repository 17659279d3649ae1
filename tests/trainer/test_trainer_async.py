"""Fully asynchronous training (`async_training`): staleness 0 is the synchronous trainer, a
checkpoint resumes to the same next batch, and the config refuses what it cannot run. (Running
ahead with partial rollout, within the bound, through Ray: test_trainer_quickstart_async.py.)"""
import json

import pytest

from jaxrl_llm.config import ConfigError, load_config
from jaxrl_llm.trainer import RLTrainer
from trainer_helpers import QUICKSTART, tiny_overrides

_SEPARATE = {"mesh.fsdp": 4, "placement.mode": "separate", "placement.rollout_mesh.tensor": 4,
             "model.init.num_key_value_heads": 4, "trainer.backend": "local",
             "data.train_batch_size": 4, "actor.ppo_mini_batch_size": 4,
             "trainer.export_hf": False, "trainer.val_before_train": False}
_NOT_COMPARED = ("timing_s/", "timing_per_token_ms/", "perf/", "fully_async/", "rollout/policy_version",
                 "rollout/off_policy_steps",
                 "rollout/sync_", "num_turns/", "tool_", "agent/")


def _run(tmp_path, name, **extra):
    return load_config(f"{QUICKSTART}:tiny", tiny_overrides(tmp_path / name, **{**_SEPARATE, **extra}))


def _rows(tmp_path, name):
    return [json.loads(line) for line in open(tmp_path / name / "metrics.jsonl")]


def test_staleness_zero_is_the_synchronous_trainer(tmp_path):
    """s = 0, one sync per step: the same prompts, tokens, rewards, losses and validation as the
    synchronous trainer (rel 1e-5), though the rollout ran through the rollouter and its queue."""
    steps = {"trainer.total_training_steps": 2}
    RLTrainer(_run(tmp_path, "sync", **steps)).fit()
    RLTrainer(_run(tmp_path, "async", **steps, **{"async_training.enable": True})).fit()
    sync, fully = _rows(tmp_path, "sync"), _rows(tmp_path, "async")
    assert len(sync) == len(fully) == 2
    compared = 0
    for a, b in zip(sync, fully):
        assert b["fully_async/staleness/max"] == 0 and b["rollout/policy_version_lag"] == 0
        for key, value in a.items():
            if key.startswith(_NOT_COMPARED) or not isinstance(value, float):
                continue
            assert key in b, key
            assert b[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
            compared += 1
    assert compared > 40
    assert "val-core/arithmetic/reward/mean@1" in fully[-1]


def test_async_resume_repeats_the_next_step_exactly(tmp_path, monkeypatch):
    """Checkpoint at every step; resuming from step 2 (queue, unfinished prompts, data position
    and policy version restored) gives step 3 exactly as the uninterrupted run had it. A save
    with work in the rollouter reaches scripts/chaos.py's `async_queue` kill point."""
    from jaxrl_llm import _chaos

    reached = []
    monkeypatch.setattr(_chaos, "kill_point", lambda phase, step=None: reached.append((phase, step)))
    o = {"trainer.total_training_steps": 3, "trainer.save_freq": 1, "trainer.max_to_keep": 3,
         "trainer.test_freq": 0, "async_training.enable": True, "data.builtin_val_size": 0}
    RLTrainer(_run(tmp_path, "a", **o)).fit()
    first = _rows(tmp_path, "a")
    meta = json.load(open(tmp_path / "a" / "checkpoints" / "2" / "meta" / "metadata"))
    state = meta["fully_async"]
    assert state["fed_batches"] >= 3 and state["pending"] + state["queued"]
    assert ("async_queue", 2) in reached
    RLTrainer(_run(tmp_path, "a", **{**o, "trainer.resume_mode": str(tmp_path / "a" / "checkpoints" / "2")})).fit()
    again = _rows(tmp_path, "a")
    assert [r["training/global_step"] for r in again] == [1, 2, 3]
    assert "rollout/sync_policy_version" in first[2] and "fully_async/dropped_stale_groups" in first[2]
    for key, value in first[2].items():  # counters too (policy version, stale and dropped groups)
        if not key.startswith(("timing_s/", "timing_per_token_ms/", "perf/", "fully_async/trainer",
                               "fully_async/rollouter", "fully_async/queue_size", "rollout/sync_time_s",
                               "rollout/sync_wait_s", "rollout/sync_pause_wait_s",
                               "rollout/sync_held_requests", "agent/")) and isinstance(value, float):
            assert again[2][key] == pytest.approx(value, rel=1e-5, abs=1e-6), key


@pytest.mark.parametrize("extra, match", [
    ({"async_training.partial_rollout": True}, "partial_rollout=True needs"),
    ({"async_training.require_batches": 3}, r"parameter_sync_step=3 x actor.ppo_mini_batch_size=4 = 12 must equal"),
    ({"placement.mode": "colocated"}, "needs placement.mode='separate'"),
    ({"placement.one_step_off_policy": True}, "one_step_off_policy=True is an alias of .*num_warmup_batches"),
    ({"algorithm.filter_groups.enable": True, "algorithm.filter_groups.metric": "seq_final_reward"},
     r"offers algorithm\.filter_groups\.metric 'acc' or 'score', not 'seq_final_reward'"),
    ({"async_training.staleness_threshold": -0.5}, "staleness_threshold must be >= 0"),
    ({"async_training.trigger_parameter_sync_step": 0}, "trigger_parameter_sync_step must be > 0"),
])
def test_config_errors(tmp_path, extra, match):
    with pytest.raises(ConfigError, match=match):
        _run(tmp_path, "bad", **{"async_training.enable": True, **extra})


def test_separate_async_with_the_agent_loop_runs_two_steps(tmp_path):
    """separate_async with multi-turn rows: the rollouter drives the tool agent loops."""
    import os

    from trainer_helpers import ROOT

    o = {**_SEPARATE, "trainer.v1.trainer_mode": "separate_async", "trainer.total_training_steps": 2,
         "trainer.default_local_dir": str(tmp_path / "agent"), "trainer.progress_bar": False, "trainer.plot": False,
         "trainer.logger": "jsonl", "trainer.async_save": False, "data.builtin_val_size": 0,
         "data.train_batch_size": 4, "actor.ppo_mini_batch_size": 2}
    run = load_config(f"{os.path.join(ROOT, 'configs', 'quickstart_tools.py')}:tiny,local",
                      [f"{k}={v}" for k, v in o.items()])
    assert run.rollout_source == "buffer"
    RLTrainer(run).fit()
    rows = _rows(tmp_path, "agent")
    assert [r["training/global_step"] for r in rows] == [1, 2]
    assert all(r["num_turns/min"] >= 1 and r["fully_async/staleness/max"] <= 1 for r in rows)
