"""Critic loss: verl's clipped value loss (``compute_value_loss``)."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxrl_llm.algos import _masked as M
from jaxrl_llm.algos._aggregation import agg_loss


@functools.partial(jax.jit, static_argnames="loss_agg_mode")
def value_loss(vpreds, returns, values, response_mask, cliprange_value,
               loss_agg_mode="token-mean", *, global_batch_size=None, global_token_count=None,
               loss_scale_factor=None):
    """Clipped value loss. All inputs [b, t] -> ``(vf_loss, vf_clipfrac)`` scalars.

    v_clip = clip(vpreds, values - c, values + c);
    vf_loss = 0.5 * agg(max((vpreds - R)^2, (v_clip - R)^2));
    vf_clipfrac = masked mean of [(v_clip - R)^2 > (vpreds - R)^2].
    """
    vclip = jnp.clip(vpreds, values - cliprange_value, values + cliprange_value)
    loss1 = jnp.square(vpreds - returns)
    loss2 = jnp.square(vclip - returns)
    vf_loss = 0.5 * agg_loss(jnp.maximum(loss1, loss2), response_mask, loss_agg_mode,
                             global_batch_size=global_batch_size,
                             global_token_count=global_token_count,
                             loss_scale_factor=loss_scale_factor)
    clipfrac = M.masked_mean((loss2 > loss1).astype(vpreds.dtype), response_mask)
    return vf_loss, jax.lax.stop_gradient(clipfrac)
