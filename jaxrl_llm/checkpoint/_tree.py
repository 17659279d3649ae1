"""Pytree helpers for checkpointing: typed PRNG keys, restore targets, structure checks.

orbax stores plain arrays, so typed keys (`jax.random.key`) are saved as their raw key data and
re-wrapped on restore with the implementation name recorded at save time.
"""
from __future__ import annotations

from typing import Any

import jax
import numpy as np

PyTree = Any


def _is_typed_key(x: Any) -> bool:
    dtype = getattr(x, "dtype", None)
    return dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def path_str(path: tuple) -> str:
    """`('opt', 0, 'mu', 'w')`-style key path → `"opt/0/mu/w"`."""
    return "/".join(str(_key_name(k)) for k in path)


def _key_name(k: Any) -> Any:
    for attr in ("key", "name", "idx"):
        if hasattr(k, attr):
            return getattr(k, attr)
    return str(k)


def split_keys(state: PyTree) -> tuple[PyTree, dict[str, str]]:
    """Replace typed PRNG keys by their key data. Returns (state, {path: impl name})."""
    impls: dict[str, str] = {}

    def convert(path, x):
        if not _is_typed_key(x):
            return x
        impls[path_str(path)] = str(jax.random.key_impl(x))
        return jax.random.key_data(x)

    return jax.tree_util.tree_map_with_path(convert, state), impls


def wrap_keys(state: PyTree, impls: dict[str, str]) -> PyTree:
    """Inverse of `split_keys`: re-wrap the key data at the recorded paths."""

    def convert(path, x):
        impl = impls.get(path_str(path))
        return x if impl is None else jax.random.wrap_key_data(x, impl=impl)

    return jax.tree_util.tree_map_with_path(convert, state)


def abstract_target(target: PyTree) -> PyTree:
    """Concrete arrays / ShapeDtypeStructs → ShapeDtypeStructs (keeping shardings).

    Typed-key leaves become the ShapeDtypeStruct of their key data (trailing key dimension,
    same sharding, which leaves that dimension replicated). numpy arrays and Python scalars
    are kept, so they restore as numpy arrays / scalars.
    """

    def convert(x):
        if isinstance(x, (np.ndarray, np.generic, int, float, bool)):
            return x
        sharding = getattr(x, "sharding", None)
        if _is_typed_key(x):
            data = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(x.shape, x.dtype))
            return jax.ShapeDtypeStruct(data.shape, data.dtype, sharding=sharding)
        return jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=sharding)

    return jax.tree.map(convert, target)


class StructureMismatch(ValueError):
    """The restore target does not match the saved tree (a config change, not a damaged file)."""


def check_matches_saved(target: PyTree, saved: PyTree, *, where: str) -> None:
    """Raise ValueError naming the first key path where `target` and the saved tree differ."""
    want = {path_str(p): leaf for p, leaf in jax.tree_util.tree_flatten_with_path(target)[0]}
    have = {path_str(p): leaf for p, leaf in jax.tree_util.tree_flatten_with_path(saved)[0]}
    fix = "restore with a target built from the same model/optimizer config as the saved run"
    for key in want:
        if key not in have:
            raise StructureMismatch(f"{where}: target key '{key}' is not in the checkpoint; {fix}.")
    for key in have:
        if key not in want:
            raise StructureMismatch(f"{where}: checkpoint key '{key}' is missing from the target; {fix}.")
    for key, leaf in want.items():
        saved_shape = tuple(getattr(have[key], "shape", ()) or ())
        if tuple(np.shape(leaf)) != saved_shape:
            raise StructureMismatch(
                f"{where}: shape mismatch at '{key}': checkpoint has {saved_shape}, target has "
                f"{tuple(np.shape(leaf))} (did the model size change?); {fix}."
            )
