"""jaxrl_llm.models makes JAX's persistent compilation cache write atomically: a reader never sees
a partly written entry (a truncated executable can crash the reader in native code)."""
import os

from jax._src import lru_cache

import jaxrl_llm.models  # noqa: F401 - installs the atomic put
from jaxrl_llm.models import _jax_cache


def test_put_is_atomic_and_get_reads_whole_entries(tmp_path, monkeypatch):
    assert lru_cache.LRUCache.put is _jax_cache._atomic_put
    cache = lru_cache.LRUCache(str(tmp_path), max_size=-1)
    final = tmp_path / "k1-cache"
    seen_during_write = []
    real_fdopen = os.fdopen

    def spying_fdopen(fd, mode):
        f = real_fdopen(fd, mode)
        real_write = f.write

        def write(data):
            seen_during_write.append(final.exists())  # the entry's own path, mid-write
            return real_write(data)
        f.write = write
        return f

    monkeypatch.setattr(_jax_cache.os, "fdopen", spying_fdopen)
    cache.put("k1", b"executable bytes")
    assert seen_during_write == [False]  # JAX's in-place write would have created it first
    assert cache.get("k1") == b"executable bytes"
    cache.put("k1", b"other")  # an existing entry is kept, as JAX does
    assert cache.get("k1") == b"executable bytes"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["k1-cache"]  # no temporary file left
