"""Resolve the trainer's `resume_mode` into a concrete `(checkpoint_root, step)`, and clear the
way for a resumed run's saves.

A step counts only when its directory is finalised (orbax renames `<step>.orbax-checkpoint-tmp-*`
to `<step>` once every item is written) and carries the completion marker written after that
(`_verify.py`), so a save interrupted by a crash is never resumed from. "auto" also checks the
newest step's files against the marker's checksums and falls back to the next older step,
logging which step it skipped and why; when there are steps but none is usable it raises
`NoUsableCheckpoint` instead of starting over (only resume_mode "disable" starts over). `set_aside_steps` moves step directories newer than the
resumed one (and broken ones) out of the checkpoint root, so the resumed run can save again.
"""
from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import orbax.checkpoint as ocp

from jaxrl_llm.checkpoint._verify import has_marker, verify_step

log = logging.getLogger(__name__)

_STATE_ITEM = "state"
SET_ASIDE_DIR = "set_aside"  # <root>/../set_aside/<time>/<step>: steps moved out of the way


def _is_complete_step_dir(path: Path) -> bool:
    return (path.is_dir() and path.name.isdigit() and (path / _STATE_ITEM).is_dir()
            and ocp.step.is_checkpoint_finalized(path) and has_marker(path))


def _step_of(name: str) -> int | None:
    """The step of a step directory (`30`) or of orbax's temporary one (`30.orbax-checkpoint-tmp-*`)."""
    head = name.split(".", 1)[0]
    return int(head) if head.isdigit() else None


class NoUsableCheckpoint(RuntimeError):
    """A checkpoint root holds step directories but none can be resumed from (all damaged, or
    several interrupted): starting over silently would throw the run's progress away."""


def _scan(root: Path) -> tuple[int | None, list[tuple[int, str]]]:
    """(newest step whose files pass `verify_step` or None, [(step, reason)] of the newer ones
    that failed, newest first)."""
    if not root.is_dir():
        return None, []
    steps = sorted((int(p.name) for p in root.iterdir() if p.name.isdigit() and p.is_dir()), reverse=True)
    failed = []
    for step in steps:
        reason = verify_step(root / str(step))
        if reason is None:
            return step, failed
        failed.append((step, reason))
    return None, failed


def newest_valid_step(directory: str | Path, *, what: str = "trainer.resume_mode=auto") -> int | None:
    """Newest step under `directory` whose files pass `verify_step`; logs each newer one skipped.

    None when there is no step directory, or only one left by an interrupted save (a kill during
    the first save). Raises `NoUsableCheckpoint` naming every step and its fault when there are
    step directories but none is usable and at least one is damaged (not merely interrupted) or
    several are: the run's progress would otherwise be silently lost.
    """
    root = Path(directory)
    step, failed = _scan(root)
    for bad, reason in failed:
        level = logging.WARNING if step is not None or len(failed) == 1 else logging.ERROR
        log.log(level, "resume: skipping checkpoint step %d in %s: %s%s", bad, root, reason,
                "; trying the next older step" if step is not None else "")
    if step is None and failed:
        damaged = [r for _, r in failed if not r.startswith("incomplete")]
        if damaged or len(failed) > 1:
            faults = "; ".join(f"step {s}: {r}" for s, r in failed)
            raise NoUsableCheckpoint(
                f"{what}: no usable checkpoint in {root.absolute()} ({faults}). Nothing was changed "
                "(metrics.jsonl and the step directories are as they were). Repair or restore a step, "
                "point trainer.resume_mode at another checkpoint, or set trainer.resume_mode=disable "
                "to start over (the steps are then moved to set_aside/ and metrics.jsonl restarts)")
        log.warning("resume: %s holds only step %d, left by an interrupted save; starting from "
                    "scratch", root, failed[0][0])
    return step


def finalized_steps(directory: str | Path) -> list[int]:
    """Ascending steps with a complete checkpoint directly under `directory` ([] if none)."""
    root = Path(directory)
    if not root.is_dir():
        return []
    return sorted(int(p.name) for p in root.iterdir() if _is_complete_step_dir(p))


def resolve_resume(resume_mode: str, directory: str | Path) -> tuple[Path, int] | None:
    """Where to resume from.

    Args:
      resume_mode: "auto" (latest complete checkpoint under `directory`, None when there is
        none), "disable" (None), or a path to a step directory (`.../checkpoints/30`) or to a
        checkpoint root (its latest complete step).
      directory: the run's checkpoint root, used by "auto".

    Returns:
      `(checkpoint_root, step)` for `Checkpointer(checkpoint_root).restore(step)`, or None.

    Raises:
      FileNotFoundError: an explicit path that does not exist or holds no complete checkpoint.
      NoUsableCheckpoint: step directories exist but none can be resumed from (see
        `newest_valid_step`); only "disable" starts over then.
    """
    if resume_mode == "disable":
        return None
    if resume_mode == "auto":
        step = newest_valid_step(directory)
        return (Path(directory).absolute(), step) if step is not None else None
    return _resolve_path(Path(resume_mode).absolute())


def set_aside_steps(directory: str | Path, keep_up_to: int) -> list[Path]:
    """Moves every step directory of `directory` newer than `keep_up_to`, and every incomplete or
    damaged one, to `<directory>/../set_aside/<time>/` (nothing is deleted), so a run resumed
    from `keep_up_to` saves its next steps without colliding with them. Returns the new paths."""
    root = Path(directory)
    if not root.is_dir():
        return []
    moved = []
    dest = root.parent / SET_ASIDE_DIR / time.strftime("%Y%m%d-%H%M%S")
    for path in sorted(root.iterdir()):
        step = _step_of(path.name)
        if step is None:
            continue
        reason = ("newer than the resumed step" if step > keep_up_to
                  else None if path.name.isdigit() and _is_complete_step_dir(path)
                  else "incomplete")
        if reason is None:
            continue
        dest.mkdir(parents=True, exist_ok=True)
        target = dest / path.name
        os.replace(path, target)
        log.warning("checkpoint %s (%s) moved aside to %s", path, reason, target)
        moved.append(target)
    return moved


def _resolve_path(path: Path) -> tuple[Path, int]:
    if not path.exists():
        raise FileNotFoundError(
            f"resume path {path} does not exist; pass a checkpoint root or a step directory "
            "such as <root>/30, or use resume_mode='auto' / 'disable'.")
    if path.name.isdigit() and (path / _STATE_ITEM).exists():
        reason = verify_step(path)
        if reason is not None:
            raise FileNotFoundError(
                f"resume path {path} is not a usable checkpoint step ({reason}); pick another "
                "step or the checkpoint root to use its newest intact step.")
        return path.parent, int(path.name)
    step = newest_valid_step(path, what=f"trainer.resume_mode={path}")
    if step is None:
        raise FileNotFoundError(
            f"resume path {path} holds no complete checkpoint (looked for step directories "
            f"<step>/{_STATE_ITEM} finalised by orbax and marked complete); pass a checkpoint "
            "root or a step directory.")
    return path, step
