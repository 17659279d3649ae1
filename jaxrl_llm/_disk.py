"""Disk full (ENOSPC / EDQUOT) as one clear error instead of a cascade of tracebacks.

Writers of run files (checkpoints, metric logs, exports) wrap their writes in
`disk_full_guard(path, what)`: a disk-full failure inside becomes `DiskFullError`, whose message
is one line naming what could not be written, where, and what to do. `as_disk_full(exc)` finds
one in an exception from anywhere (a chained cause, a worker's or a Ray actor's error text), so
the trainer can stop the run with that line. Other errors pass through untouched.
"""
from __future__ import annotations

import errno
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

_CODES = (errno.ENOSPC, errno.EDQUOT)
_TEXTS = ("No space left on device", "Disk quota exceeded")
_LINE = re.compile(r"disk full: [^\n]*")


class DiskFullError(OSError):
    """A run file could not be written because its disk (or quota) is full. `str(e)` is one line;
    `e.path` is where (None if unknown)."""

    def __init__(self, message: str, path: str | Path | None = None):
        super().__init__(message)  # one argument: str() is the message as it is
        self.path = None if path is None else str(path)


def _chain(exc: BaseException | None) -> Iterator[BaseException]:
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def as_disk_full(exc: BaseException, path: str | Path | None = None,
                 what: str = "a run file") -> DiskFullError | None:
    """The `DiskFullError` that `exc` is, holds or reports (its chain, or the text of a worker's
    error); a new one for `what` at `path` when `exc` is a bare disk-full failure; else None."""
    for e in _chain(exc):
        if isinstance(e, DiskFullError):
            # Ray re-raises a worker's error as a subclass of it whose text is the whole
            # remote traceback: keep the one line
            found = _LINE.search(str(e))
            return e if "\n" not in str(e) or not found else DiskFullError(found.group(0), e.path)
    for e in _chain(exc):
        found = _LINE.search(str(e))
        if found:  # a DiskFullError raised in a worker, reported as text
            return DiskFullError(found.group(0).rstrip(" .'\")"), path)
    for e in _chain(exc):
        if (isinstance(e, OSError) and e.errno in _CODES) or any(t in str(e) for t in _TEXTS):
            where = path if path is not None else getattr(e, "filename", None)
            return disk_full_error(where, what)
    return None


def disk_full_error(path: str | Path | None, what: str) -> DiskFullError:
    where = f" to {path}" if path is not None else ""
    return DiskFullError(
        f"disk full: {what} could not be written{where} (no space left on device). The run "
        "stopped; what was saved before is kept. Free space (or point trainer.default_local_dir "
        "at another disk) and run the same command again: it resumes from the newest checkpoint",
        path)


@contextmanager
def disk_full_guard(path: str | Path, what: str) -> Iterator[None]:
    """Turns a disk-full failure of the writes inside into `DiskFullError` naming `what` and
    `path` (raised without the chained traceback); other exceptions pass unchanged."""
    try:
        yield
    except DiskFullError:
        raise
    except Exception as e:  # noqa: BLE001 - only disk-full failures are translated
        full = as_disk_full(e, path, what)
        if full is None:
            raise
        raise full from None
