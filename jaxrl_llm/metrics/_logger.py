"""`MetricsLogger`: one call per training step → console line, metrics.jsonl, TensorBoard.

A metric has one name everywhere: the console, metrics.jsonl and the TensorBoard tag.

JSON has no NaN or infinity, so non-finite floats are written as the strings "NaN",
"Infinity" and "-Infinity"; `read_jsonl` turns them back into floats. Only process 0 writes.
A full disk is `DiskFullError` naming the file (jaxrl_llm/_disk.py); `close` after one does not
raise again.
"""
from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np

from jaxrl_llm._disk import DiskFullError, disk_full_guard
from jaxrl_llm.metrics._console import format_summary, format_table, write_console

STEP_KEY = "training/global_step"
_BACKENDS = ("console", "jsonl", "tensorboard")
_NONFINITE = {"NaN": float("nan"), "Infinity": float("inf"), "-Infinity": float("-inf")}


def _to_scalar(key: str, value: Any) -> int | float:
    """Python int/float from a Python, numpy or JAX scalar; ValueError naming the key otherwise."""
    arr = np.asarray(value)
    if arr.size != 1 or not (np.issubdtype(arr.dtype, np.number) or arr.dtype == bool):
        raise ValueError(f"MetricsLogger.log: metric {key!r} must be a numeric scalar, got "
                         f"{type(value).__name__} with shape {arr.shape} and dtype {arr.dtype}; "
                         "reduce it (e.g. .mean()) before logging.")
    item = arr.reshape(()).item()
    return int(item) if isinstance(item, (bool, int)) else float(item)


def _json_safe(x: int | float) -> int | float | str:
    if isinstance(x, float) and not math.isfinite(x):
        return "NaN" if math.isnan(x) else ("Infinity" if x > 0 else "-Infinity")
    return x


class MetricsLogger:
    """Write step metrics to `<run_dir>/metrics.jsonl`, `<run_dir>/tensorboard/` and the console.

    The console gets one summary line per step (`format_summary`); with the console backend the
    whole step, as a table grouped by prefix, goes to `<run_dir>/metrics.log`.

    Args:
      run_dir: output folder (created when enabled).
      backends: any of "console", "jsonl", "tensorboard".
      enable: False (or a process index other than 0) turns every backend off; no files.
      console_every: print the console line every this-many `log` calls.
      run_name: written to TensorBoard as the text `run/name` (the trainer passes
        `trainer.project_name/trainer.experiment_name`), so runs can be told apart there.
    """

    def __init__(self, run_dir: str | Path, *, backends: Iterable[str] = _BACKENDS,
                 enable: bool = True, console_every: int = 1, run_name: str = ""):
        self.backends = tuple(backends)
        unknown = sorted(set(self.backends) - set(_BACKENDS))
        if unknown:
            raise ValueError(
                f"MetricsLogger: unknown backend(s) {unknown}; choose from {_BACKENDS}.")
        if console_every < 1:
            raise ValueError(f"MetricsLogger: console_every must be >= 1, got {console_every}.")
        self.run_dir = Path(run_dir)
        self.enable = bool(enable) and jax.process_index() == 0
        self.console_every = console_every
        self.run_name = run_name
        self._calls = 0
        self._jsonl = None
        self._tb = None
        if self.enable:
            self._open()

    @property
    def jsonl_path(self) -> Path:
        return self.run_dir / "metrics.jsonl"

    def _open(self, purge_step: int | None = None) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if "jsonl" in self.backends:
            self._jsonl = open(self.jsonl_path, "a", encoding="utf-8")  # append: resumed runs
        if "tensorboard" in self.backends:
            from tensorboardX import SummaryWriter
            self._tb = SummaryWriter(logdir=str(self.run_dir / "tensorboard"), purge_step=purge_step)
            if self.run_name:
                self._tb.add_text("run/name", self.run_name, global_step=0)

    def rewind(self, step: int) -> None:
        """Forgets every record after `step`, as a run resumed from step `step` must: rows of
        metrics.jsonl and val_generations.jsonl with a larger step (and a torn last line) are
        dropped, and TensorBoard is told to discard events from `step + 1` on (`purge_step`).
        The resumed run's files then equal an uninterrupted run's. `step=-1` empties them (a run
        that starts from scratch)."""
        if not self.enable:
            return
        self.close()
        if "jsonl" in self.backends:
            for path in (self.jsonl_path, self.generations_path):
                with disk_full_guard(path, "the rewound metrics"):
                    _truncate_jsonl(path, step)
        self._open(purge_step=step + 1)

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        """Record `metrics` (numeric scalars keyed by verl-style names) at `step`."""
        if not self.enable:
            return
        values = {key: _to_scalar(key, value) for key, value in metrics.items()}
        if self._jsonl is not None:
            record = {STEP_KEY: int(step), **{k: _json_safe(v) for k, v in values.items()}}
            with disk_full_guard(self.jsonl_path, f"the metrics of step {step}"):
                self._jsonl.write(json.dumps(record, allow_nan=False) + "\n")
                self._jsonl.flush()
        if self._tb is not None:
            from tensorboardX.proto.summary_pb2 import Summary

            # the tag is the printed name, 'mean@1' included: tensorboardX's add_scalar would turn
            # characters outside [A-Za-z0-9_./-] into '_', so the summary is written as is
            summary = Summary(value=[Summary.Value(tag=key, simple_value=float(value))
                                     for key, value in values.items()])
            with disk_full_guard(self.run_dir / "tensorboard", f"the TensorBoard events of step {step}"):
                self._tb.file_writer.add_summary(summary, global_step=int(step))
                self._tb.flush()
        if "console" in self.backends and self._calls % self.console_every == 0:
            write_console(format_summary(values, int(step)))
            with disk_full_guard(self.run_dir / "metrics.log", f"the metrics of step {step}"), \
                    open(self.run_dir / "metrics.log", "a", encoding="utf-8") as f:
                f.write(format_table(values, int(step)) + "\n")
        self._calls += 1

    @property
    def generations_path(self) -> Path:
        return self.run_dir / "val_generations.jsonl"

    def log_generations(self, samples: list[Mapping[str, Any]], step: int) -> None:
        """Validation samples (prompt, response, score, ground truth, ...; an agent sample's
        `turns`, [{role, content}, ...]): one JSON row per sample in
        `<run_dir>/val_generations.jsonl` and a markdown table as TensorBoard text
        `val/generations` (verl's `log_val_generations`; turns there as `role: content` lines)."""
        if not self.enable or not samples:
            return
        if "jsonl" in self.backends:
            with disk_full_guard(self.generations_path, f"the validation samples of step {step}"), \
                    open(self.generations_path, "a", encoding="utf-8") as f:
                for s in samples:
                    f.write(json.dumps({STEP_KEY: int(step), **s}, default=str) + "\n")
        if self._tb is not None:
            cols = list(dict.fromkeys(c for s in samples for c in s))
            cell = lambda v: _cell_text(v).replace("|", "\\|").replace("\n", "<br>")  # noqa: E731
            table = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
            table += ["| " + " | ".join(cell(s.get(c, "")) for c in cols) + " |" for s in samples]
            self._tb.add_text("val/generations", "\n".join(table), global_step=int(step))
            self._tb.flush()

    def close(self) -> None:
        """Flush and close the files; safe to call twice. A full disk (already reported by the
        write that hit it) does not raise again here: the lines that did not fit are dropped."""
        jsonl, tb, self._jsonl, self._tb = self._jsonl, self._tb, None, None
        for f in (jsonl, tb):
            if f is None:
                continue
            try:
                with disk_full_guard(self.run_dir, "the metric files"):
                    f.close()
            except DiskFullError:
                pass

    def __enter__(self) -> "MetricsLogger":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _cell_text(value: Any) -> str:
    """A table cell: a list of turns as one `role: content` line each, anything else as str."""
    if isinstance(value, list) and value and all(isinstance(t, Mapping) and "role" in t for t in value):
        return "\n".join(f"{t['role']}: {t.get('content', '')}" for t in value)
    return str(value)


def _truncate_jsonl(path: Path, step: int) -> None:
    """Keeps the rows of a jsonl file whose STEP_KEY is <= `step` (unparsable lines dropped)."""
    if not path.is_file():
        return
    kept = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                if int(json.loads(line)[STEP_KEY]) <= step:
                    kept.append(line if line.endswith("\n") else line + "\n")
            except (ValueError, KeyError, TypeError):
                continue  # a line cut short by a kill
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(kept), encoding="utf-8")
    tmp.replace(path)


def _decode(value: Any) -> Any:
    return _NONFINITE.get(value, value) if isinstance(value, str) else value


def read_jsonl(path: str | Path) -> list[dict]:
    """Records of a metrics.jsonl file, with "NaN"/"Infinity"/"-Infinity" back as floats."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"read_jsonl: {path} does not exist; pass a run's metrics.jsonl.")
    with open(path, encoding="utf-8") as f:
        return [{k: _decode(v) for k, v in json.loads(line).items()} for line in f if line.strip()]
