"""The completion marker of a checkpoint step and the check that its files are intact.

`write_marker(step_dir)` is called once orbax has finalised the step; it lists the size and
CRC-32 of every file of the step and is written last (to a temporary name, then renamed), so its
presence means "this save finished". `verify_step(step_dir)` returns why a step cannot be
resumed from (no marker, a missing, truncated or altered file), or None when it is intact.
CRC-32 finds truncation and flipped bytes; it is not a defence against deliberate tampering.
"""
from __future__ import annotations

import json
import os
import zlib
from pathlib import Path

import orbax.checkpoint as ocp

COMPLETE_MARKER = "jaxrl_complete.json"
_CHUNK = 1 << 22


def _crc32(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return crc


def _files(step_dir: Path) -> list[Path]:
    return sorted(p for p in step_dir.rglob("*") if p.is_file() and p.name != COMPLETE_MARKER)


def write_marker(step_dir: str | Path) -> None:
    """Records the size and CRC-32 of each file of `step_dir`, as the step's last file."""
    step_dir = Path(step_dir)
    files = {str(p.relative_to(step_dir)): [p.stat().st_size, _crc32(p)] for p in _files(step_dir)}
    tmp = step_dir / f".{COMPLETE_MARKER}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump({"files": files}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, step_dir / COMPLETE_MARKER)


def has_marker(step_dir: str | Path) -> bool:
    return (Path(step_dir) / COMPLETE_MARKER).is_file()


def verify_step(step_dir: str | Path) -> str | None:
    """None if `step_dir` is a finished, intact checkpoint step; else the reason it is not."""
    step_dir = Path(step_dir)
    if not step_dir.is_dir():
        return "not a directory"
    if not (step_dir / "state").is_dir() or not ocp.step.is_checkpoint_finalized(step_dir):
        return "incomplete: the save was interrupted before orbax finalised it"
    marker = step_dir / COMPLETE_MARKER
    if not marker.is_file():
        return f"incomplete: no {COMPLETE_MARKER} (written last by every finished save)"
    try:
        files = json.loads(marker.read_text(encoding="utf-8"))["files"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"{marker} is unreadable ({type(e).__name__}: {e})"
    for rel, (size, crc) in sorted(files.items()):
        path = step_dir / rel
        if not path.is_file():
            return f"file {rel} is missing"
        actual = path.stat().st_size
        if actual != size:
            return f"file {rel} has {actual} bytes, {size} were written (truncated or overwritten)"
        if _crc32(path) != crc:
            return f"file {rel} fails its CRC-32 check (corrupted bytes)"
    return None
