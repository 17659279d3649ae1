"""Shardings for model and optimizer state, from the `logical_axes` metadata on NNX variables.

A model marks each parameter with its logical dims, e.g.
`nnx.Param(w, logical_axes=("embed", "mlp"))`; `state_shardings` turns a whole `nnx.State`
(concrete or abstract from `nnx.eval_shape`) into a matching tree of `NamedSharding`s, and
`shard_state` places the values there. For plain pytrees (optimizer states, KV caches) pair the
values with a tree of logical-axis tuples and use `tree_shardings`.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from sharding._reshard import reshard
from sharding._rules import Rules, logical_sharding

T = TypeVar("T")


def _is_variable(x: Any) -> bool:
    return isinstance(x, nnx.Variable)


def _is_axes_leaf(x: Any) -> bool:
    """A logical-axes annotation: None (replicate) or a tuple of names / None."""
    return x is None or (isinstance(x, tuple) and all(a is None or isinstance(a, str) for a in x))


def _variable_value(v: nnx.Variable) -> Any:
    return v.get_value()


def _one_sharding(mesh: Mesh, rules: Rules | str, axes: Any, value: Any, path: str) -> NamedSharding:
    if axes is None:
        return NamedSharding(mesh, PartitionSpec())
    if not _is_axes_leaf(axes):
        raise TypeError(f"{path}: logical_axes must be a tuple of names, got {axes!r}")
    return logical_sharding(mesh, axes, rules, getattr(value, "shape", None), name=path)


def state_shardings(state: Any, mesh: Mesh, rules: Rules | str) -> Any:
    """A tree of NamedSharding for every variable in `state`.

    `state` is an `nnx.State`, an `nnx.Module`, or any pytree whose leaves are `nnx.Variable`s
    (values may be arrays or `ShapeDtypeStruct`s). The result has the structure of the pure value
    tree (each variable replaced by its sharding), which is also a valid `out_shardings` prefix for
    the variable tree. Variables without `logical_axes` metadata, and bare arrays, are replicated.
    """
    if isinstance(state, nnx.Module):
        state = nnx.state(state)

    def one(path, leaf):
        where = jax.tree_util.keystr(path)
        if _is_variable(leaf):
            axes = leaf.get_metadata().get("logical_axes")
            return _one_sharding(mesh, rules, axes, _variable_value(leaf), where)
        return NamedSharding(mesh, PartitionSpec())

    return jax.tree_util.tree_map_with_path(one, state, is_leaf=_is_variable)


def tree_shardings(value_tree: Any, axes_tree: Any, mesh: Mesh, rules: Rules | str) -> Any:
    """NamedShardings for a plain pytree, from a matching tree of logical-axis tuples.

    `axes_tree` mirrors `value_tree` (or is a prefix of it) with a tuple of logical names, or None
    for "replicate", where each array (or subtree of arrays) sits. Returns a tree shaped like
    `value_tree`.
    """
    def per_subtree(path, axes, sub):
        def per_leaf(sub_path, value):
            where = jax.tree_util.keystr(tuple(path) + tuple(sub_path))
            return _one_sharding(mesh, rules, axes, value, where)
        return jax.tree_util.tree_map_with_path(per_leaf, sub)

    return jax.tree_util.tree_map_with_path(per_subtree, axes_tree, value_tree,
                                            is_leaf=_is_axes_leaf)


def shard_state(state: T, mesh: Mesh, rules: Rules | str, *, donate: bool = False) -> T:
    """`state` with every value placed on its logical sharding (zero copy where already there).

    Accepts what `state_shardings` accepts; an `nnx.Module` comes back as a new, sharded module
    (`nnx.split` → place → `nnx.merge`), the input module is left as it was.
    """
    if isinstance(state, nnx.Module):
        graphdef, module_state = nnx.split(state)
        return nnx.merge(graphdef, shard_state(module_state, mesh, rules, donate=donate))
    return reshard(state, state_shardings(state, mesh, rules), donate=donate)


def init_sharded(ctor: Callable[[], nnx.Module], mesh: Mesh, rules: Rules | str) -> nnx.Module:
    """Builds `ctor()` directly in its sharded layout, so no device ever holds the whole model.

    `ctor` takes no arguments (close over config and `nnx.Rngs`). Shapes come from
    `nnx.eval_shape`; initialisation runs under jit with `out_shardings` from the logical axes.
    """
    graphdef, abstract = nnx.split(nnx.eval_shape(ctor))
    shardings = state_shardings(abstract, mesh, rules)
    state = jax.jit(lambda: nnx.state(ctor()), out_shardings=shardings)()
    return nnx.merge(graphdef, state)
