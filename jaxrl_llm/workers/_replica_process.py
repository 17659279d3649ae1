"""`rollout.replica_backend="process"`: what a rollout replica's child process builds.

`ReplicaSpec` is everything the child needs to build the replica's engine + `RolloutServer`
(picklable: the model config at the rollout dtype, the engine and server settings, the seed, the
stop ids, which of the child's devices it uses and in what mesh shape); `build_server(spec)` runs
in the child (`rollout.ProcessReplica`'s factory). The weights are not in the spec: the child
builds its engine on zeros (policy version 0) and gets the real weights by the first sync through
its pipe (`HostWorker` syncs right after start; the router syncs a restarted replica before it
takes requests). Weights in the spawn arguments would travel through the pipe that
multiprocessing writes the child's start-up data to, and a child that dies before reading all of
it (an import error) would leave that write, and the trainer, blocked for good. The child
is a fresh interpreter ("spawn") with the trainer's environment: on CPU it has its own host
platform devices (as many as the trainer's XLA_FLAGS give), so the replica uses the same device
ids and mesh shape as the in-process replica it stands for, and decodes as that one would.

On GPU/TPU a child needs devices that the trainer's process does not hold (a JAX process claims
every visible device when its backend starts, e.g. by CUDA_VISIBLE_DEVICES for each side or a
separate placement whose rollout devices the trainer never opens); `HostWorker` refuses the
process backend off CPU until that placement exists.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np
from flax import nnx

import rollout
from jaxrl_llm import models


@dataclasses.dataclass(frozen=True)
class ReplicaSpec:
    model_config: Any  # the rollout model's ModelConfig (rollout dtype)
    device_ids: Any  # numpy int array: the replica mesh's device ids, in its shape
    axis_names: tuple[str, ...]  # the replica mesh's axes
    axis_types: Any
    engine: dict  # Engine.from_model keyword arguments (no mesh)
    server: dict  # RolloutServer keyword arguments


def host_params(params) -> dict:
    """The rollout weights (a Param state or pure dict, on any devices) as host numpy: one
    device-to-host copy, shared by every replica's sync (the router passes the same tree on)."""
    pure = nnx.to_pure_dict(params) if isinstance(params, nnx.State) else params
    return jax.tree.map(np.asarray, jax.device_get(pure))


def build_server(spec: ReplicaSpec) -> rollout.RolloutServer:
    """In the child: the replica's engine (per-layer layout, zero weights until the first sync)
    and its request-level server."""
    by_id = {d.id: d for d in jax.devices()}
    ids = np.asarray(spec.device_ids)
    missing = [int(i) for i in ids.flat if int(i) not in by_id]
    if missing:
        raise RuntimeError(f"the rollout replica process sees devices {sorted(by_id)}, not {missing}: "
                           "rollout.replica_backend='process' needs the child to have the replica's devices")
    devices = np.vectorize(lambda i: by_id[int(i)], otypes=[object])(ids)
    mesh = jax.sharding.Mesh(devices, spec.axis_names, axis_types=spec.axis_types)
    graphdef, abstract = nnx.split(models.abstract_model(spec.model_config), nnx.Param)
    zeros = jax.tree.map(lambda a: np.zeros(a.shape, a.dtype), nnx.to_pure_dict(abstract))
    nnx.replace_by_pure_dict(abstract, zeros)
    engine = rollout.Engine.from_model((graphdef, abstract), mesh=mesh, layer_layout="per_layer", **spec.engine)
    return rollout.RolloutServer(engine, **spec.server)


def spec_for(mesh, *, model_config, engine: dict, server: dict) -> ReplicaSpec:
    """The spec of a replica standing for an in-process one on `mesh` (the same device ids)."""
    ids = np.vectorize(lambda d: d.id, otypes=[int])(mesh.devices)
    return ReplicaSpec(model_config=model_config, device_ids=ids,
                       axis_names=tuple(mesh.axis_names), axis_types=tuple(mesh.axis_types),
                       engine=dict(engine), server=dict(server))
