"""Validation metrics with verl's names and meanings (`process_validation_metrics`).

Every validation prompt gets N responses. Per prompt and per reward variable ("reward" and any
numeric field the scorer returned) this computes `mean@N`, `std@N` and, for n in 2, 4, 8, ...
and N itself, bootstrap estimates over random subsets of n of the N responses (drawn with
replacement, `n_bootstrap` times): `best@n/{mean,std}` (the subset's max), `worst@n/{mean,std}`
(its min) and, when the scorer returned a numeric "pred" field, `maj@n/{mean,std}` (the value of
the subset's most common prediction). Each metric is then averaged over the prompts of a
data source. As in verl, `val-core/` holds the core variable's ("acc" if present, else
"reward") `mean`, `maj` and `best` metrics at the largest n; everything else goes to `val-aux/`.
Generating and scoring the responses is the trainer's job.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping, Sequence

import numpy as np

VOTE_KEY = "pred"


def bootstrap_metric(data: Sequence, subset_size: int, reduce_fns: Sequence[Callable[[list], float]],
                     *, n_bootstrap: int = 1000, seed: int = 42) -> list[tuple[float, float]]:
    """(mean, std) of each `reduce_fn` over `n_bootstrap` subsets of `subset_size` items of
    `data` drawn with replacement."""
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(data), size=(n_bootstrap, subset_size))
    out = []
    for fn in reduce_fns:
        vals = np.asarray([fn([data[i] for i in row]) for row in idx], np.float64)
        out.append((float(vals.mean()), float(vals.std())))
    return out


def majority_value(items: Sequence[tuple[float, float]]) -> float:
    """items = (value, prediction) pairs: the value of the first item whose prediction is the
    most common one (ties go to the prediction seen first)."""
    counts = Counter(pred for _, pred in items)
    top = max(counts.values())
    winner = next(pred for _, pred in items if counts[pred] == top)
    return next(val for val, pred in items if pred == winner)


def _subset_sizes(n: int) -> list[int]:
    sizes, k = [], 2
    while k < n:
        sizes.append(k)
        k *= 2
    return sizes + [n]


def prompt_metrics(values: Sequence[float], preds: Sequence[float] | None, *, n_bootstrap: int,
                   seed: int) -> dict[str, float]:
    """The metrics of one prompt's N values of one variable (see the module docstring)."""
    n = len(values)
    m = {f"mean@{n}": float(np.mean(values))}
    if n == 1:
        return m
    m[f"std@{n}"] = float(np.std(values))
    for k in _subset_sizes(n):
        (bm, bs), (wm, ws) = bootstrap_metric(list(values), k, [max, min], n_bootstrap=n_bootstrap, seed=seed)
        m.update({f"best@{k}/mean": bm, f"best@{k}/std": bs, f"worst@{k}/mean": wm, f"worst@{k}/std": ws})
        if preds is not None:
            [(mm, ms)] = bootstrap_metric(list(zip(values, preds)), k, [majority_value],
                                          n_bootstrap=n_bootstrap, seed=seed)
            m.update({f"maj@{k}/mean": mm, f"maj@{k}/std": ms})
    return m


def process_validation_metrics(data_sources: Sequence[str], prompt_keys: Sequence, infos: Mapping[str, Sequence[float]],
                               *, n_bootstrap: int = 1000, seed: int = 42) -> dict[str, float]:
    """`val-core/<data_source>/<var>/<metric>` and `val-aux/...` from one row per response.

    data_sources, prompt_keys: per response; responses with equal (data_source, prompt_key)
    are the N samples of one prompt. infos: {variable: per-response numeric values}, e.g.
    {"reward": scores, "acc": ...}; a "pred" entry is the vote for `maj@n`, not a variable.
    """
    preds = infos.get(VOTE_KEY)
    groups: dict[str, dict] = {}
    for i, (ds, key) in enumerate(zip(data_sources, prompt_keys)):
        groups.setdefault(ds, {}).setdefault(key, []).append(i)
    out: dict[str, float] = {}
    for ds, prompts in groups.items():
        per_var: dict[str, dict[str, list[float]]] = {}
        for rows in prompts.values():
            vote = None if preds is None else [float(preds[i]) for i in rows]
            for var, vals in infos.items():
                if var == VOTE_KEY:
                    continue
                pm = prompt_metrics([float(vals[i]) for i in rows], vote, n_bootstrap=n_bootstrap, seed=seed)
                for name, v in pm.items():
                    per_var.setdefault(var, {}).setdefault(name, []).append(v)
        core = "acc" if "acc" in per_var else "reward"
        for var, metric_vals in per_var.items():
            n_max = max(int(name.split("@")[-1].split("/")[0]) for name in metric_vals)
            for name, vals in metric_vals.items():
                is_core = (var == core and name.startswith(("mean", "maj", "best"))
                           and name.split("/")[0].endswith(f"@{n_max}"))
                out[f"{'val-core' if is_core else 'val-aux'}/{ds}/{var}/{name}"] = float(np.mean(vals))
    return out
