"""The engine's weights in its layer layout: which layout a param tree is in, what `auto` picks,
and the weight sync into the engine (`WeightSync`: a zero-copy-where-possible reshard in the same
layout, one cast + relayout program otherwise). Layouts are `jaxrl_llm.models.LAYER_LAYOUTS`.
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


class WeightSync:
    """The engine's side of a weight sync: takes params in any layer layout and returns them in
    the engine's `layout` on its `shardings[layout]` with `dtype` (`layout_shardings`: layout ->
    its sharding tree on the engine's mesh).

    Same layout: `sharding.reshard_with_stats` with the cast fused, so leaves that already fit are
    kept as they are (0 bytes copied, same buffers). Other layout: one jitted program casts,
    relayouts and splits (or stacks) the layers, writing every engine byte once (compiled once
    per input layout and sharding)."""

    def __init__(self, layout: str, layout_shardings: dict, dtype, mesh: jax.sharding.Mesh):
        self._layout, self._layout_shardings, self._mesh = layout, layout_shardings, mesh
        self._shardings = layout_shardings[layout]
        self._dtype = jnp.dtype(dtype)

        def convert(p):
            return convert_layers(self._cast(p), layout)

        self._relayout = jax.jit(convert, out_shardings=self._shardings)

    def _cast(self, p):
        return jax.tree.map(lambda x: x.astype(self._dtype) if _is_floating(x) else x, p)

    def shares(self, pure) -> bool:
        """Whether a sync of `pure` (arrays, or ShapeDtypeStructs with shardings) would keep its
        buffers: zero copy, nothing runs."""
        return (layout_of(pure, self._layout_shardings) == self._layout == "stacked"
                and resolve_layout("auto", pure, self._layout_shardings, self._dtype) == "stacked")

    def lower(self, pure):
        """The sync program lowered for (abstract) params on the engine's devices; None when the
        sync shares every leaf."""
        if layout_of(pure, self._layout_shardings) != self._layout:
            return self._relayout.lower(pure)
        if self.shares(pure):
            return None
        return jax.jit(self._cast, out_shardings=self._shardings).lower(pure)

    def __call__(self, pure) -> tuple[Any, dict]:
        """(new params, {"bytes_moved", "bytes_total", "num_copied"})."""
        layout = layout_of(pure, self._layout_shardings)
        if layout == self._layout:
            new, stats = sharding.reshard_with_stats(pure, self._shardings, dtype=self._dtype)
            return jax.tree.map(self._own_mesh, new, self._shardings), stats
        devices = set(self._mesh.devices.flat)
        if not all(isinstance(x, jax.Array) and x.sharding.device_set == devices
                   for x in jax.tree.leaves(pure)):
            # another device set (or host arrays): move there in the source layout first (a jit
            # cannot take inputs and give outputs on different devices)
            pure = sharding.reshard(pure, self._layout_shardings[layout], dtype=self._dtype)
        new = self._relayout(pure)
        nbytes = sum(int(x.nbytes) for x in jax.tree.leaves(new))
        return new, {"bytes_moved": nbytes, "bytes_total": nbytes, "num_copied": len(jax.tree.leaves(new))}

    def _own_mesh(self, x, target):
        """Re-labels a leaf whose type still names another mesh (what `device_put(x, device)` of a
        mesh-sharded array leaves behind; jit would refuse to mix the two meshes). Aliases the
        buffer: no bytes move."""
        if jax.typeof(x).sharding.mesh != self._mesh.abstract_mesh:
            return jax.device_put(x, target, may_alias=True)
        return x
