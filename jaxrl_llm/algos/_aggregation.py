"""Loss aggregation (verl's ``agg_loss``) and its exact micro-batch / multi-device form.

Semantics follow verl's current ``agg_loss`` (the global-batch-aware one):

| mode                      | numerator                               | denominator              |
|---------------------------|-----------------------------------------|--------------------------|
| ``token-mean``            | sum of masked token losses              | number of masked tokens  |
| ``seq-mean-token-sum``    | sum over rows of the row's token sum    | number of non-empty rows |
| ``seq-mean-token-mean``   | sum over rows of the row's token mean   | number of non-empty rows |
| ``seq-mean-token-sum-norm``| sum over rows of the row's token sum / ``loss_scale_factor`` (default ``t``) | number of non-empty rows |
| ``token-sum``             | sum of masked token losses              | 1 (no normaliser)        |

Rows whose mask is all zero (empty responses) add nothing to either side (verl excludes
"fully masked sequences"). An all-empty batch gives loss 0 rather than NaN.

Because numerator and denominator are plain sums over rows, splitting a batch into
micro-batches (or shards) and adding the parts gives exactly the full-batch loss.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxrl_llm.algos import _masked as M
from jaxrl_llm.algos._registry import check_choice

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean",
                  "seq-mean-token-sum-norm", "token-sum")


def agg_loss_denominator(loss_mask: jax.Array, loss_agg_mode: str) -> jax.Array:
    """This batch's normaliser: token count (token-mean) or non-empty row count. mask: [b, t].

    Sum it over all micro-batches (and devices) of a mini-batch to get the ``global_*`` value
    that ``agg_loss``/``agg_loss_terms``/the policy losses accept. ``token-sum`` has no
    normaliser: 1 for the whole mini-batch (add only the numerators of its micro-batches).
    """
    check_choice(loss_agg_mode, LOSS_AGG_MODES, "loss_agg_mode")
    mask = loss_mask.astype(jnp.float32)
    if loss_agg_mode == "token-sum":
        return jnp.ones((), jnp.float32)
    if loss_agg_mode == "token-mean":
        return mask.sum()
    return (mask.sum(-1) > 0).astype(jnp.float32).sum()


def _numerator(loss_mat, loss_mask, loss_agg_mode, loss_scale_factor):
    mask = loss_mask.astype(loss_mat.dtype)
    if loss_agg_mode in ("token-mean", "token-sum"):
        return M.masked_sum(loss_mat, mask)
    row_sum = M.masked_sum(loss_mat, mask, axis=-1)
    if loss_agg_mode == "seq-mean-token-mean":
        return M.safe_div(row_sum, mask.sum(-1)).sum()
    total = row_sum.sum()
    if loss_agg_mode == "seq-mean-token-sum-norm":
        scale = loss_mask.shape[-1] if loss_scale_factor is None else loss_scale_factor
        total = total / scale
    return total


def agg_loss_terms(loss_mat, loss_mask, loss_agg_mode, *, global_batch_size=None,
                   global_token_count=None, loss_scale_factor=None):
    """``(numerator, denominator)`` with ``agg_loss = numerator / denominator``. Shapes [b, t].

    Two exact ways to accumulate over micro-batches and devices:

    1. Sum, then divide once: ``sum_i num_i / sum_i den_i`` (leave ``global_*`` unset). The
       denominator holds no gradient, so ``grad(sum_i num_i) / sum_i den_i`` is the
       full-batch gradient.
    2. Divide first, then sum (verl's way): compute the mini-batch total once with
       ``agg_loss_denominator`` summed over micro-batches, pass it as ``global_token_count``
       (token-mean) or ``global_batch_size`` (seq-mean modes: the number of *non-empty*
       sequences, as verl counts them), and sum ``num_i / den`` over micro-batches.

    When the matching ``global_*`` is given it is returned as the denominator.
    ``loss_scale_factor`` only affects ``seq-mean-token-sum-norm`` (default: ``t``, the
    padded response length; set it to a constant when ``t`` varies between micro-batches).
    """
    check_choice(loss_agg_mode, LOSS_AGG_MODES, "loss_agg_mode")
    return _agg_terms(loss_mat, loss_mask, loss_agg_mode, global_batch_size, global_token_count,
                      loss_scale_factor)


@functools.partial(jax.jit, static_argnums=2)
def _agg_terms(loss_mat, loss_mask, loss_agg_mode, global_batch_size, global_token_count,
               loss_scale_factor):
    num = _numerator(loss_mat, loss_mask, loss_agg_mode, loss_scale_factor)
    if loss_agg_mode == "token-sum":  # no normaliser, whatever the micro-batch split
        return num, jnp.ones((), num.dtype)
    override = global_token_count if loss_agg_mode == "token-mean" else global_batch_size
    if override is not None:
        return num, jnp.asarray(override, num.dtype)
    return num, agg_loss_denominator(loss_mask, loss_agg_mode).astype(num.dtype)


def agg_loss(loss_mat, loss_mask, loss_agg_mode, *, global_batch_size=None,
             global_token_count=None, loss_scale_factor=None):
    """Aggregates a ``[b, t]`` loss matrix into a scalar (verl's ``agg_loss``).

    With ``global_*`` set this is the micro-batch's share of the mini-batch loss: summing it
    over micro-batches gives the full-batch value (see ``agg_loss_terms``).
    """
    num, den = agg_loss_terms(loss_mat, loss_mask, loss_agg_mode,
                              global_batch_size=global_batch_size,
                              global_token_count=global_token_count,
                              loss_scale_factor=loss_scale_factor)
    return M.safe_div(num, den)
