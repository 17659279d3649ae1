"""Move a pytree of arrays onto new shardings (and optionally a new dtype) in one on-device step.

This is the weight-sync primitive: trainer layout → rollout layout. Leaves already on the target
sharding with the target dtype are returned as the very same objects (0 bytes moved).
"""
from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Sharding


def _is_sharding(x: Any) -> bool:
    return isinstance(x, Sharding)


def _expand_targets(tree: Any, target_shardings: Any) -> list[Sharding]:
    """One target sharding per leaf of `tree`; `target_shardings` may be a prefix of `tree`."""
    if _is_sharding(target_shardings):
        return [target_shardings] * len(jax.tree.leaves(tree))
    try:
        full = jax.tree.map(lambda s, sub: jax.tree.map(lambda _: s, sub), target_shardings, tree,
                            is_leaf=_is_sharding)
    except (ValueError, TypeError) as e:
        raise ValueError(f"reshard: target_shardings must match the tree's structure (or a prefix "
                         f"of it): {e}") from e
    targets = jax.tree.leaves(full, is_leaf=_is_sharding)
    bad = [t for t in targets if not _is_sharding(t)]
    if bad or len(targets) != len(jax.tree.leaves(tree)):
        raise ValueError(f"reshard: every target must be a jax.sharding.Sharding, got e.g. {bad[:1]}")
    return targets


def _target_dtype(x: Any, dtype: Any) -> np.dtype:
    """Casts only floating-point leaves; integer / bool / key leaves keep their dtype."""
    if dtype is not None and jnp.issubdtype(x.dtype, jnp.floating):
        return jnp.dtype(dtype)
    return x.dtype


def _in_place(x: Any, target: Sharding, dtype: Any) -> bool:
    return (isinstance(x, jax.Array) and not x.is_deleted() and x.dtype == dtype
            and x.sharding.is_equivalent_to(target, x.ndim))


@functools.lru_cache(maxsize=256)
def _cast_fn(dtypes: tuple[Any, ...], shardings: tuple[Sharding, ...], donate: bool):
    """Jitted cast+relayout of a list of arrays; the list is donated when `donate`."""
    def cast(xs):
        return [x.astype(d) for x, d in zip(xs, dtypes)]
    return jax.jit(cast, out_shardings=list(shardings), donate_argnums=(0,) if donate else ())


def _run_cast(xs: list, dtypes: list, targets: list, donate: bool) -> list:
    """XLA can reuse a donated buffer only for an output of the same byte size; the other donated
    inputs are not passed as donated (no warning) and are deleted once the program is enqueued."""
    reusable = [donate and x.dtype.itemsize == jnp.dtype(d).itemsize for x, d in zip(xs, dtypes)]
    out: list = [None] * len(xs)
    for flag in (True, False):
        idx = [i for i, r in enumerate(reusable) if r == flag]
        if idx:
            fn = _cast_fn(tuple(dtypes[i] for i in idx), tuple(targets[i] for i in idx), flag)
            for i, y in zip(idx, fn([xs[i] for i in idx])):
                out[i] = y
    if donate:
        for x in xs:
            if not x.is_deleted():
                x.delete()
    return out


def _nbytes(x: Any) -> int:
    """Global logical size in bytes (not per-device), 0 for leaves without one."""
    try:
        return int(x.nbytes)
    except (AttributeError, TypeError):
        return 0


def _same_devices(x: Any, target: Sharding) -> bool:
    return isinstance(x, jax.Array) and x.sharding.device_set == target.device_set


def reshard_with_stats(tree: Any, target_shardings: Any, *, dtype: Any = None,
                       donate: bool = False) -> tuple[Any, dict[str, int]]:
    """`reshard`, plus {"bytes_moved", "bytes_total", "num_copied"} (global logical bytes)."""
    leaves, treedef = jax.tree.flatten(tree)
    leaves = [x if hasattr(x, "dtype") else np.asarray(x) for x in leaves]
    targets = _expand_targets(tree, target_shardings)
    dtypes = [_target_dtype(x, dtype) for x in leaves]
    out = list(leaves)
    put_idx, cast_idx = [], []
    for i, (x, t, d) in enumerate(zip(leaves, targets, dtypes)):
        if _in_place(x, t, d):
            continue
        if (x.dtype != d or donate) and _same_devices(x, t):
            cast_idx.append(i)
        else:
            put_idx.append(i)
    if cast_idx:  # layout change (+ cast) as one jitted program: fuses the cast, honours donation
        results = _run_cast([leaves[i] for i in cast_idx], [dtypes[i] for i in cast_idx],
                            [targets[i] for i in cast_idx], donate)
        for i, y in zip(cast_idx, results):
            out[i] = y
    if put_idx:  # layout change only, or across device sets: one batched device_put
        srcs = [leaves[i] if leaves[i].dtype == dtypes[i] else jnp.asarray(leaves[i], dtypes[i])
                for i in put_idx]
        donatable = donate and all(isinstance(s, jax.Array) for s in srcs)
        moved = jax.device_put(srcs, [targets[i] for i in put_idx], donate=donatable)
        for i, y in zip(put_idx, moved):
            out[i] = y
            if donatable and not leaves[i].is_deleted():
                leaves[i].delete()  # device_put's donate is only a hint; make the freeing certain
    copied = sorted(cast_idx + put_idx)
    nbytes = [_nbytes(y) for y in out]
    stats = {"bytes_moved": sum(nbytes[i] for i in copied), "bytes_total": sum(nbytes),
             "num_copied": len(copied)}
    return jax.tree.unflatten(treedef, out), stats


def reshard(tree: Any, target_shardings: Any, *, dtype: Any = None, donate: bool = False) -> Any:
    """Every leaf of `tree` on its target sharding, in one on-device transfer.

    Args:
      tree: pytree of arrays (an `nnx.State` of variables works: its array leaves move).
      target_shardings: a pytree of `Sharding`s matching `tree` (or a prefix of it, e.g. the output
        of `state_shardings`), or one `Sharding` for all leaves.
      dtype: if set, floating-point leaves are cast to it, fused with the transfer.
      donate: free the input buffers that are copied (never the ones returned as-is).

    Leaves whose sharding and dtype already match are returned as the same objects (zero copy).
    """
    return reshard_with_stats(tree, target_shardings, dtype=dtype, donate=donate)[0]
