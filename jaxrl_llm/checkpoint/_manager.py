"""`Checkpointer`: a thin orbax `CheckpointManager` with the trainer's save/restore contract.

Each step directory `<directory>/<step>/` holds three orbax items:
`state` (StandardSave of the array pytree), `meta` (the user's JSON dict) and `prng_impls`
(JSON map from key path to PRNG implementation, so typed keys from `jax.random.key` round-trip).
orbax writes into a temporary directory and renames it when the save is complete, so an
interrupted save is never listed as a step. Once orbax has finalised a step, the last file
written into it is `COMPLETE_MARKER`, which records the size and CRC-32 of every other file of
the step (`_verify.py`): a step without it, or whose files no longer match it (truncated,
flipped bytes), is never resumed from. With `async_save` the marker of a step is written when
the next save starts, or at `wait()` / `close()`. In multi-host runs every process must call
`save` and `restore` (orbax coordinates them; only process 0 writes metadata, JSON items and
the marker). A full disk during a save is `DiskFullError` (one line naming the step); the step
then has no marker and the older steps are kept.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

from jaxrl_llm import _chaos
from jaxrl_llm._disk import DiskFullError, disk_full_guard
from jaxrl_llm.checkpoint import _tree
from jaxrl_llm.checkpoint._verify import write_marker

_STATE, _META, _IMPLS = "state", "meta", "prng_impls"


class Checkpointer:
    """Save / restore `(state, meta)` pairs under `directory`, one sub-directory per step.

    Args:
      directory: checkpoint root (created on first use when `enable`).
      max_to_keep: keep only the newest this-many steps; None keeps all.
      async_save: write arrays in a background thread; call `wait()` before reading them back.
      enable: False makes `save` a no-op returning False (reads still work).
    """

    def __init__(self, directory: str | Path, *, max_to_keep: int | None = 3,
                 async_save: bool = True, enable: bool = True):
        if max_to_keep is not None and max_to_keep < 1:
            raise ValueError(f"Checkpointer: max_to_keep must be >= 1 or None, got {max_to_keep}.")
        self.directory = Path(directory).absolute()
        self.enable = enable
        self._async = async_save
        options = ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep, enable_async_checkpointing=async_save,
            create=enable, read_only=not enable)
        self._manager = ocp.CheckpointManager(
            self.directory, options=options, item_handlers={
                _STATE: ocp.StandardCheckpointHandler(),
                _META: ocp.JsonCheckpointHandler(),
                _IMPLS: ocp.JsonCheckpointHandler(),
            })
        self._unmarked: list[int] = []  # steps saved here whose completion marker is not written yet

    def save(self, step: int, state: Any, meta: dict | None = None, *, force: bool = False) -> bool:
        """Save `state` (pytree of arrays, typed PRNG keys allowed) and JSON `meta` at `step`.

        Returns whether a save was started: False when disabled or when orbax skips it (e.g. a
        step not newer than the latest saved one); `force=True` bypasses the interval policy.
        """
        if not self.enable:
            return False
        meta = {} if meta is None else meta
        _check_json(meta)
        with disk_full_guard(self.directory / str(step), f"checkpoint step {step}"):
            return self._save(int(step), state, meta, force)

    def _save(self, step: int, state: Any, meta: dict, force: bool) -> bool:
        self.wait()  # orbax waits for the previous save anyway; then its marker goes in
        # the step list from disk: on a multi-host run another process's controller may have
        # moved steps aside (`set_aside_steps`) after this manager listed them
        self._manager.reload()
        raw_state, impls = _tree.split_keys(state)
        args = ocp.args.Composite(**{
            _STATE: ocp.args.StandardSave(raw_state),
            _META: ocp.args.JsonSave(meta),
            _IMPLS: ocp.args.JsonSave(impls),
        })
        started = bool(self._manager.save(step, args=args, force=force))
        if started:
            self._unmarked.append(step)
            if not self._async:
                self._mark_complete()
        return started

    def _mark_complete(self) -> None:
        """Writes the completion marker of every finished save of this Checkpointer (the last
        file of the step)."""
        steps, self._unmarked = self._unmarked, []
        if jax.process_index() != 0:
            return
        for step in steps:
            path = self.directory / str(step)
            if path.is_dir():  # max_to_keep may already have removed it
                _chaos.kill_point("save", step)
                write_marker(path)

    def check_errors(self) -> None:
        """Raises now if a background save has failed (instead of at the next save)."""
        try:
            with disk_full_guard(self.directory, "a background checkpoint save"):
                self._manager.check_for_errors()
        except DiskFullError:
            raise
        except Exception as e:  # noqa: BLE001 - re-raised with the directory named
            raise RuntimeError(f"a background checkpoint save under {self.directory} failed: "
                               f"{type(e).__name__}: {e}") from e

    def reload(self) -> None:
        """Re-reads the step directories from disk (after they were moved aside)."""
        self._manager.reload()

    def restore(self, step: int | None = None, *, target: Any = None) -> tuple[Any, dict]:
        """Restore `(state, meta)` from `step` (None → latest).

        `target` is a pytree matching the saved state whose leaves are `jax.ShapeDtypeStruct`s
        with `.sharding` or concrete arrays; each array is restored with the target leaf's
        sharding and dtype. With `target=None` arrays come back with the saved shardings, which
        needs the same device set as at save time.
        """
        step = self._resolve_step(step)
        try:
            return self._restore(step, target)
        except (ValueError, OSError) as e:
            if isinstance(e, _tree.StructureMismatch):
                raise
            raise ValueError(
                f"Checkpointer.restore: cannot read step {self.directory}/{step} "
                f"({type(e).__name__}: {str(e)[:500]}); it is damaged: resume from an older step "
                "(resume_mode='auto' skips steps that fail verification)") from e

    def _restore(self, step: int, target: Any) -> tuple[Any, dict]:
        impls = self._manager.restore(step, args=ocp.args.Composite(
            **{_IMPLS: ocp.args.JsonRestore()}))[_IMPLS] or {}
        state_args = ocp.args.StandardRestore()
        if target is not None:
            abstract = _tree.abstract_target(target)
            saved = self._manager.item_metadata(step)[_STATE]
            saved_tree = getattr(saved, "tree", saved)
            _tree.check_matches_saved(abstract, saved_tree,
                                      where=f"Checkpointer.restore({self.directory}/{step})")
            state_args = ocp.args.StandardRestore(abstract)
        restored = self._manager.restore(step, args=ocp.args.Composite(**{
            _STATE: state_args, _META: ocp.args.JsonRestore()}))
        return _tree.wrap_keys(restored[_STATE], impls), dict(restored[_META] or {})

    def _resolve_step(self, step: int | None) -> int:
        steps = self.all_steps()
        if step is None:
            if not steps:
                raise FileNotFoundError(
                    f"Checkpointer.restore: no complete checkpoint under {self.directory}; "
                    "save one first or point the resume path at a checkpoint root.")
            return steps[-1]
        if int(step) not in steps:
            raise FileNotFoundError(
                f"Checkpointer.restore: step {step} not found under {self.directory}; "
                f"available steps: {steps}.")
        return int(step)

    def latest_step(self) -> int | None:
        """Newest complete step, or None when there is none."""
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        """All complete steps, ascending."""
        return sorted(self._manager.all_steps())

    def wait(self) -> None:
        """Block until pending async saves are written, finalised and marked complete."""
        with disk_full_guard(self.directory, "a checkpoint"):
            self._manager.wait_until_finished()
            self._mark_complete()

    def close(self) -> None:
        """Wait for pending saves and release orbax's resources."""
        if self.enable:
            self.wait()
        self._manager.close()

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _check_json(meta: dict) -> None:
    if not isinstance(meta, dict):
        raise TypeError(f"Checkpointer.save: meta must be a dict, got {type(meta).__name__}.")
    try:
        json.dumps(meta)
    except (TypeError, ValueError) as err:
        raise TypeError(
            f"Checkpointer.save: meta is not JSON-serialisable ({err}); convert numpy values "
            "with .item()/.tolist() and configs with .to_dict().") from err
