"""One step's metrics as text: a one-line summary for the console (printed with `tqdm.write`
so it does not break a progress bar) and a table grouped by name prefix (`actor/`, `perf/`...)
for the run folder's metrics.log.
"""
from __future__ import annotations

from collections.abc import Mapping

_PER_LINE = 4


def _fmt(value: int | float) -> str:
    if isinstance(value, int):
        return str(value)
    return f"{value:.4g}"


def _group(metrics: Mapping[str, int | float]) -> dict[str, list[tuple[str, int | float]]]:
    groups: dict[str, list[tuple[str, int | float]]] = {}
    for key in sorted(metrics):
        prefix, _, rest = key.partition("/")
        groups.setdefault(prefix if rest else "other", []).append((rest or key, metrics[key]))
    return groups


def format_table(metrics: Mapping[str, int | float], step: int) -> str:
    """Multi-line text: a step header, then per prefix rows of `name=value` cells."""
    groups = _group(metrics)
    width = max((len(g) for g in groups), default=0)
    lines = [f"── step {step} " + "─" * 40]
    for prefix, items in groups.items():
        cells = [f"{name}={_fmt(value)}" for name, value in items]
        for i in range(0, len(cells), _PER_LINE):
            label = prefix if i == 0 else ""
            lines.append(f"{label:<{width}}  " + "  ".join(cells[i:i + _PER_LINE]))
    return "\n".join(lines)


_SUMMARY = (("critic/score/mean", "score"), ("actor/pg_loss", "pg_loss"), ("actor/entropy", "entropy"),
            ("response_length/mean", "resp_len"), ("timing_s/step", "step_s"))


def format_summary(metrics: Mapping[str, int | float], step: int) -> str:
    """One line: the step, score, loss, entropy, response length, step time and every
    `val-core/` metric that is present."""
    cells = [f"{short}={_fmt(metrics[key])}" for key, short in _SUMMARY if key in metrics]
    cells += [f"{key}={_fmt(value)}" for key, value in sorted(metrics.items()) if key.startswith("val-core/")]
    return f"step {step}: " + "  ".join(cells)


def write_console(text: str) -> None:
    from tqdm import tqdm
    tqdm.write(text)
