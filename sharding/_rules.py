"""Logical-axis rules: which mesh axes each logical tensor dimension is split over.

Models name their dimensions (`embed`, `mlp`, `batch`, …); the two tables here turn those names
into `PartitionSpec`s. `TRAIN_RULES` is FSDP + tensor parallelism + context parallelism (the
sequence dim `length` of activations on `context`; parameters are FSDP-sharded over `fsdp` and
`context` together, so context-parallel devices do not each hold a copy); `ROLLOUT_RULES` keeps
the tensor split but replicates parameters over `data`/`fsdp`, which is what a decode step wants.

Expert parallelism: both tables put the `expert` dim of MoE expert weights on `fsdp`, so each fsdp
device holds whole experts (1/fsdp of them) instead of a slice of every expert, in training and in
the engine alike (same layout: weight sync of the experts is zero-copy). The model's dispatch
reads this rule and runs each device's experts on the tokens routed to them (models/_decoder.py,
`expert_mix`). An expert kernel's `embed` dim then stays whole (its rule names `fsdp` too).

A mesh whose `context` axis has size 1 (the default) leaves `context` out of every spec made
for it, so each sharding is exactly what it was before the axis existed.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

from jax.sharding import Mesh, NamedSharding, PartitionSpec

from sharding._mesh import MESH_AXES

MeshAxes = str | tuple[str, ...] | None
Rules = tuple[tuple[str, MeshAxes], ...]

_BATCH = ("data", "fsdp")
# left out of specs on a mesh where it has size 1 (see the module doc)
_OPTIONAL_AXES = ("context",)

TRAIN_RULES: Rules = (
    # activations
    ("batch", _BATCH),
    ("length", "context"),
    # parameters (and activation dims of the same name)
    ("vocab", "tensor"),
    ("embed", ("fsdp", "context")),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("head_dim", None),
    ("mlp", "tensor"),
    ("expert", "fsdp"),  # expert parallelism: MoE experts split over fsdp (docs/scaling.md)
    ("layers", None),
    # KV cache
    ("cache_batch", _BATCH),
    ("cache_length", None),
)

ROLLOUT_RULES: Rules = (
    ("batch", _BATCH),
    ("length", None),
    ("vocab", "tensor"),
    ("embed", None),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("head_dim", None),
    ("mlp", "tensor"),
    ("expert", "fsdp"),  # expert parallelism: MoE experts split over fsdp (docs/scaling.md)
    ("layers", None),
    ("cache_batch", _BATCH),
    ("cache_length", None),
)

RULES: dict[str, Rules] = {"train": TRAIN_RULES, "rollout": ROLLOUT_RULES}


def get_rules(name: str) -> Rules:
    """The rule table called `name` ("train" or "rollout")."""
    if name not in RULES:
        raise ValueError(f"unknown sharding rules {name!r}; known rule sets are {sorted(RULES)}")
    return RULES[name]


def _as_table(rules: Rules | str) -> dict[str, tuple[str, ...]]:
    """Rules (or their name) as {logical: tuple of mesh axes}, validated."""
    if isinstance(rules, str):
        rules = get_rules(rules)
    table: dict[str, tuple[str, ...]] = {}
    for entry in rules:
        if len(entry) != 2:
            raise ValueError(f"a sharding rule must be (logical_name, mesh_axes), got {entry!r}")
        logical, axes = entry
        axes = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
        bad = [a for a in axes if a not in MESH_AXES]
        if bad:
            raise ValueError(f"sharding rule {logical!r} names unknown mesh axes {bad}; "
                             f"mesh axes are {MESH_AXES}")
        if logical in table:
            raise ValueError(f"sharding rules list logical axis {logical!r} twice")
        table[logical] = axes
    return table


def _mesh_axes_per_dim(logical_axes: Sequence[str | None], rules: Rules | str,
                       mesh: Mesh | None = None) -> list[tuple[str, ...]]:
    """The mesh axes of each dim; a mesh axis already used by an earlier dim leaves the dim whole.
    With `mesh`, `_OPTIONAL_AXES` of size 1 on it are left out."""
    if isinstance(logical_axes, str):
        raise TypeError(f"logical axes must be a tuple of names, got the string {logical_axes!r}")
    table = _as_table(rules)
    used: set[str] = set()
    out = []
    for name in logical_axes:
        if name is None:
            out.append(())
            continue
        if name not in table:
            raise ValueError(f"unknown logical axis {name!r}; known logical axes are {sorted(table)}")
        axes = table[name]
        if mesh is not None:
            axes = tuple(a for a in axes if not (a in _OPTIONAL_AXES and mesh.shape.get(a, 1) == 1))
        if used.intersection(axes):
            axes = ()
        used.update(axes)
        out.append(axes)
    return out


def _spec_entry(axes: tuple[str, ...]) -> MeshAxes:
    return None if not axes else axes[0] if len(axes) == 1 else axes


def logical_to_spec(logical_axes: Sequence[str | None], rules: Rules | str,
                    mesh: Mesh | None = None) -> PartitionSpec:
    """PartitionSpec for a tensor whose dims are named `logical_axes` (None = unsharded dim).

    A mesh axis may appear only once in a spec: a later dim whose rule names a mesh axis already
    used by an earlier dim stays unsharded, e.g. ("batch", "length", "embed") under TRAIN_RULES
    gives P(("data", "fsdp"), "context", None). With `mesh`, for that mesh (a `context` of size 1
    left out: P(("data", "fsdp"), None, None)).
    """
    return PartitionSpec(*(_spec_entry(a) for a in _mesh_axes_per_dim(logical_axes, rules, mesh)))


def logical_axis_size(mesh: Mesh, logical_axis: str, rules: Rules | str) -> int:
    """How many parts `rules` split a dim named `logical_axis` into on `mesh` (1: whole)."""
    (axes,) = _mesh_axes_per_dim((logical_axis,), rules, mesh)
    return math.prod(mesh.shape[a] for a in axes)


def logical_sharding(mesh: Mesh, logical_axes: Sequence[str | None], rules: Rules | str,
                     shape: Sequence[int] | None = None, *, name: str | None = None
                     ) -> NamedSharding:
    """NamedSharding on `mesh` for dims `logical_axes`.

    With `shape`, checks the rank and that every sharded dim divides evenly over its mesh axes;
    errors name the tensor (`name`), dim index, size, logical name and mesh axes.
    """
    per_dim = _mesh_axes_per_dim(logical_axes, rules, mesh)
    if shape is not None:
        what = f"{name}: " if name else ""
        if len(shape) != len(per_dim):
            raise ValueError(f"{what}logical axes {tuple(logical_axes)} have {len(per_dim)} entries but "
                             f"the array has shape {tuple(shape)}")
        for i, (size, axes) in enumerate(zip(shape, per_dim)):
            parts = math.prod(mesh.shape[a] for a in axes)
            if size % parts:
                hint = (" (expert parallelism: the experts are split over these axes, so their size must "
                        "divide num_experts; put the other devices on mesh.data)"
                        if logical_axes[i] == "expert" else "")
                raise ValueError(
                    f"{what}dim {i} (size {size}, logical axis {logical_axes[i]!r}) is not divisible by "
                    f"mesh axes {axes} of total size {parts} (mesh {dict(mesh.shape)}); change the mesh "
                    f"shape or the model size{hint}")
    return NamedSharding(mesh, PartitionSpec(*(_spec_entry(a) for a in per_dim)))
