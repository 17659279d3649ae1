"""The engine's weights in its layer layout: which layout a param tree is in, what `auto` picks,
and the weight sync into the engine (`WeightSync`: a zero-copy-where-possible reshard in the same
layout, one cast + relayout program otherwise). Layouts are `jaxrl_llm.models.LAYER_LAYOUTS`.
"""
from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

import sharding
from jaxrl_llm.models import LAYER_LAYOUTS, convert_layers


# Layers per sync program for per-layer targets: the host's per-output work (allocating and
# wrapping each of the L x 12 engine arrays, ~1.4 ms for the 1.5B shape on the H200 host) of
# program k + 1 overlaps the device's copy of program k, instead of all of it preceding one
# program. H200, 1.5B fp32 -> bf16 per_layer_fused: 1 program 4.15 ms, 4 layers 3.60, 7 layers
# 3.37 (docs/benchmarks.md §2). 0 = one program.
SYNC_LAYERS_PER_PROGRAM = 7


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


def resolve_layout(layer_layout: str, pure, layout_shardings: dict, dtype, platform: str = "cpu") -> str:
    """"auto" -> "stacked" when every leaf of `pure` is already a stacked leaf with the engine's
    dtype and sharding (a sync can share it: zero copy), else the per-layer layout that decodes
    fastest on `platform`: "per_layer_fused" on GPU (measured, docs/benchmarks.md §3), "per_layer"
    elsewhere (the fused layout is not measured on TPU). Both split the layers during the copy the
    sync makes anyway, and both shard alike under tensor parallelism (the fused q/k/v kernel is
    split by kv head, each with its own query heads)."""
    if layer_layout in LAYER_LAYOUTS:
        return layer_layout
    if layer_layout != "auto":
        raise ValueError(f"layer_layout must be 'auto' or one of {LAYER_LAYOUTS}, got {layer_layout!r}")
    per_layer = "per_layer_fused" if platform == "gpu" else "per_layer"
    if layout_of(pure, layout_shardings) != "stacked":
        return per_layer
    dtype = jnp.dtype(dtype)

    def shared(x, target):  # what sharding.reshard would return as-is (no copy)
        if isinstance(x, jax.ShapeDtypeStruct):  # an abstract engine: decide for such arrays
            return (x.sharding is not None and x.dtype == (dtype if _is_floating(x) else x.dtype)
                    and x.sharding.is_equivalent_to(target, len(x.shape)))
        return (isinstance(x, jax.Array) and not x.is_deleted()
                and x.dtype == (dtype if _is_floating(x) else x.dtype)
                and x.sharding.is_equivalent_to(target, x.ndim))

    ok = jax.tree.leaves(jax.tree.map(shared, pure, layout_shardings["stacked"]))
    return "stacked" if all(ok) else per_layer


class WeightSync:
    """The engine's side of a weight sync: takes params in any layer layout and returns them in
    the engine's `layout` on its `shardings[layout]` with `dtype` (`layout_shardings`: layout ->
    its sharding tree on the engine's mesh).

    Same layout: `sharding.reshard_with_stats` with the cast fused, so leaves that already fit are
    kept as they are (0 bytes copied, same buffers). Other layout: jitted programs cast,
    relayout and split (or stack) the layers, writing every engine byte once (compiled once per
    input layout and sharding); a per-layer target is written by one program per
    `SYNC_LAYERS_PER_PROGRAM` layers, enqueued back to back. What a relayout decides per input
    (whether it must move devices first, its byte counts) is cached by the input's tree, shapes,
    dtypes and shardings, so a repeated sync does no per-leaf device-set check or byte count."""

    def __init__(self, layout: str, layout_shardings: dict, dtype, mesh: jax.sharding.Mesh):
        self._layout, self._layout_shardings, self._mesh = layout, layout_shardings, mesh
        self._shardings = layout_shardings[layout]
        self._dtype = jnp.dtype(dtype)
        self._treedefs = {name: jax.tree.structure(s) for name, s in layout_shardings.items()}
        self._devices = frozenset(mesh.devices.flat)
        self._plans: dict = {}  # input signature -> (moves first, stats): the relayout's decisions

        def convert(p):
            return convert_layers(self._cast(p), layout)

        self._relayout = jax.jit(convert, out_shardings=self._shardings)  # the whole sync, for `lower`
        self._parts = [self._relayout]
        if layout != "stacked":  # per-layer targets: the same copy in programs of a few layers each
            n, k = len(self._shardings["model"]["layers"]), SYNC_LAYERS_PER_PROGRAM
            chunks = [range(i, min(i + k, n)) for i in range(0, n, k)] if k else []
            if len(chunks) > 1:
                self._parts = [jax.jit(functools.partial(lambda p, c, first: _part(convert(p), c, first),
                                                         c=c, first=j == 0),
                                       out_shardings=_part(self._shardings, c, j == 0))
                               for j, c in enumerate(chunks)]

    def _cast(self, p):
        return jax.tree.map(lambda x: x.astype(self._dtype) if _is_floating(x) else x, p)

    def shares(self, pure) -> bool:
        """Whether a sync of `pure` (arrays, or ShapeDtypeStructs with shardings) would keep its
        buffers: zero copy, nothing runs."""
        return (layout_of(pure, self._layout_shardings) == self._layout == "stacked"
                and resolve_layout("auto", pure, self._layout_shardings, self._dtype) == "stacked")

    def lower(self, pure):
        """The sync program lowered for (abstract) params on the engine's devices (a layout
        change: the whole copy as one program, the union of the layer-chunk programs that run);
        None when the sync shares every leaf."""
        if layout_of(pure, self._layout_shardings) != self._layout:
            return self._relayout.lower(pure)
        if self.shares(pure):
            return None
        return jax.jit(self._cast, out_shardings=self._shardings).lower(pure)

    def __call__(self, pure) -> tuple[Any, dict]:
        """(new params, {"bytes_moved", "bytes_total", "num_copied"})."""
        leaves, treedef = jax.tree.flatten(pure)
        layout = self._layout_of(treedef, pure)
        if layout == self._layout:  # the zero-copy check is per leaf (a buffer may have been freed)
            new, stats = sharding.reshard_with_stats(pure, self._shardings, dtype=self._dtype)
            return jax.tree.map(self._own_mesh, new, self._shardings), stats
        key = _signature(treedef, leaves)
        plan = self._plans.get(key) if key is not None else None
        if plan is None:
            # another device set (or host arrays): move there in the source layout first (a jit
            # cannot take inputs and give outputs on different devices)
            move = not all(isinstance(x, jax.Array) and x.sharding.device_set == self._devices
                           for x in leaves)
        else:
            move, stats = plan
        if move:
            pure = sharding.reshard(pure, self._layout_shardings[layout], dtype=self._dtype)
        parts = [program(pure) for program in self._parts]  # enqueued one after the other
        new = parts[0] if len(parts) == 1 else _merge(parts)
        if plan is None:  # the output's size is fixed by the engine's layout: count it once
            out = jax.tree.leaves(new)
            nbytes = sum(int(x.nbytes) for x in out)
            stats = {"bytes_moved": nbytes, "bytes_total": nbytes, "num_copied": len(out)}
            if key is not None:
                self._plans[key] = (move, stats)
        return new, dict(stats)

    def _layout_of(self, treedef, pure) -> str:
        for name, known in self._treedefs.items():
            if treedef == known:
                return name
        return layout_of(pure, self._layout_shardings)  # raises the error naming both trees

    def _own_mesh(self, x, target):
        """Re-labels a leaf whose type still names another mesh (what `device_put(x, device)` of a
        mesh-sharded array leaves behind; jit would refuse to mix the two meshes). Aliases the
        buffer: no bytes move."""
        if jax.typeof(x).sharding.mesh != self._mesh.abstract_mesh:
            return jax.device_put(x, target, may_alias=True)
        return x


def _signature(treedef, leaves):
    """What the sync's decisions depend on: the tree and each leaf's shape, dtype and sharding;
    None (decide afresh) when a leaf is not a jax.Array."""
    sig = []
    for x in leaves:
        if not isinstance(x, jax.Array):
            return None
        sig.append((x.shape, x.dtype, x.sharding))
    return treedef, tuple(sig)


def _part(tree: dict, layers, first: bool) -> dict:
    """The sub-tree of a per-layer param (or sharding) tree with `layers`' entries, and (`first`)
    everything outside the layers."""
    model = tree["model"]
    out = {k: v for k, v in tree.items() if k != "model"} if first else {}
    inner = {k: v for k, v in model.items() if k != "layers"} if first else {}
    out["model"] = {**inner, "layers": {i: model["layers"][i] for i in layers}}
    return out


def _merge(parts: list) -> dict:
    """The inverse of splitting a per-layer tree into `_part`s (the first holds the non-layer leaves)."""
    out = dict(parts[0])
    layers = {}
    for p in parts:
        layers.update(p["model"]["layers"])
    out["model"] = {**parts[0]["model"], "layers": layers}
    return out
