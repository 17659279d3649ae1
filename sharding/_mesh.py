"""Device mesh construction from a `(data, fsdp, tensor[, context])` shape.

The mesh always has the four axes of `MESH_AXES`, in that order, whatever their sizes; axes of
size 1 cost nothing. Which tensor dimension goes on which axis is left to `_rules.py`.

Axis order is device locality: `jax.make_mesh` gives the last axes the closest devices (ICI
neighbours on a TPU slice, one NVLink domain on GPUs). `tensor` is innermost (an all-reduce or
all-gather per matmul, on the critical path); `context` next (context-parallel attention: four
all-to-alls per layer and direction); then `fsdp` (a weight all-gather / gradient
reduce-scatter per layer, overlappable); `data` outermost (one gradient reduction per step).

`context` (default 1) splits the training passes' sequence dim (`length` in the train rules).
Shapes given as sequences are `(data, fsdp, tensor)` (context 1) or `(data, fsdp, tensor,
context)`: the `MeshConfig` field order, which keeps every 3-entry shape meaning what it did.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

MESH_AXES: tuple[str, str, str, str] = ("data", "fsdp", "context", "tensor")
# The order of `MeshConfig`'s fields and of a shape given as a sequence (context last, optional).
CONFIG_AXES: tuple[str, str, str, str] = ("data", "fsdp", "tensor", "context")


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Mesh shape. At most one axis may be -1, meaning "all the devices the others leave"."""

    data: int = 1
    fsdp: int = -1
    tensor: int = 1
    context: int = 1

    def __post_init__(self):
        for name in MESH_AXES:
            size = getattr(self, name)
            if not isinstance(size, (int, np.integer)) or isinstance(size, bool):
                raise TypeError(f"MeshConfig.{name} must be an int, got {size!r}")
            if size == 0 or size < -1:
                raise ValueError(f"MeshConfig.{name} must be a positive int or -1 (fill), got {size}")
        fills = [n for n in MESH_AXES if getattr(self, n) == -1]
        if len(fills) > 1:
            raise ValueError(f"MeshConfig: at most one axis may be -1, got {fills} in {self.describe()}")

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> MeshConfig:
        """Builds from a mapping (dict or ConfigDict) with keys among `MESH_AXES`."""
        d = dict(d)
        unknown = sorted(set(d) - set(CONFIG_AXES))
        if unknown:
            raise ValueError(f"MeshConfig: unknown field(s) {unknown}; known fields are {list(CONFIG_AXES)}")
        return cls(**{k: int(v) for k, v in d.items()})

    def describe(self) -> str:
        names = CONFIG_AXES if self.context != 1 else CONFIG_AXES[:3]
        return "(" + ", ".join(f"{n}={getattr(self, n)}" for n in names) + ")"

    def resolve(self, num_devices: int) -> tuple[int, int, int, int]:
        """The concrete shape in `MESH_AXES` order `(data, fsdp, context, tensor)` for
        `num_devices` devices (fills the -1)."""
        sizes = [getattr(self, n) for n in MESH_AXES]
        fixed = math.prod(s for s in sizes if s != -1)
        if -1 in sizes:
            fill_name = MESH_AXES[sizes.index(-1)]
            if num_devices % fixed:
                raise ValueError(
                    f"mesh shape {self.describe()}: cannot fill {fill_name}=-1, {num_devices} devices are "
                    f"not divisible by the product of the other axes ({fixed})")
            sizes[sizes.index(-1)] = num_devices // fixed
        if math.prod(sizes) != num_devices:
            raise ValueError(
                f"mesh shape {self.describe()} needs {math.prod(sizes)} devices but {num_devices} devices "
                f"are available; make the product of data*fsdp*tensor*context equal the device count or set "
                f"one axis to -1")
        return tuple(sizes)  # type: ignore[return-value]


def as_mesh_config(config: MeshConfig | Mapping[str, Any] | Sequence[int]) -> MeshConfig:
    """Accepts a MeshConfig, a mapping of axis sizes, or a sequence `(data, fsdp, tensor)` (context
    1) or `(data, fsdp, tensor, context)`."""
    if isinstance(config, MeshConfig):
        return config
    if isinstance(config, Mapping) or hasattr(config, "to_dict"):
        return MeshConfig.from_dict(config.to_dict() if hasattr(config, "to_dict") else config)
    if isinstance(config, Sequence) and not isinstance(config, str):
        if len(config) not in (3, 4):
            raise ValueError(f"mesh shape {tuple(config)} must have 3 entries (data, fsdp, tensor) or 4 "
                             f"{CONFIG_AXES}")
        return MeshConfig(*(int(c) for c in config))
    raise TypeError(f"mesh config must be a MeshConfig, dict or 3- or 4-tuple, got {type(config).__name__}")


def make_mesh(config: MeshConfig | Mapping[str, Any] | Sequence[int],
              devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A `Mesh` with axes `MESH_AXES` over `devices` (default: all devices, topology-aware).

    `devices` may be any subset (e.g. the rollout half for disaggregated placement). Raises
    ValueError when the shape does not match the device count.
    """
    config = as_mesh_config(config)
    devices = list(jax.devices() if devices is None else devices)
    if not devices:
        raise ValueError("make_mesh: the device list is empty")
    shape = config.resolve(len(devices))
    axis_types = (AxisType.Auto,) * len(MESH_AXES)
    try:
        return jax.make_mesh(shape, MESH_AXES, axis_types, devices=devices)
    except (ValueError, NotImplementedError, AssertionError):
        # Topology-aware placement can refuse odd subsets of a TPU slice; fall back to list order.
        return Mesh(np.asarray(devices, dtype=object).reshape(shape), MESH_AXES, axis_types=axis_types)
