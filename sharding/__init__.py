"""Sharding for jaxrl-llm: the only place that names mesh axes.

- mesh: `MeshConfig`, `make_mesh` (axes `MESH_AXES` = data, fsdp, context, tensor).
- rules: `TRAIN_RULES` / `ROLLOUT_RULES` map logical dim names to mesh axes;
  `logical_to_spec`, `logical_sharding`, `logical_axis_size`.
- state: `state_shardings` / `tree_shardings` / `shard_state` / `init_sharded` from the
  `logical_axes` metadata on `nnx.Variable`s.
- `reshard` (weight sync, zero-copy when layouts match), `reshard_with_stats`.
- `transfer` (copies onto disjoint devices, also across processes), `replica_mesh` /
  `local_replica` (one rollout replica per host).
- activations: `use_rules` + `constrain`.
- multi-host: `initialize_distributed`, `host_local_to_global`, `process_batch_slice`, `to_host`.

This package does not import `jaxrl_llm`.
"""
from sharding._batch import global_batch_sharding, host_local_to_global, process_batch_slice, to_host
from sharding._context import constrain, current_mesh, current_rules, use_rules
from sharding._distributed import (
    DistributedSpec,
    expand_hostlist,
    initialize_distributed,
    resolve_distributed_env,
)
from sharding._mesh import MESH_AXES, MeshConfig, make_mesh
from sharding._reshard import reshard, reshard_with_stats
from sharding._rules import (
    ROLLOUT_RULES,
    RULES,
    TRAIN_RULES,
    Rules,
    get_rules,
    logical_axis_size,
    logical_sharding,
    logical_to_spec,
)
from sharding._state import init_sharded, shard_state, state_shardings, tree_shardings
from sharding._transfer import REPLICA_AXIS, local_replica, replica_mesh, transfer

__all__ = [
    "MESH_AXES", "MeshConfig", "make_mesh",
    "TRAIN_RULES", "ROLLOUT_RULES", "RULES", "Rules", "get_rules", "logical_to_spec",
    "logical_sharding", "logical_axis_size",
    "state_shardings", "tree_shardings", "shard_state", "init_sharded",
    "reshard", "reshard_with_stats",
    "transfer", "replica_mesh", "local_replica", "REPLICA_AXIS",
    "use_rules", "constrain", "current_mesh", "current_rules",
    "DistributedSpec", "resolve_distributed_env", "initialize_distributed", "expand_hostlist",
    "host_local_to_global", "global_batch_sharding", "process_batch_slice", "to_host",
]
