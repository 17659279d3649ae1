"""Training curves as a PNG: `critic/score/mean` and every `val-core/...` metric against step."""
from __future__ import annotations

from pathlib import Path

from jaxrl_llm.metrics._logger import STEP_KEY, read_jsonl

TRAIN_KEY = "critic/score/mean"
VAL_PREFIX = "val-core/"


def _series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    points = [(r[STEP_KEY], r[key]) for r in records if key in r and STEP_KEY in r]
    return [s for s, _ in points], [float(v) for _, v in points]


def _draw(ax, records: list[dict], keys: list[str], title: str) -> None:
    ax.set_title(title)
    ax.set_xlabel("step")
    drawn = False
    for key in keys:
        steps, values = _series(records, key)
        if steps:
            ax.plot(steps, values, marker="o", markersize=3, label=key)
            drawn = True
    if drawn:
        ax.legend(fontsize=7)
    else:
        ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)


def plot_curves(run_dir_or_jsonl: str | Path, out_png: str | Path) -> Path:
    """Write the score and validation curves of a run (folder or metrics.jsonl) to `out_png`."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    src = Path(run_dir_or_jsonl)
    records = read_jsonl(src / "metrics.jsonl" if src.is_dir() else src)
    val_keys = sorted({k for r in records for k in r if k.startswith(VAL_PREFIX)})
    fig, (train_ax, val_ax) = plt.subplots(1, 2, figsize=(11, 4))
    _draw(train_ax, records, [TRAIN_KEY], "training score")
    _draw(val_ax, records, val_keys, "validation")
    fig.tight_layout()
    out = Path(out_png)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
