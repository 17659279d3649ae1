"""Kill-and-resume: a run interrupted after a checkpoint continues exactly like an uninterrupted one."""
import functools
import json
import os
import re

import pytest

from jaxrl_llm._cli import completed_step
from jaxrl_llm.checkpoint import resolve_resume
from jaxrl_llm.config import load_config
from jaxrl_llm.trainer import RLTrainer, WorkerError

from trainer_helpers import QUICKSTART, tiny_overrides

# metrics that measure wall time or memory differ between any two runs
_NONDETERMINISTIC = ("timing_s/", "timing_per_token_ms/", "perf/", "rollout/sync_time_s")


def _config(run_dir, **extra):
    extra = {"trainer.total_training_steps": 4, "trainer.save_freq": 2, "trainer.test_freq": 2,
             "trainer.export_hf": False, "actor.optim.lr_schedule": "cosine",
             "actor.optim.warmup_steps": 1, **extra}
    return load_config(f"{QUICKSTART}:tiny,local", tiny_overrides(run_dir, **extra))


def _steps(run_dir):
    out = {}
    for line in open(os.path.join(run_dir, "metrics.jsonl")):
        rec = json.loads(line)
        out[rec["training/global_step"]] = {k: v for k, v in rec.items()
                                            if not k.startswith(_NONDETERMINISTIC)}
    return out


class _Killed(RuntimeError):
    pass


class _KilledAfter(RLTrainer):
    """Dies (like a preempted job) right after the step-2 checkpoint is written."""

    def save_checkpoint(self):
        super().save_checkpoint()
        if self.global_step == 2:
            raise _Killed("simulated preemption")


def test_resume_after_kill_continues_exactly(tmp_path):
    full_dir, cut_dir = tmp_path / "full", tmp_path / "cut"
    RLTrainer(_config(full_dir)).fit()

    # a finished run is complete (the CLI says so and exits before starting anything)
    assert completed_step(_config(full_dir)) == 4
    assert completed_step(_config(full_dir, **{"trainer.total_training_steps": 6})) is None

    with pytest.raises(_Killed):
        _KilledAfter(_config(cut_dir)).fit()
    assert resolve_resume("auto", cut_dir / "checkpoints")[1] == 2
    assert completed_step(_config(cut_dir)) is None
    assert max(_steps(cut_dir)) == 2  # step 2's row goes in before its checkpoint

    RLTrainer(_config(cut_dir)).fit()  # resume_mode=auto picks up step 2
    full, resumed = _steps(full_dir), _steps(cut_dir)
    for step in (3, 4):
        assert resumed[step].keys() == full[step].keys()
        for key, value in full[step].items():
            assert resumed[step][key] == pytest.approx(value, rel=1e-5, abs=1e-6), (step, key)


def test_resume_from_explicit_path_and_missing_path_errors(tmp_path):
    run_dir = tmp_path / "a"
    RLTrainer(_config(run_dir, **{"trainer.total_training_steps": 2})).fit()
    other = tmp_path / "b"
    trainer = RLTrainer(_config(other, **{"trainer.resume_mode": str(run_dir / "checkpoints" / "2"),
                                          "trainer.total_training_steps": 3}))
    trainer.fit()
    assert max(_steps(other)) == 3 and 1 not in _steps(other)
    with pytest.raises(FileNotFoundError, match="nope"):
        RLTrainer(_config(tmp_path / "c", **{"trainer.resume_mode": str(tmp_path / "nope")})).fit()


def test_worker_failure_stops_cleanly_and_keeps_checkpoints(tmp_path, monkeypatch):
    from jaxrl_llm.workers import HostWorker

    run_dir = tmp_path / "fail"
    calls = {"n": 0}
    original = HostWorker.update_actor

    @functools.wraps(original)  # the trainer calls workers by method: the patch keeps the name
    def flaky(self, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise FloatingPointError("NaN in the update (simulated)")
        return original(self, *args, **kwargs)

    monkeypatch.setattr(HostWorker, "update_actor", flaky)
    with pytest.raises(WorkerError, match="NaN in the update"):
        RLTrainer(_config(run_dir)).fit()
    assert resolve_resume("auto", run_dir / "checkpoints")[1] == 2


def test_agent_run_resumes_every_counter_like_an_uninterrupted_run(tmp_path):
    """The tools config (agent loops through the request-level server): step 3 redone from the
    step-2 checkpoint equals the uninterrupted step 3 in every metric but wall time, counters
    included: the server's policy version (`rollout/sync_policy_version`, stamped on every
    token), the data epoch and the non-finite count."""
    tools = os.path.join(os.path.dirname(QUICKSTART), "quickstart_tools.py")
    run_dir = tmp_path / "tools"

    def config(**extra):
        o = {"trainer.total_training_steps": 3, "trainer.save_freq": 1, "trainer.max_to_keep": 3,
             "trainer.test_freq": 0, "trainer.val_before_train": False, "trainer.export_hf": False,
             "sft.steps": 0, "data.val_files": "[]", **extra}
        return load_config(f"{tools}:tiny,local", tiny_overrides(run_dir, **o))

    RLTrainer(config()).fit()
    first = _steps(run_dir)
    RLTrainer(config(**{"trainer.resume_mode": str(run_dir / "checkpoints" / "2")})).fit()
    again = _steps(run_dir)
    assert sorted(again) == [1, 2, 3]
    counters = ("rollout/sync_policy_version", "training/epoch", "training/nonfinite_steps",
                "training/global_step")
    assert all(key in first[3] for key in counters), sorted(first[3])
    assert first[3]["rollout/sync_policy_version"] == first[2]["rollout/sync_policy_version"] + 1
    for key, value in first[3].items():
        if not _wall_time(key):
            assert again[3][key] == pytest.approx(value, rel=1e-5, abs=1e-6), key


def _wall_time(key: str) -> bool:
    """A duration in seconds (`..._s`, `..._s/mean`): differs between any two runs."""
    return bool(re.search(r"_s(/|$)", key))
