"""Faults a run must survive or stop on cleanly: NaN/inf updates, hostile rewards, damaged or
newer checkpoint steps, and metric files after a kill + resume."""
import errno
import functools
import json
import os

import jax
import numpy as np
import pytest

from jaxrl_llm._cli import completed_step
from jaxrl_llm.checkpoint import COMPLETE_MARKER, Checkpointer, resolve_resume
from jaxrl_llm.config import load_config
from jaxrl_llm.trainer import NonFiniteError, RLTrainer

from trainer_helpers import QUICKSTART, tiny_overrides


def _config(run_dir, **extra):
    extra = {"trainer.total_training_steps": 3, "trainer.save_freq": 1, "trainer.test_freq": 0,
             "trainer.val_before_train": False, "trainer.export_hf": False, "sft.steps": 0, **extra}
    return load_config(f"{QUICKSTART}:tiny,local", tiny_overrides(run_dir, **extra))


def _rows(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_nan_updates_are_skipped_counted_and_stop_the_run_without_saving_nan(tmp_path):
    run_dir = tmp_path / "nan"
    cfg = _config(run_dir, **{"actor.optim.lr": 1e9, "trainer.total_training_steps": 6,
                              "trainer.max_nonfinite_steps": 2, "trainer.export_hf": True})
    with pytest.raises(NonFiniteError, match="trainer.max_nonfinite_steps=2"):
        RLTrainer(cfg).fit()
    rows = _rows(run_dir)
    last = rows[-1]
    assert last["training/nonfinite_steps"] == 2 and last["actor/nonfinite_updates"] >= 1
    assert last["training/global_step"] < 6
    assert not (run_dir / "hf_actor").exists()  # no export of a stopped run
    root = run_dir / "checkpoints"
    step = resolve_resume("auto", root)[1]
    assert step < last["training/global_step"]  # the stopping step was not checkpointed
    state, _ = Checkpointer(root).restore(step)
    for leaf in jax.tree.leaves(state):
        if np.issubdtype(np.asarray(leaf).dtype, np.floating):
            assert np.isfinite(np.asarray(leaf)).all()


_NONDETERMINISTIC = ("timing_s/", "timing_per_token_ms/", "perf/", "rollout/sync_time_s")


def _comparable(run_dir):
    return [{k: v for k, v in r.items() if not k.startswith(_NONDETERMINISTIC)} for r in _rows(run_dir)]


class _Killed(RuntimeError):
    pass


class _KilledAfterStep3(RLTrainer):
    def save_checkpoint(self):
        super().save_checkpoint()
        if self.global_step == 3:
            raise _Killed("simulated preemption")


def _assert_same_rows(got, want):
    assert [r["training/global_step"] for r in got] == [r["training/global_step"] for r in want]
    for g, w in zip(got, want):
        assert g.keys() == w.keys()
        for key, value in w.items():
            assert g[key] == pytest.approx(value, rel=1e-5, abs=1e-6), (w["training/global_step"], key)


def test_resume_skips_damaged_step_rolls_back_and_leaves_metrics_like_an_uninterrupted_run(
        tmp_path, caplog):
    full_dir, cut_dir = tmp_path / "full", tmp_path / "cut"
    cfg = dict(**{"trainer.total_training_steps": 4, "trainer.max_to_keep": 3})
    RLTrainer(_config(full_dir, **cfg)).fit()
    with pytest.raises(_Killed):
        _KilledAfterStep3(_config(cut_dir, **cfg)).fit()
    root = cut_dir / "checkpoints"
    # damage the newest step, and leave an empty step directory as a crash can
    data = max((p for p in (root / "3").rglob("*") if p.is_file() and p.name != COMPLETE_MARKER),
               key=lambda p: p.stat().st_size)
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    (root / "7").mkdir()

    with caplog.at_level("WARNING"):
        RLTrainer(_config(cut_dir, **cfg)).fit()  # auto: falls back to step 2
    assert "skipping checkpoint step 3" in caplog.text and "truncated" in caplog.text
    assert sorted(p.name for p in root.iterdir()) == ["2", "3", "4"]
    _assert_same_rows(_comparable(cut_dir), _comparable(full_dir))  # rows 1-4, each once

    # rollback: resume explicitly from step 2 while steps 3 and 4 exist
    RLTrainer(_config(cut_dir, **cfg, **{"trainer.resume_mode": str(root / "2")})).fit()
    assert resolve_resume("auto", root)[1] == 4
    _assert_same_rows(_comparable(cut_dir), _comparable(full_dir))


def test_workers_refuse_to_write_nan_state():
    from jaxrl_llm.workers._host import _check_finite

    good = {"actor": {"w": jax.numpy.ones((2, 2)), "count": jax.numpy.zeros((), jax.numpy.int32)}}
    _check_finite(good, "checkpoint step 1")
    bad = {"actor": {"w": jax.numpy.ones((2, 2)), "mu": jax.numpy.array([1.0, float("nan")])}}
    with pytest.raises(FloatingPointError, match=r"refusing to write checkpoint step 3: 1 arrays .*'mu'"):
        _check_finite(bad, "checkpoint step 3")


def test_all_checkpoints_damaged_stops_before_touching_the_run_and_disable_starts_over(tmp_path, capsys):
    """Every step is damaged: the run raises naming the folder and each fault, and leaves
    metrics.jsonl and the steps as they were; only resume_mode=disable starts over."""
    from jaxrl_llm.checkpoint import NoUsableCheckpoint

    run_dir = tmp_path / "run"
    root = run_dir / "checkpoints"
    with Checkpointer(root, async_save=False, max_to_keep=None) as ckpt:
        for step in (1, 2):
            ckpt.save(step, {"x": jax.numpy.full((4,), float(step))}, {"global_step": step})
    for step in (1, 2):
        data = max((p for p in (root / str(step)).rglob("*") if p.is_file() and p.name != COMPLETE_MARKER),
                   key=lambda p: p.stat().st_size)
        data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    rows = "".join(json.dumps({"training/global_step": s, "critic/score/mean": 0.5}) + "\n" for s in (1, 2))
    (run_dir / "metrics.jsonl").write_text(rows)
    (run_dir / "val_generations.jsonl").write_text(rows)

    with pytest.raises(SystemExit):  # the command line: one line on stderr, nothing started
        completed_step(_config(run_dir))
    err_lines = capsys.readouterr().err.strip().splitlines()
    assert len(err_lines) == 1 and err_lines[0].startswith("error: trainer.resume_mode=auto: no usable")
    with pytest.raises(NoUsableCheckpoint) as err:
        RLTrainer(_config(run_dir)).fit()
    assert str(root.absolute()) in str(err.value)
    assert "step 2: file" in str(err.value) and "step 1: file" in str(err.value)
    assert (run_dir / "metrics.jsonl").read_text() == rows  # untouched
    assert (run_dir / "val_generations.jsonl").read_text() == rows
    assert sorted(p.name for p in root.iterdir()) == ["1", "2"] and not (run_dir / "set_aside").exists()

    RLTrainer(_config(run_dir, **{"trainer.resume_mode": "disable",
                                  "trainer.total_training_steps": 1})).fit()
    assert [r["training/global_step"] for r in _rows(run_dir)] == [1]  # a fresh run's rows
    assert resolve_resume("auto", root)[1] == 1  # its own step 1; the damaged ones set aside
    assert (run_dir / "set_aside").is_dir()


def _enospc(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


def test_disk_full_on_a_save_or_the_export_stops_with_one_line_and_keeps_what_was_saved(
        tmp_path, monkeypatch):
    """ENOSPC injected into orbax's save of step 2, then into the final export: each stops the
    run with one DiskFullError line naming the path; step 1 (then 2) stays intact and resumable."""
    import orbax.checkpoint as ocp
    from jaxrl_llm._disk import DiskFullError
    from jaxrl_llm.workers import HostWorker

    run_dir = tmp_path / "full"
    root = run_dir / "checkpoints"
    save = ocp.CheckpointManager.save

    def save_until_full(self, step, *args, **kwargs):
        return _enospc() if step == 2 else save(self, step, *args, **kwargs)

    monkeypatch.setattr(ocp.CheckpointManager, "save", save_until_full)
    with pytest.raises(DiskFullError) as err:
        RLTrainer(_config(run_dir, **{"trainer.total_training_steps": 2})).fit()
    text = str(err.value)
    assert "\n" not in text and text.startswith("disk full: checkpoint step 2")
    assert str(root / "2") in text and err.value.__cause__ is None
    assert resolve_resume("auto", root)[1] == 1  # what was saved is kept

    monkeypatch.setattr(ocp.CheckpointManager, "save", save)
    # the trainer calls workers by method: the patch keeps the name
    monkeypatch.setattr(HostWorker, "export_hf", functools.wraps(HostWorker.export_hf)(_enospc))
    with pytest.raises(DiskFullError, match=rf"^disk full: the Hugging Face export .* to {run_dir}/hf_actor"):
        RLTrainer(_config(run_dir, **{"trainer.total_training_steps": 2, "trainer.export_hf": True})).fit()
    assert resolve_resume("auto", root)[1] == 2  # resumed from 1, trained and saved step 2
    assert [r["training/global_step"] for r in _rows(run_dir)] == [1, 2]

    # the last step is saved, its export is not: the run is not complete; a restart only exports
    monkeypatch.undo()
    cfg = _config(run_dir, **{"trainer.total_training_steps": 2, "trainer.export_hf": True})
    assert completed_step(cfg) is None
    RLTrainer(cfg).fit()
    assert list((run_dir / "hf_actor").glob("*.safetensors")) and completed_step(cfg) == 2
    assert [r["training/global_step"] for r in _rows(run_dir)] == [1, 2]


class _FullFile:
    """A file on a full disk: every write and flush fails with ENOSPC."""

    def write(self, *args):
        _enospc()

    flush = close = write


def test_disk_full_on_a_metrics_write_is_one_line_naming_the_file_and_close_is_quiet(tmp_path):
    from jaxrl_llm._disk import DiskFullError
    from jaxrl_llm.metrics import MetricsLogger

    logger = MetricsLogger(tmp_path, backends=("jsonl",))
    logger.log({"a": 1.0}, step=1)
    logger._jsonl.close()
    logger._jsonl = _FullFile()
    with pytest.raises(DiskFullError, match=rf"^disk full: the metrics of step 2 .* to {tmp_path}/metrics.jsonl") as err:
        logger.log({"a": 2.0}, step=2)
    assert "\n" not in str(err.value) and err.value.__cause__ is None
    logger.close()  # the same full disk: not raised again
    assert [r["training/global_step"] for r in _rows(tmp_path)] == [1]  # the saved row is kept


def test_a_disk_full_error_reported_by_a_ray_worker_as_text_is_found():
    from jaxrl_llm._disk import DiskFullError, as_disk_full
    from jaxrl_llm.trainer import WorkerError

    remote = WorkerError("worker call 'save_checkpoint' failed on a Ray actor:\nTraceback ...\n"
                         "jaxrl_llm._disk.DiskFullError: disk full: checkpoint step 4 could not be "
                         "written to /runs/x/checkpoints/4 (no space left on device). The run stopped\n")
    assert str(as_disk_full(remote)).startswith("disk full: checkpoint step 4 could not be written to /runs/x")
    bare = WorkerError("worker call 'export_hf' failed:\nOSError: [Errno 28] No space left on device")
    assert str(as_disk_full(bare, "/runs/x/hf_actor", "the export")).startswith(
        "disk full: the export could not be written to /runs/x/hf_actor")
    assert as_disk_full(WorkerError("worker call failed: ValueError: shapes differ")) is None

    class RayTaskErrorLike(DiskFullError):  # Ray re-raises a remote error as a subclass of it
        def __str__(self):
            return ("ray::HostWorker.save_checkpoint() (pid=1)\n  File \"_manager.py\", line 71\n"
                    "jaxrl_llm._disk.DiskFullError: disk full: checkpoint step 4 could not be "
                    "written to /runs/x/checkpoints/4 (no space left on device). Free space")
    try:
        raise WorkerError("worker call 'save_checkpoint' failed on a Ray actor") from RayTaskErrorLike("x")
    except WorkerError as e:
        found = str(as_disk_full(e))
    assert "\n" not in found and found.startswith("disk full: checkpoint step 4")


def test_the_trainer_reaches_the_chaos_kill_points_of_each_step_in_order(tmp_path, monkeypatch):
    """scripts/chaos.py kills at these points (jaxrl_llm/_chaos.py): the rollout is back, the
    update is done, the step is saved but not marked complete."""
    from jaxrl_llm import _chaos

    reached = []

    def record(phase, step=None):
        reached.append((phase, _chaos._step if step is None else step))

    monkeypatch.setattr(_chaos, "kill_point", record)
    RLTrainer(_config(tmp_path / "run", **{"trainer.total_training_steps": 2})).fit()
    assert reached == [("generation", 1), ("update", 1), ("save", 1),
                       ("generation", 2), ("update", 2), ("save", 2)]
