"""The engine's weights in its layer layout: which layout a param tree is in, what `auto` picks,
and the sync that changes layout (cast + reshard + split or stack in one jitted program).

Same-layout syncs are `sharding.reshard_with_stats` (zero-copy where the leaves already fit); the
engine owns the decision. Layouts are `jaxrl_llm.models.LAYER_LAYOUTS`.
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

import sharding
from jaxrl_llm.models import LAYER_LAYOUTS, convert_layers


def _is_floating(x) -> bool:
    return jnp.issubdtype(x.dtype, jnp.floating)


def layout_of(pure, layout_shardings: dict) -> str:
    """The layer layout of a pure param dict (`layout_shardings`: layout -> its sharding tree), or
    a clear error when it fits neither."""
    got = jax.tree.structure(pure)
    for layout in LAYER_LAYOUTS:
        if got == jax.tree.structure(layout_shardings[layout]):
            return layout
    want = jax.tree.structure(layout_shardings["stacked"])
    raise ValueError(f"the parameter tree does not match the engine's model (stacked or per-layer "
                     f"layout).\nengine: {want}\ngot:    {got}")


def resolve_layout(layer_layout: str, pure, layout_shardings: dict, dtype) -> str:
    """"auto" -> "stacked" when every leaf of `pure` is already a stacked leaf with the engine's
    dtype and sharding (a sync can share it: zero copy), else "per_layer"."""
    if layer_layout in LAYER_LAYOUTS:
        return layer_layout
    if layer_layout != "auto":
        raise ValueError(f"layer_layout must be 'auto' or one of {LAYER_LAYOUTS}, got {layer_layout!r}")
    if layout_of(pure, layout_shardings) != "stacked":
        return "per_layer"
    dtype = jnp.dtype(dtype)

    def shared(x, target):  # what sharding.reshard would return as-is (no copy)
        if isinstance(x, jax.ShapeDtypeStruct):  # an abstract engine: decide for such arrays
            return (x.sharding is not None and x.dtype == (dtype if _is_floating(x) else x.dtype)
                    and x.sharding.is_equivalent_to(target, len(x.shape)))
        return (isinstance(x, jax.Array) and not x.is_deleted()
                and x.dtype == (dtype if _is_floating(x) else x.dtype)
                and x.sharding.is_equivalent_to(target, x.ndim))

    ok = jax.tree.leaves(jax.tree.map(shared, pure, layout_shardings["stacked"]))
    return "stacked" if all(ok) else "per_layer"


class Relayout:
    """Converts params from the other layout into `layout` on `shardings` with `dtype`; one jitted
    program per call (compiled once per input layout and sharding)."""

    def __init__(self, layout: str, shardings: Any, dtype, mesh: jax.sharding.Mesh):
        self._shardings, self._mesh = shardings, mesh
        self._dtype = jnp.dtype(dtype)
        def convert(p):
            return convert_layers(jax.tree.map(lambda x: x.astype(self._dtype) if _is_floating(x) else x, p),
                                  layout)

        self._jit = jax.jit(convert, out_shardings=shardings)

    def lower(self, pure):
        """The relayout program lowered for (abstract) params on the engine's devices."""
        return self._jit.lower(pure)

    def __call__(self, pure, source_shardings) -> tuple[Any, dict]:
        """(new params, {"bytes_moved", "bytes_total", "num_copied"}); `source_shardings`: the
        source layout's shardings on the engine's mesh (used when `pure` lives elsewhere)."""
        devices = set(self._mesh.devices.flat)
        if not all(isinstance(x, jax.Array) and x.sharding.device_set == devices
                   for x in jax.tree.leaves(pure)):
            # another device set (or host arrays): move there in the source layout first (a jit
            # cannot take inputs and give outputs on different devices)
            pure = sharding.reshard(pure, source_shardings, dtype=self._dtype)
        new = self._jit(pure)
        nbytes = sum(int(x.nbytes) for x in jax.tree.leaves(new))
        return new, {"bytes_moved": nbytes, "bytes_total": nbytes, "num_copied": len(jax.tree.leaves(new))}
