"""KL estimators, KL-in-reward and the fixed / adaptive KL-coefficient controllers.

``kl_penalty`` is verl's per-token estimator of KL(pi || pi_ref) from the two log-probs of the
sampled token. The controllers are frozen dataclasses registered as pytrees: ``value`` is the
only array leaf (checkpoint it with the train state); ``update`` returns a new controller.
"""
from __future__ import annotations

import functools

import dataclasses

import jax
import jax.numpy as jnp

from jaxrl_llm.algos import _masked as M
from jaxrl_llm.algos._registry import check_choice

KL_PENALTIES = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3",
                "kl+", "k1+", "abs+", "low_var_kl+", "k3+")
KL_CONTROLLERS = ("fixed", "adaptive")


def _kl_forward(logprob, ref_logprob, kind):
    diff = logprob - ref_logprob
    if kind in ("kl", "k1"):
        return diff
    if kind == "abs":
        return jnp.abs(diff)
    if kind in ("mse", "k2"):
        return 0.5 * jnp.square(diff)
    kl = jnp.clip(-diff, -20.0, 20.0)  # low_var_kl / k3, with verl's clamps
    return jnp.clip(jnp.exp(kl) - kl - 1.0, -10.0, 10.0)


@functools.partial(jax.jit, static_argnames="kl_penalty")
def kl_penalty(logprob, ref_logprob, kl_penalty):
    """Per-token KL estimate. logprob/ref_logprob: [b, t] -> [b, t].

    ``kl``/``k1``: logp - ref; ``abs``: |logp - ref|; ``mse``/``k2``: 0.5 (logp - ref)^2;
    ``low_var_kl``/``k3``: clip(e^x - x - 1, -10, 10) with x = clip(ref - logp, -20, 20).
    A trailing ``+`` (e.g. ``k3+``) keeps the value but takes the gradient of k2
    (straight-through, as in verl).
    """
    check_choice(kl_penalty, KL_PENALTIES, "kl_penalty")
    forward = _kl_forward(logprob, ref_logprob, kl_penalty.rstrip("+"))
    if not kl_penalty.endswith("+"):
        return forward
    backward = 0.5 * jnp.square(logprob - ref_logprob)
    sg = jax.lax.stop_gradient
    return backward - sg(backward) + sg(forward)


@functools.partial(jax.jit, static_argnames="kl_penalty_type")
def apply_kl_penalty(token_level_scores, old_log_probs, ref_log_prob, response_mask, kl_coef,
                     kl_penalty_type="kl"):
    """KL in the reward: ``token_level_rewards = scores - kl_coef * kl * mask``. Shapes [b, t].

    Returns ``(token_level_rewards, current_kl)`` where ``current_kl`` is the batch mean of
    each row's token-mean KL (verl's ``actor/reward_kl_penalty``; feed it to the controller's
    ``update`` with ``n_steps = b``).
    """
    mask = response_mask.astype(token_level_scores.dtype)
    kld = kl_penalty(old_log_probs, ref_log_prob, kl_penalty_type) * mask
    rewards = token_level_scores - kl_coef * kld
    current_kl = M.masked_mean(kld, mask, axis=-1).mean()
    return rewards, current_kl


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class FixedKLController:
    """Constant KL coefficient. ``value``: scalar array (the only pytree leaf)."""

    value: jax.Array

    def update(self, current_kl, n_steps) -> "FixedKLController":
        """No-op (verl's signature)."""
        del current_kl, n_steps
        return self


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AdaptiveKLController:
    """Adaptive KL coefficient (Ziegler et al. 2019), verl's update rule.

    error = clip(current_kl / target - 1, -0.2, 0.2); value *= 1 + error * n_steps / horizon.
    ``value`` is the pytree leaf; ``target`` and ``horizon`` are static metadata.
    """

    value: jax.Array
    target: float = dataclasses.field(metadata=dict(static=True), default=0.1)
    horizon: float = dataclasses.field(metadata=dict(static=True), default=10000.0)

    def update(self, current_kl, n_steps) -> "AdaptiveKLController":
        """The controller after one step that saw ``current_kl`` over ``n_steps`` samples."""
        error = jnp.clip(current_kl / self.target - 1.0, -0.2, 0.2)
        mult = 1.0 + error * n_steps / self.horizon
        return dataclasses.replace(self, value=self.value * mult)


def get_kl_controller(type: str, kl_coef: float, target_kl: float | None = None,
                      horizon: float | None = None):
    """Builds a controller from verl's ``algorithm.kl_ctrl`` fields (``type``, ``kl_coef``, …)."""
    check_choice(type, KL_CONTROLLERS, "kl_ctrl.type")
    value = jnp.asarray(kl_coef, jnp.float32)
    if type == "fixed":
        return FixedKLController(value)
    if horizon is None or horizon <= 0:
        raise ValueError(f"kl_ctrl.horizon must be > 0 for the adaptive controller, got {horizon}.")
    if target_kl is None or target_kl <= 0:
        raise ValueError(f"kl_ctrl.target_kl must be > 0 for the adaptive controller, got {target_kl}.")
    return AdaptiveKLController(value, target=float(target_kl), horizon=float(horizon))
