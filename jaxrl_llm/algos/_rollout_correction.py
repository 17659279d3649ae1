"""Rollout correction: truncated importance sampling and rejection masks for the gap between
the rollout engine's policy (e.g. bf16 serving) and the trainer's policy (verl's
``rollout_corr_helper``). Everything is jit-able; metric dicts hold scalar arrays.

``log_ratio = old_log_prob - rollout_log_prob`` (training over rollout), computed per token.
Exponentials are taken of log-ratios clamped to +-20 (verl's ``SAFETY_BOUND``).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxrl_llm.algos import _masked as M
from jaxrl_llm.algos._registry import check_choice

SAFETY_BOUND = 20.0
ROLLOUT_IS_LEVELS = ("token", "sequence")
ROLLOUT_RS_LEVELS = ("token", "sequence", "geometric")


def _level_log_ratio(log_ratio, mask, level):
    """Per-token log weight broadcast to [b, t] and the unclamped log ratio for metrics."""
    if level == "token":
        return log_ratio, log_ratio
    if level == "sequence":
        agg = M.masked_sum(log_ratio, mask, axis=-1)[:, None]
    else:  # geometric
        agg = M.masked_mean(log_ratio, mask, axis=-1)[:, None]
    return jnp.broadcast_to(agg, log_ratio.shape), agg


def _weight_metrics(w, log_for_metrics, mask, level, upper, lower, prefix):
    """verl's IS / RS weight statistics (mean, max, min, std, ESS, fractions, per-sequence)."""
    f = mask.astype(w.dtype)
    m = {f"{prefix}_mean": M.masked_mean(w, f)}
    if level == "token":
        m[f"{prefix}_max"] = jnp.max(jnp.where(f > 0, w, -jnp.inf))
        m[f"{prefix}_min"] = jnp.min(jnp.where(f > 0, w, jnp.inf))
        m[f"{prefix}_ratio_fraction_high"] = M.masked_mean((w > upper).astype(w.dtype), f)
        m[f"{prefix}_ratio_fraction_low"] = M.masked_mean((w < lower).astype(w.dtype), f)
    else:
        m[f"{prefix}_max"] = jnp.exp(jnp.minimum(log_for_metrics.max(), SAFETY_BOUND))
        m[f"{prefix}_min"] = jnp.exp(log_for_metrics.min())
        m[f"{prefix}_ratio_fraction_high"] = (log_for_metrics > jnp.log(upper)).mean()
        m[f"{prefix}_ratio_fraction_low"] = (log_for_metrics < jnp.log(lower)).mean()
    wc = jnp.clip(w, lower, upper)
    mean_c = M.masked_mean(wc, f)
    var = M.masked_mean(jnp.square(wc), f) - jnp.square(mean_c)
    m[f"{prefix}_std"] = jnp.where(f.sum() > 1, jnp.sqrt(jnp.maximum(var, 0.0)), 0.0)
    m[f"{prefix}_eff_sample_size"] = 1.0 / M.masked_mean(jnp.square(wc / (mean_c + 1e-8)), f)
    seq = M.masked_mean(w, f, axis=-1)
    m[f"{prefix}_seq_mean"] = seq.mean()
    m[f"{prefix}_seq_std"] = jnp.std(seq, ddof=1) if seq.shape[0] > 1 else jnp.zeros(())
    m[f"{prefix}_seq_max"] = seq.max()
    m[f"{prefix}_seq_min"] = seq.min()
    m[f"{prefix}_seq_max_deviation"] = jnp.abs(seq - 1.0).max()
    m[f"{prefix}_seq_fraction_high"] = (seq > upper).mean()
    m[f"{prefix}_seq_fraction_low"] = (seq < lower).mean()
    return m


@functools.partial(jax.jit, static_argnames=(
    "rollout_is", "rollout_is_threshold", "rollout_is_batch_normalize"))
def rollout_is_weights(old_log_prob, rollout_log_prob, response_mask, *, rollout_is="token",
                       rollout_is_threshold=2.0, rollout_is_batch_normalize=False):
    """Truncated IS weights ``min(pi_train / pi_rollout, threshold)``, per token or sequence.

    Inputs [b, t] -> ``(weights [b, t] (0 on padding, no gradient), metrics)``. ``sequence``
    uses the product of token ratios, broadcast over the row. Metrics (``rollout_is_*``) are
    taken before truncation. ``rollout_is_batch_normalize`` rescales to mean 1 (over tokens,
    or over non-empty sequences).
    """
    check_choice(rollout_is, ROLLOUT_IS_LEVELS, "rollout_is")
    if rollout_is_threshold <= 0:
        raise ValueError(f"rollout_is_threshold must be positive, got {rollout_is_threshold}.")
    mask = response_mask.astype(old_log_prob.dtype)
    log_ratio = old_log_prob - rollout_log_prob
    log_w, log_for_metrics = _level_log_ratio(log_ratio, mask, rollout_is)
    w = jnp.exp(jnp.clip(log_w, -SAFETY_BOUND, SAFETY_BOUND)) * mask
    metrics = _weight_metrics(w, log_for_metrics, mask, rollout_is, rollout_is_threshold,
                              1.0 / rollout_is_threshold, "rollout_is")
    w = jax.lax.stop_gradient(jnp.minimum(w, rollout_is_threshold))
    if rollout_is_batch_normalize:
        if rollout_is == "token":
            mean = M.masked_mean(w, mask)
        else:
            seq_mask = (mask.sum(-1) > 0).astype(w.dtype)
            mean = M.masked_mean(M.masked_mean(w, mask, axis=-1), seq_mask)
        ok = mean > 1e-8
        w = jnp.where(ok, w / jnp.where(ok, mean, 1.0), w)
        metrics["rollout_is_batch_norm_factor"] = jnp.where(ok, mean, 1.0)
    return w, metrics


@functools.partial(jax.jit, static_argnames=(
    "rollout_rs", "rollout_rs_threshold", "rollout_rs_threshold_lower"))
def rollout_rejection_mask(old_log_prob, rollout_log_prob, response_mask, *, rollout_rs="token",
                           rollout_rs_threshold, rollout_rs_threshold_lower=None):
    """Rejection sampling: zero the mask where the (token / sequence / geometric-mean) ratio
    leaves ``[lower, upper]`` (``lower`` defaults to ``1 / upper``).

    Inputs [b, t] -> ``(modified_response_mask [b, t], metrics)`` (``rollout_rs_*``).
    """
    check_choice(rollout_rs, ROLLOUT_RS_LEVELS, "rollout_rs")
    if rollout_rs_threshold is None:
        raise ValueError("rollout_rs_threshold must be provided for rejection sampling.")
    upper = rollout_rs_threshold
    lower = 1.0 / upper if rollout_rs_threshold_lower is None else rollout_rs_threshold_lower
    mask = response_mask.astype(old_log_prob.dtype)
    log_w, log_for_metrics = _level_log_ratio(old_log_prob - rollout_log_prob, mask, rollout_rs)
    w = jnp.exp(jnp.clip(log_w, -SAFETY_BOUND, SAFETY_BOUND))
    keep = ((w >= lower) & (w <= upper)).astype(mask.dtype)
    metrics = _weight_metrics(w, log_for_metrics, mask, rollout_rs, upper, lower, "rollout_rs")
    metrics["rollout_rs_masked_fraction"] = M.masked_mean(1.0 - keep, mask)
    if rollout_rs == "token":
        seq_rejected = M.masked_sum(1.0 - keep, mask, axis=-1) > 0
    else:
        seq_rejected = keep[:, 0] == 0
    metrics["rollout_rs_seq_masked_fraction"] = seq_rejected.astype(mask.dtype).mean()
    return response_mask * keep.astype(response_mask.dtype), metrics


@jax.jit
def rollout_offpolicy_metrics(old_log_prob, rollout_log_prob, response_mask):
    """Mismatch diagnostics: KL (direct and k3), perplexities, log-PPL gaps, chi^2 (token, seq).

    Inputs [b, t] -> dict of scalars with verl's names (``kl``, ``k3_kl``, ``training_ppl``,
    ``rollout_ppl``, ``log_ppl_diff``, ``ppl_ratio``, ``chi2_token``, ``chi2_seq``, …).
    """
    mask = response_mask.astype(old_log_prob.dtype)
    log_ratio = old_log_prob - rollout_log_prob
    mean_train = M.masked_mean(old_log_prob, mask, axis=-1)
    mean_roll = M.masked_mean(rollout_log_prob, mask, axis=-1)
    diff = mean_roll - mean_train
    seq_sum = jnp.clip(M.masked_sum(log_ratio, mask, axis=-1), -SAFETY_BOUND, SAFETY_BOUND)
    rho = jnp.exp(jnp.clip(log_ratio, -SAFETY_BOUND, SAFETY_BOUND))
    return {
        "training_ppl": jnp.exp(-mean_train).mean(),
        "training_log_ppl": (-mean_train).mean(),
        "kl": M.masked_mean(-log_ratio, mask),
        "k3_kl": M.masked_mean(jnp.exp(log_ratio) - log_ratio - 1.0, mask),
        "rollout_ppl": jnp.exp(-mean_roll).mean(),
        "rollout_log_ppl": (-mean_roll).mean(),
        "log_ppl_diff": diff.mean(),
        "log_ppl_abs_diff": jnp.abs(diff).mean(),
        "log_ppl_diff_max": diff.max(),
        "log_ppl_diff_min": diff.min(),
        "ppl_ratio": jnp.exp(diff).mean(),
        "chi2_token": M.masked_mean(jnp.square(rho), mask) - 1.0,
        "chi2_seq": jnp.exp(2.0 * seq_sum).mean() - 1.0,
    }


@functools.partial(jax.jit, static_argnames=(
    "rollout_is", "rollout_is_threshold", "rollout_rs", "rollout_rs_threshold",
    "rollout_rs_threshold_lower", "rollout_token_veto_threshold", "rollout_is_batch_normalize"))
def rollout_correction(old_log_prob, rollout_log_prob, response_mask, *, rollout_is=None,
                       rollout_is_threshold=2.0, rollout_rs=None, rollout_rs_threshold=None,
                       rollout_rs_threshold_lower=None, rollout_token_veto_threshold=None,
                       rollout_is_batch_normalize=False):
    """verl's ``compute_rollout_correction_and_rejection_mask``: IS weights, RS mask and veto.

    Returns ``(weights [b, t] or None, modified_response_mask [b, t], metrics)``; metric names
    carry the ``rollout_corr/`` prefix. The veto drops any sequence holding a token whose
    ratio is below ``rollout_token_veto_threshold``.
    """
    metrics, weights, new_mask = {}, None, response_mask
    if rollout_is is not None and rollout_is_threshold is not None:
        weights, m = rollout_is_weights(
            old_log_prob, rollout_log_prob, response_mask, rollout_is=rollout_is,
            rollout_is_threshold=rollout_is_threshold,
            rollout_is_batch_normalize=rollout_is_batch_normalize)
        metrics.update(m)
    if rollout_rs is not None:
        new_mask, m = rollout_rejection_mask(
            old_log_prob, rollout_log_prob, response_mask, rollout_rs=rollout_rs,
            rollout_rs_threshold=rollout_rs_threshold,
            rollout_rs_threshold_lower=rollout_rs_threshold_lower)
        metrics.update(m)
    new_mask, m = _veto(old_log_prob - rollout_log_prob, response_mask, new_mask,
                        rollout_token_veto_threshold)
    metrics.update(m)
    metrics.update(rollout_offpolicy_metrics(old_log_prob, rollout_log_prob, response_mask))
    return weights, new_mask, {f"rollout_corr/{k}": v for k, v in metrics.items()}


def _veto(log_ratio, response_mask, new_mask, threshold):
    zero = jnp.zeros((), log_ratio.dtype)
    if threshold is None:
        return new_mask, {"rollout_is_veto_fraction": zero,
                          "rollout_is_catastrophic_token_fraction": zero}
    if threshold <= 0:
        raise ValueError(f"rollout_token_veto_threshold must be positive, got {threshold}.")
    bad = (log_ratio < jnp.log(threshold)) & (response_mask != 0)
    has_bad = bad.any(-1, keepdims=True)
    metrics = {"rollout_is_veto_fraction": has_bad.astype(log_ratio.dtype).mean(),
               "rollout_is_catastrophic_token_fraction":
                   M.masked_mean(bad.astype(log_ratio.dtype), response_mask)}
    return new_mask * (~has_bad).astype(new_mask.dtype), metrics
