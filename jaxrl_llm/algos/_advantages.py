"""Advantage estimators: verl's ``core_algos`` estimators as pure, jit-able JAX functions.

Every estimator returns ``(advantages, returns)``, both ``[b, t]``. Argument names follow
verl, except verl's ``index`` (uid strings) is ``group_ids: int[b]`` here: arbitrary integer
labels, not necessarily contiguous, sorted or small. Grouping uses segment ops, so there is
no Python loop over rows. verl's quirks are kept on purpose (see each docstring): same names,
same numbers.

Callers that pick an estimator by name use ``compute_advantage(name, **inputs)``: one keyword
signature (``ADV_INPUTS``) for every estimator, each taking the inputs it declares. Registering
an estimator with a required argument outside ``ADV_INPUTS`` fails at import, so no registered
estimator can lack a way to be called.
"""
from __future__ import annotations

import functools
import inspect
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_llm.algos import _masked as M
from jaxrl_llm.algos._registry import lookup, register

ADV_ESTIMATORS: dict[str, Callable] = {}
# What a caller may hand ``compute_advantage``: batch fields ([b, t] or [b]) and scalars.
ADV_INPUTS = ("token_level_rewards", "response_mask", "group_ids", "values", "reward_baselines",
              "gamma", "lam", "epsilon", "norm_adv_by_std_in_grpo")


def get_adv_estimator(name: str) -> Callable:
    """The estimator registered as ``name`` (raises listing valid names when unknown)."""
    return lookup(ADV_ESTIMATORS, name, "advantage estimator")


def _required(fn: Callable) -> list[str]:
    return [p.name for p in inspect.signature(fn).parameters.values()
            if p.default is inspect.Parameter.empty]


def _estimator(name: str):
    """Registers an estimator after checking that ``compute_advantage`` can call it."""

    def deco(fn):
        missing = [p for p in _required(fn) if p not in ADV_INPUTS]
        if missing:
            raise TypeError(f"advantage estimator {name!r} requires {missing}, which are not among "
                            f"ADV_INPUTS {ADV_INPUTS}: give them defaults or add them there")
        return register(ADV_ESTIMATORS, name)(fn)

    return deco


def compute_advantage(name: str, **inputs) -> tuple[jax.Array, jax.Array]:
    """``(advantages, returns)`` of estimator ``name``: each argument it declares is taken from
    ``inputs`` by name (``ADV_INPUTS``; ``None`` = absent). A required one that is absent raises
    naming it (e.g. ``remax`` without ``reward_baselines``); optional ones keep their defaults."""
    unknown = sorted(set(inputs) - set(ADV_INPUTS))
    if unknown:
        raise TypeError(f"compute_advantage got unknown input(s) {unknown}; valid: {ADV_INPUTS}")
    fn = get_adv_estimator(name)
    params = inspect.signature(fn).parameters
    kwargs = {k: inputs[k] for k in params if inputs.get(k) is not None}
    missing = [k for k in _required(fn) if k not in kwargs]
    if missing:
        raise ValueError(f"advantage estimator {name!r} needs {missing}, which the batch lacks")
    return fn(**kwargs)


def _outcome(scalars: jax.Array, response_mask: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Broadcasts per-sequence advantages [b] over the response: ``[b, t]``, both outputs."""
    adv = scalars[:, None] * response_mask.astype(scalars.dtype)
    return adv, adv


@_estimator("gae")
@jax.jit
def gae(token_level_rewards, values, response_mask, gamma, lam):
    """GAE, reverse scan over t; masked tokens are skipped (value and TD error carried over).

    delta_t = r_t + gamma * V_next - V_t;  A_t = delta_t + gamma * lam * A_next (over masked
    tokens only); returns = A + values; advantages = masked_whiten(A) over the whole batch.
    Shapes: rewards/values/mask [b, t]. Like verl, padding positions are not zeroed.
    """
    mask = response_mask.astype(values.dtype)

    def step(carry, xs):
        next_value, last_gae = carry
        r, v, m = xs
        delta = r + gamma * next_value - v
        gae_t = delta + gamma * lam * last_gae
        next_value = v * m + (1 - m) * next_value
        last_gae = gae_t * m + (1 - m) * last_gae
        return (next_value, last_gae), last_gae

    zeros = jnp.zeros(values.shape[:1], values.dtype)
    xs = (token_level_rewards.T, values.T, mask.T)
    _, adv_t = jax.lax.scan(step, (zeros, zeros), xs, reverse=True)
    advantages = adv_t.T
    returns = advantages + values
    return M.masked_whiten(advantages, mask), returns


@_estimator("grpo")
@functools.partial(jax.jit, static_argnames="norm_adv_by_std_in_grpo")
def grpo(token_level_rewards, response_mask, group_ids, epsilon=1e-6,
         norm_adv_by_std_in_grpo=True):
    """GRPO outcome advantage: ``(score - group_mean) / (group_std + eps)`` on every token.

    score = sum_t rewards. std is the unbiased one. A group of one gets mean 0, std 1 (verl),
    so its advantage is ``score / (1 + eps)``. With ``norm_adv_by_std_in_grpo=False``
    (Dr.GRPO) the advantage is ``score - group_mean``. Shapes: [b, t], group_ids int[b].
    """
    scores = token_level_rewards.sum(-1)
    mean, std, n = M.group_mean_std(scores, M.group_index(group_ids))
    single = n == 1
    mean = jnp.where(single, 0.0, mean)
    std = jnp.where(single, 1.0, std)
    centred = scores - mean
    scalars = centred / (std + epsilon) if norm_adv_by_std_in_grpo else centred
    return _outcome(scalars, response_mask)


@_estimator("grpo_passk")
def grpo_passk(token_level_rewards, response_mask, group_ids, epsilon=1e-6,
               norm_adv_by_std_in_grpo=True):
    """Pass@k advantage: only a group's best response gets ``r_max - r_second`` (/ (std + eps)).

    Ties for the best give ``r_max - r_second = 0``, so which tied row "wins" never matters.
    verl raises for groups of one; here a numpy ``group_ids`` is checked eagerly and, under
    jit, a group of one gets advantage 0.
    """
    if isinstance(group_ids, np.ndarray) and np.unique(group_ids, return_counts=True)[1].min() < 2:
        raise ValueError("grpo_passk requires at least 2 samples per group (got a group of 1).")
    return _grpo_passk(token_level_rewards, response_mask, group_ids, epsilon,
                       bool(norm_adv_by_std_in_grpo))


@functools.partial(jax.jit, static_argnums=4)
def _grpo_passk(token_level_rewards, response_mask, group_ids, epsilon, norm_adv_by_std_in_grpo):
    scores = token_level_rewards.sum(-1)
    idx = M.group_index(group_ids)
    gmax = M.group_max(scores, idx)
    is_max = scores == gmax
    n_max = M.group_sum(is_max.astype(scores.dtype), idx)
    rest_max = M.group_max(jnp.where(is_max, -jnp.inf, scores), idx)
    second = jnp.where(n_max >= 2, gmax, rest_max)
    gap = jnp.where(jnp.isfinite(second), gmax - second, 0.0)
    if norm_adv_by_std_in_grpo:
        _, std, _ = M.group_mean_std(scores, idx)
        gap = gap / (std + epsilon)
    return _outcome(jnp.where(is_max, gap, 0.0), response_mask)


@_estimator("rloo")
@jax.jit
def rloo(token_level_rewards, response_mask, group_ids, epsilon=1e-6):
    """RLOO: ``n/(n-1) * (score - group_mean)`` (= score minus the mean of the others).

    verl quirk: a group of one keeps its raw score. ``epsilon`` is unused (verl signature).
    """
    del epsilon
    scores = token_level_rewards.sum(-1)
    mean, _, n = M.group_mean_std(scores, M.group_index(group_ids))
    loo = n / jnp.maximum(n - 1, 1) * (scores - mean)
    return _outcome(jnp.where(n > 1, loo, scores), response_mask)


@_estimator("opo")
@jax.jit
def opo(token_level_rewards, response_mask, group_ids, epsilon=1e-6):
    """OPO: score minus the length-weighted group baseline ``sum(len*score) / sum(len)``.

    A group of one gets baseline 0. A group whose responses are all empty gets baseline 0
    (verl would divide 0 by 0). ``epsilon`` is unused (verl signature).
    """
    del epsilon
    scores = token_level_rewards.sum(-1)
    lengths = response_mask.sum(-1).astype(scores.dtype)
    idx = M.group_index(group_ids)
    baseline = M.safe_div(M.group_sum(lengths * scores, idx), M.group_sum(lengths, idx))
    baseline = jnp.where(M.group_count(idx, scores.dtype) == 1, 0.0, baseline)
    return _outcome(scores - baseline, response_mask)


@_estimator("reinforce_plus_plus")
@jax.jit
def reinforce_plus_plus(token_level_rewards, response_mask, gamma):
    """REINFORCE++: discounted return-to-go (reset after the response ends), batch-whitened.

    G_t = r_t + gamma * G_{t+1} * mask_{t+1}; advantages = masked_whiten(G) * mask;
    returns = G (not masked, as in verl).
    """
    mask = response_mask.astype(token_level_rewards.dtype)

    def step(running, xs):
        r, m = xs
        ret = r + gamma * running
        return ret * m, ret

    zeros = jnp.zeros(mask.shape[:1], mask.dtype)
    _, ret_t = jax.lax.scan(step, zeros, (token_level_rewards.T, mask.T), reverse=True)
    returns = ret_t.T
    return M.masked_whiten(returns, mask) * mask, returns


@_estimator("reinforce_plus_plus_baseline")
@jax.jit
def reinforce_plus_plus_baseline(token_level_rewards, response_mask, group_ids, epsilon=1e-6):
    """REINFORCE++ with a group-mean baseline, then whitened over the batch's tokens.

    A = masked_whiten((score - group_mean) on every token) * mask; groups of one: mean 0.
    ``epsilon`` is unused (verl signature).
    """
    del epsilon
    scores = token_level_rewards.sum(-1)
    mean, _, n = M.group_mean_std(scores, M.group_index(group_ids))
    mask = response_mask.astype(scores.dtype)
    tiled = (scores - jnp.where(n == 1, 0.0, mean))[:, None] * mask
    adv = M.masked_whiten(tiled, mask) * mask
    return adv, adv


@_estimator("remax")
@jax.jit
def remax(token_level_rewards, reward_baselines, response_mask):
    """ReMax: return-to-go minus the greedy rollout's reward. reward_baselines: [b].

    returns_t = sum_{s >= t} r_s * mask_s; advantages = returns - baseline * mask.
    """
    mask = response_mask.astype(token_level_rewards.dtype)
    returns = jnp.flip(jnp.cumsum(jnp.flip(token_level_rewards * mask, -1), -1), -1)
    return returns - reward_baselines[:, None] * mask, returns


@_estimator("gpg")
@jax.jit
def gpg(token_level_rewards, response_mask, group_ids, epsilon=1e-6, f_norm=1.0, alpha=1.0):
    """GPG: ``alpha * (score - group_mean) / f_norm`` with ``alpha = b / max(#nonzero scores, 1)``.

    verl quirk: the ``alpha`` argument is overwritten by that batch ratio (kept here), and
    ``epsilon`` is unused. Groups of one: mean 0. Under data-parallel sharding the ratio is
    global because jit reduces over the whole (sharded) batch.
    """
    del epsilon, alpha
    scores = token_level_rewards.sum(-1)
    mean, _, n = M.group_mean_std(scores, M.group_index(group_ids))
    nonzero = jnp.sum(scores != 0).astype(scores.dtype)
    ratio = scores.shape[0] / jnp.maximum(nonzero, 1.0)
    scalars = ratio * (scores - jnp.where(n == 1, 0.0, mean)) / f_norm
    return _outcome(scalars, response_mask)
