"""JAX's persistent compilation cache, written atomically.

JAX's file cache (`jax._src.lru_cache.LRUCache.put`, jax 0.10-0.11) writes an entry in place
(`Path.write_bytes`) and, with eviction off (the default), takes no lock, while `get` reads any
file that exists. A process or thread that reads an entry another one is still writing gets a
truncated executable, which JAX fails to deserialize or which can crash the process in native
code: processes of a multi-host run sharing a folder, Ray workers and replica children can race
like that. Here `put` writes to a temporary file in the same
folder and renames it into place (atomic on POSIX), so a reader sees a whole entry or none. Applied
once, when `jaxrl_llm.models` is imported; a JAX without that class or method is left alone.
"""
from __future__ import annotations

import os
import tempfile


def _atomic_put(self, key: str, value: bytes) -> None:
    if not key:
        raise ValueError("key cannot be empty")
    if self.eviction_enabled:  # JAX's own path: it locks around the write and evicts
        return _original_put(self, key, value)
    path = self.path / f"{key}-cache"
    if os.path.exists(path):
        return
    fd, tmp = tempfile.mkstemp(dir=str(self.path), prefix=f".{key[:40]}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(value)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


_original_put = None


def install() -> bool:
    """Make the JAX file cache's `put` atomic; True when patched (idempotent)."""
    global _original_put
    try:
        from jax._src import lru_cache
    except ImportError:
        return False
    cls = getattr(lru_cache, "LRUCache", None)
    if cls is None or not hasattr(cls, "put") or getattr(lru_cache, "_CACHE_SUFFIX", None) != "-cache":
        return False
    if cls.put is not _atomic_put:
        _original_put = cls.put
        cls.put = _atomic_put
    return True
