"""Benchmark output: one JSON object per result on stdout, and the list so far in a file."""
from __future__ import annotations

import json


class JsonReport:
    """`add(record)` prints the record as one JSON line and, when `out` is set, rewrites `out`
    with every record so far (a JSON list), so a run cut short still leaves its results."""

    def __init__(self, out: str = ""):
        self.out = out
        self.records: list[dict] = []

    def add(self, record: dict) -> dict:
        print(json.dumps(record), flush=True)
        self.records.append(record)
        if self.out:
            with open(self.out, "w") as f:
                json.dump(self.records, f, indent=1)
        return record


def perfetto_trace(fn, dest: str):
    """Runs `fn()` under `jax.profiler` and copies its perfetto trace (`*.json.gz`, read by
    `scripts/trace_summary.py` or ui.perfetto.dev) to `dest`. Returns what `fn` returns."""
    import glob
    import os
    import shutil
    import tempfile

    import jax

    with tempfile.TemporaryDirectory() as tmp:
        with jax.profiler.trace(tmp, create_perfetto_trace=True):
            result = fn()
        found = sorted(glob.glob(f"{tmp}/**/perfetto_trace.json.gz", recursive=True)
                       or glob.glob(f"{tmp}/**/*.trace.json.gz", recursive=True))
        if not found:
            raise RuntimeError(f"jax.profiler wrote no perfetto trace under {tmp}")
        os.makedirs(os.path.dirname(dest) or ".", exist_ok=True)
        shutil.copy(found[-1], dest)
    return result
