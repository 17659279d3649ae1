"""Policy losses (verl's ``POLICY_LOSS_REGISTRY``) as pure, differentiable JAX functions.

Every loss has the signature::

    fn(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", *,
       rollout_is_weights=None, global_batch_size=None, global_token_count=None,
       global_row_count=None, loss_scale_factor=None, **hyper) -> (loss, metrics)

Shapes ``[b, t]``; ``loss`` is a scalar to minimise; ``metrics`` always holds
``pg_clipfrac``, ``ppo_kl`` and ``pg_clipfrac_lower`` (0 where a loss has no such notion), so
every loss returns the same pytree under jit. ``hyper`` uses verl's actor config names
(``clip_ratio``, ``clip_ratio_low``, ``clip_ratio_high``, ``clip_ratio_c``, ``tau_pos``,
``tau_neg``); a loss ignores the names that belong to other losses, and an unknown name is a
``TypeError``. ``rollout_is_weights`` (treated as constants) multiply the per-token loss.
``global_*`` are passed to ``agg_loss`` (see ``agg_loss_terms`` for exact accumulation);
``global_row_count`` (all rows of the mini-batch, empty ones included) is for losses that
average over every row (``geo_mean``); the others ignore it.
"""
from __future__ import annotations

import functools
import inspect
from typing import Callable

import jax
import jax.numpy as jnp

from jaxrl_llm.algos import _masked as M
from jaxrl_llm.algos._aggregation import agg_loss
from jaxrl_llm.algos._registry import lookup, register

POLICY_LOSSES: dict[str, Callable] = {}
ACTOR_HYPER_NAMES = frozenset(
    {"clip_ratio", "clip_ratio_low", "clip_ratio_high", "clip_ratio_c", "tau_pos", "tau_neg"})
_COMMON = ("rollout_is_weights", "global_batch_size", "global_token_count", "global_row_count",
           "loss_scale_factor")


def get_policy_loss(name: str) -> Callable:
    """The policy loss registered as ``name`` (raises listing valid names when unknown)."""
    return lookup(POLICY_LOSSES, name, "policy loss")


def _policy_loss(name: str):
    """Registers a jitted loss; the wrapper drops hyper-parameters of other losses."""

    def deco(fn):
        own = set(inspect.signature(fn).parameters)
        jitted = jax.jit(fn, static_argnames="loss_agg_mode")

        @functools.wraps(fn)
        def wrapper(old_log_prob, log_prob, advantages, response_mask,
                    loss_agg_mode="token-mean", **kwargs):
            unknown = set(kwargs) - own - ACTOR_HYPER_NAMES - set(_COMMON)
            if unknown:
                raise TypeError(f"policy loss {name!r} got unknown keyword(s) {sorted(unknown)};"
                                f" valid hyper-parameters: {sorted(ACTOR_HYPER_NAMES)}.")
            kept = {k: v for k, v in kwargs.items() if k in own}
            clip_c = kept.get("clip_ratio_c")
            if isinstance(clip_c, (int, float)) and clip_c <= 1.0:
                raise ValueError(f"clip_ratio_c must be > 1.0 for dual-clip PPO, got {clip_c}.")
            return jitted(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, **kept)

        return register(POLICY_LOSSES, name)(wrapper)

    return deco


def _clip_range(clip_ratio, clip_ratio_low, clip_ratio_high):
    low = clip_ratio if clip_ratio_low is None else clip_ratio_low
    high = clip_ratio if clip_ratio_high is None else clip_ratio_high
    return low, high


def _finish(pg_losses, response_mask, loss_agg_mode, rollout_is_weights, agg_kw, metrics):
    if rollout_is_weights is not None:
        pg_losses = pg_losses * jax.lax.stop_gradient(rollout_is_weights)
    loss = agg_loss(pg_losses, response_mask, loss_agg_mode, **agg_kw)
    zero = jnp.zeros((), loss.dtype)
    out = {"pg_clipfrac": zero, "ppo_kl": zero, "pg_clipfrac_lower": zero}
    out.update({k: jax.lax.stop_gradient(v) for k, v in metrics.items()})
    return loss, out


def _agg_kw(global_batch_size, global_token_count, loss_scale_factor):
    return dict(global_batch_size=global_batch_size, global_token_count=global_token_count,
                loss_scale_factor=loss_scale_factor)


@_policy_loss("vanilla")
def vanilla(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", *,
            clip_ratio=0.2, clip_ratio_low=None, clip_ratio_high=None, clip_ratio_c=3.0,
            rollout_is_weights=None, global_batch_size=None, global_token_count=None,
            loss_scale_factor=None):
    """PPO clip with clip-higher (``clip_ratio_low/high``) and dual-clip (``clip_ratio_c``).

    r = exp(clip(logp - old, -20, 20)); L = max(-A r, -A clip(r, 1-lo, 1+hi)); for A < 0 the
    loss is further capped at ``-A * clip_ratio_c``.
    """
    low, high = _clip_range(clip_ratio, clip_ratio_low, clip_ratio_high)
    neg_kl = jnp.clip(log_prob - old_log_prob, -20.0, 20.0)
    ratio = jnp.exp(neg_kl)
    loss1 = -advantages * ratio
    loss2 = -advantages * jnp.clip(ratio, 1 - low, 1 + high)
    clipped = jnp.maximum(loss1, loss2)
    loss3 = -advantages * clip_ratio_c
    pg_losses = jnp.where(advantages < 0, jnp.minimum(loss3, clipped), clipped)
    metrics = {
        "pg_clipfrac": M.masked_mean((loss2 > loss1).astype(ratio.dtype), response_mask),
        "ppo_kl": M.masked_mean(-neg_kl, response_mask),
        "pg_clipfrac_lower": M.masked_mean(
            ((clipped > loss3) & (advantages < 0)).astype(ratio.dtype), response_mask),
    }
    return _finish(pg_losses, response_mask, loss_agg_mode, rollout_is_weights,
                   _agg_kw(global_batch_size, global_token_count, loss_scale_factor), metrics)


@_policy_loss("gspo")
def gspo(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="seq-mean-token-mean",
         *, clip_ratio=0.2, clip_ratio_low=None, clip_ratio_high=None, rollout_is_weights=None,
         global_batch_size=None, global_token_count=None, loss_scale_factor=None):
    """GSPO: sequence-level ratio s_i = exp(mean_t(logp - old)), clipped PPO-style per token.

    Token ratio = sg[s_i] * pi / sg[pi] (log clamped at 10), so the value is s_i while the
    gradient flows through each token. Always aggregated as ``seq-mean-token-mean`` (verl),
    whatever ``loss_agg_mode`` says.
    """
    del loss_agg_mode
    low, high = _clip_range(clip_ratio, clip_ratio_low, clip_ratio_high)
    mask = response_mask.astype(log_prob.dtype)
    neg_kl = log_prob - old_log_prob
    seq_neg_kl = M.masked_sum(neg_kl, mask, axis=-1) / jnp.maximum(mask.sum(-1), 1.0)
    sg = jax.lax.stop_gradient
    log_ratio = log_prob - sg(log_prob) + sg(seq_neg_kl)[:, None]
    ratio = jnp.exp(jnp.minimum(log_ratio, 10.0))
    loss1 = -advantages * ratio
    loss2 = -advantages * jnp.clip(ratio, 1 - low, 1 + high)
    metrics = {
        "pg_clipfrac": M.masked_mean((loss2 > loss1).astype(ratio.dtype), response_mask),
        "ppo_kl": M.masked_mean(-neg_kl, response_mask),
    }
    return _finish(jnp.maximum(loss1, loss2), response_mask, "seq-mean-token-mean",
                   rollout_is_weights,
                   _agg_kw(global_batch_size, global_token_count, loss_scale_factor), metrics)


@_policy_loss("sapo")
def sapo(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="seq-mean-token-mean",
         *, tau_pos=1.0, tau_neg=1.05, rollout_is_weights=None, global_batch_size=None,
         global_token_count=None, loss_scale_factor=None):
    """SAPO soft gate: L = -A * sigmoid(tau (r - 1)) * 4 / tau, tau = tau_pos if A > 0 else tau_neg.

    r = exp(clip(logp - old, -20, 20)). Always aggregated as ``seq-mean-token-mean`` (verl).
    """
    del loss_agg_mode
    neg_kl = jnp.clip(log_prob - old_log_prob, -20.0, 20.0)
    ratio = jnp.exp(neg_kl)
    tau = jnp.where(advantages > 0, tau_pos, tau_neg).astype(ratio.dtype)
    gates = jax.nn.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)
    metrics = {"ppo_kl": M.masked_mean(-neg_kl, response_mask)}
    return _finish(-gates * advantages, response_mask, "seq-mean-token-mean", rollout_is_weights,
                   _agg_kw(global_batch_size, global_token_count, loss_scale_factor), metrics)


@_policy_loss("gpg")
def gpg(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", *,
        rollout_is_weights=None, global_batch_size=None, global_token_count=None,
        loss_scale_factor=None):
    """GPG / plain policy gradient: L = -logp * A (no ratio, no clipping)."""
    metrics = {"ppo_kl": M.masked_mean(old_log_prob - log_prob, response_mask)}
    return _finish(-log_prob * advantages, response_mask, loss_agg_mode, rollout_is_weights,
                   _agg_kw(global_batch_size, global_token_count, loss_scale_factor), metrics)


@_policy_loss("cispo")
def cispo(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", *,
          clip_ratio=0.2, clip_ratio_low=None, clip_ratio_high=None, rollout_is_weights=None,
          global_batch_size=None, global_token_count=None, loss_scale_factor=None):
    """CISPO: L = -sg[clip(r, 1-lo, 1+hi)] * A * logp; every token keeps its gradient."""
    low, high = _clip_range(clip_ratio, clip_ratio_low, clip_ratio_high)
    neg_kl = jnp.clip(log_prob - old_log_prob, -20.0, 20.0)
    ratio = jnp.exp(neg_kl)
    clipped = jnp.clip(ratio, 1 - low, 1 + high)
    pg_losses = -jax.lax.stop_gradient(clipped) * advantages * log_prob
    metrics = {
        "pg_clipfrac": M.masked_mean((ratio != clipped).astype(ratio.dtype), response_mask),
        "ppo_kl": M.masked_mean(-neg_kl, response_mask),
    }
    return _finish(pg_losses, response_mask, loss_agg_mode, rollout_is_weights,
                   _agg_kw(global_batch_size, global_token_count, loss_scale_factor), metrics)


@_policy_loss("geo_mean")
def geo_mean(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", *,
             clip_ratio=0.2, clip_ratio_low=None, clip_ratio_high=None, rollout_is_weights=None,
             global_batch_size=None, global_token_count=None, global_row_count=None,
             loss_scale_factor=None):
    """GMPO: geometric-mean ratio per sequence with token-level, sign-aware clipping.

    d_t = logp - old, clipped to [-lo, hi] on the side that helps A; ratio_i =
    exp(mean_t d_t); L_i = -mean_t(A) * ratio_i; loss = mean over rows (verl: ``torch.mean``
    over all ``b`` rows, empty rows included; ``loss_agg_mode`` is unused). With
    ``global_row_count`` (the mini-batch's row count, empty rows included) the row sum is
    divided by it instead, so micro-batch losses add up to the mini-batch loss.
    ``global_batch_size`` (non-empty rows) is ignored: it is the wrong count here.
    ``rollout_is_weights`` enter as their per-row geometric mean.
    """
    del loss_agg_mode, global_batch_size, global_token_count, loss_scale_factor
    low, high = _clip_range(clip_ratio, clip_ratio_low, clip_ratio_high)
    mask = response_mask.astype(log_prob.dtype)
    neg_kl = log_prob - old_log_prob
    sign = jnp.sign(advantages)
    neg_kl_clamp = jnp.clip(neg_kl, -low, high)
    neg_kl_min = sign * jnp.minimum(sign * neg_kl, sign * neg_kl_clamp)
    n = mask.sum(-1) + 1e-8
    ratio = jnp.exp(M.masked_sum(neg_kl_min, mask, axis=-1) / n)
    seq_adv = M.masked_sum(advantages, mask, axis=-1) / n
    pg_losses = -seq_adv * ratio
    if rollout_is_weights is not None:
        log_w = jnp.log(jax.lax.stop_gradient(rollout_is_weights) + 1e-10)
        pg_losses = pg_losses * jnp.exp(M.masked_sum(log_w, mask, axis=-1) / n)
    den = pg_losses.shape[0] if global_row_count is None else global_row_count
    loss = pg_losses.sum() / den
    clipped = neg_kl != neg_kl_clamp
    metrics = {
        "pg_clipfrac": M.masked_mean((clipped & (advantages > 0)).astype(mask.dtype), mask),
        "ppo_kl": M.masked_mean(-neg_kl, mask),
        "pg_clipfrac_lower": M.masked_mean((clipped & (advantages < 0)).astype(mask.dtype), mask),
    }
    return loss, {k: jax.lax.stop_gradient(v) for k, v in metrics.items()}
