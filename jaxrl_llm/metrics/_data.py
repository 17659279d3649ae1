"""Batch statistics with verl's names and semantics (`verl/trainer/ppo/metric_utils.py`).

Inputs are host numpy arrays in verl's batch schema: token fields are [b, t] (t = max response
length), `prompts` is [b, p] (left-padded) and `attention_mask` is [b, p + t].
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

_VF_EPS = 1e-5  # verl adds this to var(returns) in the explained-variance denominator


def _stats(name: str, x: np.ndarray) -> dict[str, float]:
    """`{name}/mean|max|min` of `x`; NaN for an empty selection (e.g. no valid tokens)."""
    if x.size == 0:
        return {f"{name}/mean": float("nan"), f"{name}/max": float("nan"),
                f"{name}/min": float("nan")}
    return {f"{name}/mean": float(np.mean(x)), f"{name}/max": float(np.max(x)),
            f"{name}/min": float(np.min(x))}


def _require(batch: Mapping[str, np.ndarray], *names: str) -> None:
    missing = [n for n in names if n not in batch]
    if missing:
        raise KeyError(f"compute_data_metrics: batch lacks field(s) {missing}; it has "
                       f"{sorted(batch)}. Run the reward/advantage stages before computing "
                       "metrics.")


def _lengths(batch: Mapping[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray, int, int]:
    """(prompt_length [b], response_length [b], max_prompt_len p, max_response_len t)."""
    t = np.shape(batch["responses"])[-1]
    mask = np.asarray(batch["attention_mask"])
    p = mask.shape[-1] - t
    return mask[:, :p].sum(-1).astype(np.float64), mask[:, p:].sum(-1).astype(np.float64), p, t


def _length_stats(name: str, lengths: np.ndarray, max_len: int) -> dict[str, float]:
    out = _stats(name, lengths)
    out[f"{name}/clip_ratio"] = float(np.mean(lengths == max_len))
    return out


def _explained_var(returns: np.ndarray, values: np.ndarray) -> float:
    """verl's `1 - var(returns - values) / (var(returns) + 1e-5)`, unbiased variances."""
    if returns.size < 2:
        return float("nan")
    return float(1.0 - np.var(returns - values, ddof=1) / (np.var(returns, ddof=1) + _VF_EPS))


def compute_data_metrics(batch: Mapping[str, np.ndarray], *, use_critic: bool) -> dict[str, float]:
    """Score / reward / advantage / return / value and length statistics of one batch.

    Sequence scores and rewards are row sums of `token_level_scores` / `token_level_rewards`,
    averaged over non-aborted rows (response length > 0) as verl does (over all rows when every
    row is aborted). Advantages, returns and values are taken over valid tokens
    (`response_mask`). Lengths come from `attention_mask`; a clip ratio is the fraction of rows
    at the maximum length. `response/aborted_ratio` is the fraction of empty responses.
    """
    _require(batch, "token_level_scores", "token_level_rewards", "advantages", "returns",
             "responses", "attention_mask", "response_mask")
    prompt_len, response_len, p, t = _lengths(batch)
    rows = response_len > 0 if np.any(response_len > 0) else np.ones_like(response_len, bool)
    valid = np.asarray(batch["response_mask"]).astype(bool)
    returns = np.asarray(batch["returns"], np.float64)[valid]
    metrics = {
        **_stats("critic/score", np.asarray(batch["token_level_scores"]).sum(-1)[rows]),
        **_stats("critic/rewards", np.asarray(batch["token_level_rewards"]).sum(-1)[rows]),
        **_stats("critic/advantages", np.asarray(batch["advantages"])[valid]),
        **_stats("critic/returns", returns),
    }
    if use_critic:
        _require(batch, "values")
        values = np.asarray(batch["values"], np.float64)[valid]
        metrics.update(_stats("critic/values", values))
        metrics["critic/vf_explained_var"] = _explained_var(returns, values)
    metrics.update(_length_stats("response_length", response_len, t))
    metrics["response/aborted_ratio"] = float(np.mean(response_len == 0))
    metrics.update(_length_stats("prompt_length", prompt_len, p))
    return metrics


def reduce_metrics(metrics: Sequence[Mapping[str, object]]) -> dict[str, float]:
    """Mean per key across micro-batch metric dicts (keys may be absent from some dicts).

    Values may be scalars or arrays; all values of a key are pooled before averaging.
    """
    pooled: dict[str, list[np.ndarray]] = {}
    for entry in metrics:
        for key, value in entry.items():
            pooled.setdefault(key, []).append(np.ravel(np.asarray(value, np.float64)))
    return {key: float(np.mean(np.concatenate(vals))) for key, vals in pooled.items()}
