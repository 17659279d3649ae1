"""Compact console table for one step's metrics, grouped by name prefix (`actor/`, `perf/`...).

Printed with `tqdm.write` so it does not break a progress bar.
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


def write_console(text: str) -> None:
    from tqdm import tqdm
    tqdm.write(text)
