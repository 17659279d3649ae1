"""Masked reductions and per-group statistics: the building blocks of every estimator.

All functions are pure and jit-able. Masked-out entries never leak into a result, even when
they hold NaN or inf (we select with ``where`` instead of multiplying by the mask).
Group helpers work on arbitrary integer labels (any order, any magnitude) through
``jnp.unique(..., size=batch)``, so there is no Python loop over rows and no host sync.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def safe_div(num: jax.Array, den: jax.Array) -> jax.Array:
    """``num / den`` where ``den != 0``, else 0 (verl divides by ``den + 1e-8``: same numbers)."""
    ok = den != 0
    return jnp.where(ok, num / jnp.where(ok, den, 1), 0.0)


def masked_sum(values: jax.Array, mask: jax.Array, axis=None) -> jax.Array:
    """Sum of ``values`` where ``mask`` is non-zero. values/mask: same shape."""
    return jnp.sum(jnp.where(mask != 0, values * mask, 0.0), axis=axis)


def masked_mean(values: jax.Array, mask: jax.Array, axis=None) -> jax.Array:
    """Mean over masked entries; 0 when nothing is masked in."""
    return safe_div(masked_sum(values, mask, axis), jnp.sum(mask, axis=axis).astype(values.dtype))


def masked_var(values: jax.Array, mask: jax.Array, unbiased: bool = True) -> jax.Array:
    """Variance over all masked entries (verl: Bessel-corrected; n <= 1 gives no correction)."""
    mean = masked_mean(values, mask)
    var = masked_mean(jnp.square(values - mean), mask)
    if unbiased:
        n = jnp.sum(mask).astype(values.dtype)
        var = var * jnp.where(n > 1, n / jnp.maximum(n - 1, 1), 1.0)
    return var


def masked_whiten(values: jax.Array, mask: jax.Array, shift_mean: bool = True) -> jax.Array:
    """``(values - mean) * rsqrt(var + 1e-8)`` with masked batch statistics (verl_F.masked_whiten).

    Unmasked positions are whitened too (not zeroed), exactly like verl.
    """
    mean, var = masked_mean(values, mask), masked_var(values, mask)
    out = (values - mean) * jax.lax.rsqrt(var + 1e-8)
    return out + mean if not shift_mean else out


def group_index(group_ids: jax.Array) -> jax.Array:
    """Dense group index in ``[0, b)`` for arbitrary int labels. group_ids: int[b] -> int32[b]."""
    b = group_ids.shape[0]
    _, inv = jnp.unique(group_ids, size=b, return_inverse=True)
    return inv.reshape(b).astype(jnp.int32)


def group_sum(x: jax.Array, idx: jax.Array) -> jax.Array:
    """Per-row sum of ``x`` over the row's group. x: [b], idx: int32[b] (from group_index)."""
    return jax.ops.segment_sum(x, idx, num_segments=x.shape[0])[idx]


def group_count(idx: jax.Array, dtype=jnp.float32) -> jax.Array:
    """Per-row size of the row's group. idx: int32[b] -> [b]."""
    return group_sum(jnp.ones(idx.shape, dtype), idx)


def group_max(x: jax.Array, idx: jax.Array) -> jax.Array:
    """Per-row max of ``x`` over the row's group. x: [b]."""
    return jax.ops.segment_max(x, idx, num_segments=x.shape[0])[idx]


def group_min(x: jax.Array, idx: jax.Array) -> jax.Array:
    """Per-row min of ``x`` over the row's group. x: [b]."""
    return jax.ops.segment_min(x, idx, num_segments=x.shape[0])[idx]


def group_mean_std(x: jax.Array, idx: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Per-row group mean, unbiased std (torch.std) and size. x: [b] -> three [b] arrays.

    Groups of one get std 0 here; estimators apply verl's singleton rules themselves.
    """
    n = group_count(idx, x.dtype)
    mean = group_sum(x, idx) / n
    ss = group_sum(jnp.square(x - mean), idx)
    std = jnp.sqrt(ss / jnp.maximum(n - 1, 1))
    return mean, std, n
