"""The engine's weights in its layer layout: which layout a param tree is in, what `auto` picks,
and the weight sync into the engine (`WeightSync`: a zero-copy-where-possible reshard in the same
layout, one cast + relayout program otherwise; with `quantization` fp8/int8 always that program,
quantizing the dense projections as it writes them, `jaxrl_llm.models._quant`). Layouts are
`jaxrl_llm.models.LAYER_LAYOUTS`.
"""
from __future__ import annotations

import functools
import sys
from typing import Any

import jax
import jax.numpy as jnp

import sharding
from jaxrl_llm.models import LAYER_LAYOUTS, convert_layers
from jaxrl_llm.models._quant import check_quantization, quantize_params


# Layers per sync program for per-layer targets: the host's per-output work (allocating and
# wrapping each engine array, ~2-3 us each on the H200 host) of program k + 1 overlaps the
# device's copy of program k, instead of all of it preceding one program. H200, 1.5B fp32 -> bf16
# per_layer_fused, donating: 1 program 3.95 ms, 4 layers 2.88, 7 layers 2.96-3.01 (docs/benchmarks.md
# §2 fifth pass). 0 = one program.
SYNC_LAYERS_PER_PROGRAM = 7
# Whether a relayout sync writes into the engine's previous weights (donated: no buffer is freed
# or allocated; freeing the 1.5B shape's 198 arrays took 0.6 ms of host time before the first
# program, docs/benchmarks.md §2 fifth pass) when nothing outside the engine holds them; see
# `WeightSync.may_donate`.
SYNC_DONATE = True


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


def resolve_layout(layer_layout: str, pure, layout_shardings: dict, dtype, platform: str = "cpu",
                   quantized: bool = False) -> str:
    """"auto" -> "stacked" when every leaf of `pure` is already a stacked leaf with the engine's
    dtype and sharding (a sync can share it: zero copy), else the per-layer layout that decodes
    fastest on `platform`: "per_layer_fused" on GPU (measured, docs/benchmarks.md §3), "per_layer"
    elsewhere (the fused layout is not measured on TPU). Both split the layers during the copy the
    sync makes anyway, and both shard alike under tensor parallelism (the fused q/k/v kernel is
    split by kv head, each with its own query heads). `quantized` (the engine quantizes its
    weights, so a sync always copies): "auto" never picks "stacked"."""
    if layer_layout in LAYER_LAYOUTS:
        return layer_layout
    if layer_layout != "auto":
        raise ValueError(f"layer_layout must be 'auto' or one of {LAYER_LAYOUTS}, got {layer_layout!r}")
    per_layer = "per_layer_fused" if platform == "gpu" else "per_layer"
    if quantized or layout_of(pure, layout_shardings) != "stacked":
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
    `SYNC_LAYERS_PER_PROGRAM` layers, enqueued back to back, into the engine's previous weights
    when the caller may donate them (`may_donate`). What a relayout decides per input
    (whether it must move devices first, its byte counts) is cached by the input's tree, shapes,
    dtypes and shardings, so a repeated sync does no per-leaf device-set check or byte count.

    `quantization` "fp8" / "int8": the engine's tree is `quantized_shardings` (`layout`'s tree
    with each dense projection as {"kernel" int8/e4m3 [*out, *in], "scale" f32 [*out]}); every
    sync of trainer params (any layout, same one included) runs the programs above with
    `_quant.quantize_params` after the cast and relayout (on device, no host round trip), and a
    tree already in the engine's quantized form (e.g. `engine.params`) is resharded as it is,
    under the layout name "quantized". "none": exactly the programs and buffers above.
    `sparse_layers`: the model's `config.sparse_layers`, which a stacked tree with dense and
    sparse MLPs needs to be split into layers (`models.unstack_layers`)."""

    def __init__(self, layout: str, layout_shardings: dict, dtype, mesh: jax.sharding.Mesh,
                 quantization: str = "none", quantized_shardings=None, sparse_layers: tuple[int, ...] = ()):
        self._layout, self._layout_shardings, self._mesh = layout, layout_shardings, mesh
        self._quant = check_quantization(quantization)
        self._shardings = layout_shardings[layout] if self._quant == "none" else quantized_shardings
        self._own = layout if self._quant == "none" else "quantized"  # the name of the engine's tree
        self._dtype = jnp.dtype(dtype)
        self._treedefs = {name: jax.tree.structure(s) for name, s in layout_shardings.items()}
        if self._quant != "none":
            self._treedefs["quantized"] = jax.tree.structure(quantized_shardings)
        self._devices = frozenset(mesh.devices.flat)
        self._plans: dict = {}  # input signature -> (moves first, stats): the relayout's decisions

        if self._quant == "none":
            def convert(p):
                return convert_layers(self._cast(p), layout, sparse_layers)
        else:
            def convert(p):
                return quantize_params(convert_layers(self._cast(p), layout, sparse_layers), self._quant)

        self._relayout = jax.jit(convert, out_shardings=self._shardings)  # the whole sync, for `lower`
        # (program, program writing into donated old weights, which part of the tree it writes)
        self._parts = [(self._relayout, _donating(convert, self._shardings), None)]
        if layout != "stacked":  # per-layer targets: the same copy in programs of a few layers each
            n, k = len(self._shardings["model"]["layers"]), SYNC_LAYERS_PER_PROGRAM
            chunks = [range(i, min(i + k, n)) for i in range(0, n, k)] if k else []
            if len(chunks) > 1:
                self._parts = []
                for j, c in enumerate(chunks):
                    fn = functools.partial(lambda p, c, first: _part(convert(p), c, first), c=c, first=j == 0)
                    out = _part(self._shardings, c, j == 0)
                    self._parts.append((jax.jit(fn, out_shardings=out), _donating(fn, out), (c, j == 0)))

    def _cast(self, p):
        return jax.tree.map(lambda x: x.astype(self._dtype) if _is_floating(x) else x, p)

    def shares(self, pure) -> bool:
        """Whether a sync of `pure` (arrays, or ShapeDtypeStructs with shardings) would keep its
        buffers: zero copy, nothing runs."""
        return (self._quant == "none" and layout_of(pure, self._layout_shardings) == self._layout == "stacked"
                and resolve_layout("auto", pure, self._layout_shardings, self._dtype) == "stacked")

    def lower(self, pure):
        """The sync program lowered for (abstract) params on the engine's devices (a layout
        change: the whole copy as one program, the union of the layer-chunk programs that run);
        None when the sync shares every leaf."""
        if self._quant != "none" or layout_of(pure, self._layout_shardings) != self._layout:
            return self._relayout.lower(pure)
        if self.shares(pure):
            return None
        return jax.jit(self._cast, out_shardings=self._shardings).lower(pure)

    def __call__(self, pure, donate=None) -> tuple[Any, dict]:
        """(new params, {"bytes_moved", "bytes_total", "num_copied", "fresh", "donated"}). `donate`:
        {"params": the engine's current weights}, for which the caller checked `may_donate`: the
        relayout writes into them (their arrays are deleted; "donated"). "fresh": the new arrays
        are this sync's own outputs, aliasing nothing given to it (so a later sync may donate
        them)."""
        leaves, treedef = jax.tree.flatten(pure)
        layout = self._layout_of(treedef, pure)
        if layout == self._own:  # the zero-copy check is per leaf (a buffer may have been freed)
            dtype = self._dtype if self._quant == "none" else None  # quantized: the dtypes are the engine's
            new, stats = sharding.reshard_with_stats(pure, self._shardings, dtype=dtype)
            return jax.tree.map(self._own_mesh, new, self._shardings), {**stats, "fresh": False, "donated": False}
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
        donated = donate is not None
        if donated:
            old = donate["params"]
            parts = [program(pure, old if which is None else _part(old, *which)) for _, program, which in self._parts]
            del old  # its arrays are deleted now
        else:
            parts = [program(pure) for program, _, _ in self._parts]  # enqueued one after the other
        new = parts[0] if len(parts) == 1 else _merge(parts)
        if plan is None:  # the output's size is fixed by the engine's layout: count it once
            out = jax.tree.leaves(new)
            nbytes = sum(int(x.nbytes) for x in out)
            stats = {"bytes_moved": nbytes, "bytes_total": nbytes, "num_copied": len(out)}
            if key is not None:
                self._plans[key] = (move, stats)
        return new, {**stats, "fresh": True, "donated": donated}

    def layout(self, pure) -> str:
        """The layer layout `pure` is in (a clear error naming both trees when it is neither)."""
        return self._layout_of(jax.tree.structure(pure), pure)

    def may_donate(self, owned: dict, layout: str) -> bool:
        """Whether a sync of params in `layout` (`self.layout(params)`) may write into
        `owned["params"]`, weights a relayout sync of this object made (so in its layout), where
        `owned` is the caller's only reference to them: `SYNC_DONATE` is on, the sync relayouts,
        and nothing else holds that dict or any of its sub-dicts or arrays (e.g. a kept
        `p = engine.params`, or its `p["model"]["layers"][0]`, keeps them all intact)."""
        return (SYNC_DONATE and owned.get("params") is not None and layout != self._own
                and _only_held_by_parent(owned))

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


def _donating(fn, out_shardings):
    """`fn(p)` jitted as `f(p, old)` that writes its outputs into the donated `old` (same tree and
    shardings as the output; unused otherwise, kept so XLA can alias it)."""
    return jax.jit(lambda p, old: fn(p), out_shardings=out_shardings, donate_argnums=1, keep_unused=True)


def _sole_refcount() -> int:
    """What `_only_held_by_parent` counts for a value that only its container holds (3 on CPython
    3.11-3.13: the container's reference, the loop variable's, getrefcount's argument; measured,
    not assumed, since newer interpreters borrow some of these)."""
    getrefcount = sys.getrefcount
    for value in {"probe": object()}.values():
        return getrefcount(value)
    raise AssertionError("unreachable")


_SOLE_REFCOUNT = _sole_refcount()


def _only_held_by_parent(root: dict) -> bool:
    """Whether every dict and array under `root` (a dict of pure param dicts) has no reference but
    its parent dict's."""
    getrefcount, sole = sys.getrefcount, _SOLE_REFCOUNT
    stack = [root]
    while stack:
        for value in stack.pop().values():
            if getrefcount(value) > sole:
                return False
            if type(value) is dict:
                stack.append(value)
    return True


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
