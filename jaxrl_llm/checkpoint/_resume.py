"""Resolve the trainer's `resume_mode` into a concrete `(checkpoint_root, step)`.

A step counts only when its directory is finalised (orbax renames `<step>.orbax-checkpoint-tmp-*`
to `<step>` once every item is written), so a save interrupted by a crash is never resumed from.
"""
from __future__ import annotations

from pathlib import Path

import orbax.checkpoint as ocp

_STATE_ITEM = "state"


def _is_complete_step_dir(path: Path) -> bool:
    return (path.is_dir() and path.name.isdigit() and (path / _STATE_ITEM).is_dir()
            and ocp.step.is_checkpoint_finalized(path))


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
    """
    if resume_mode == "disable":
        return None
    if resume_mode == "auto":
        steps = finalized_steps(directory)
        return (Path(directory).absolute(), steps[-1]) if steps else None
    return _resolve_path(Path(resume_mode).absolute())


def _resolve_path(path: Path) -> tuple[Path, int]:
    if not path.exists():
        raise FileNotFoundError(
            f"resume path {path} does not exist; pass a checkpoint root or a step directory "
            "such as <root>/30, or use resume_mode='auto' / 'disable'.")
    if path.name.isdigit() and (path / _STATE_ITEM).exists():
        if not _is_complete_step_dir(path):
            raise FileNotFoundError(
                f"resume path {path} is an incomplete (unfinalised) checkpoint step; pick "
                "another step or the checkpoint root to use its latest complete step.")
        return path.parent, int(path.name)
    steps = finalized_steps(path)
    if not steps:
        raise FileNotFoundError(
            f"resume path {path} holds no complete checkpoint (looked for step directories "
            f"<step>/{_STATE_ITEM} finalised by orbax); pass a checkpoint root or a step "
            "directory.")
    return path, steps[-1]
