"""Copies across meshes with disjoint devices, also when they span several processes.

Multi-controller JAX (jax 0.10) cannot `device_put` an array that spans several processes onto
a different set of devices (it raises "input and target sharding should have the same set of
devices"), and a jitted program takes its inputs and gives its outputs on one device set. So a
copy from the training mesh to the rollout replicas is two programs that every process runs:

1. on the source devices: cast, and cut out every target device's shard; source device `i`
   gets the shards of target devices `i, i + T, i + 2T, ...` (T source devices), stacked;
2. on the union of both device sets (a 1-D mesh, sources first): `ppermute` rounds that send
   each shard from its source device to its target device.

Each target device receives exactly its own bytes (over NVLink/ICI within a host, the network
between hosts); step 1 may gather on the source side like any reshard. The target arrays are
then assembled from the received buffers without a copy. `replica_mesh` stacks one mesh per host
into a mesh with a leading `replica` axis, and `local_replica` gives this process its replica as
an array on its own mesh (no copy).
"""
from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

REPLICA_AXIS = "replica"
_UNION_AXIS = "transfer"  # private: only the copy programs use it


def replica_mesh(meshes: list[Mesh]) -> Mesh:
    """One mesh of equal-shape meshes (one rollout replica per host), stacked along a leading
    `replica` axis: replica i is `meshes[i]`."""
    shapes = {tuple(m.devices.shape) for m in meshes}
    if len(shapes) != 1:
        raise ValueError(f"replica_mesh: the replicas' meshes differ in shape: {sorted(shapes)}")
    devices = np.stack([m.devices for m in meshes])
    return Mesh(devices, (REPLICA_AXIS,) + tuple(meshes[0].axis_names),
                axis_types=(jax.sharding.AxisType.Auto,) * devices.ndim)


def local_replica(x: jax.Array, local: NamedSharding) -> jax.Array:
    """This process's replica of `x` (on the replica mesh) as an array on `local` (its devices);
    the shards are the same buffers."""
    mine = set(local.mesh.devices.flat)
    shards = {s.device: s.data for s in x.addressable_shards if s.device in mine}
    if set(shards) != mine:
        raise ValueError("local_replica: the array has no shards on some of this process's replica devices")
    return jax.make_array_from_single_device_arrays(x.shape, local, [shards[d] for d in local.mesh.devices.flat])


@functools.lru_cache(maxsize=512)
def _cut_fn(src: NamedSharding, tgt: NamedSharding, shape: tuple, dtype, out_dtype):
    """Step 1: x -> [T, k, *shard] on the source devices (row i: the shards source i sends)."""
    src_devs = list(src.mesh.devices.flat)
    tgt_idx = list(tgt.devices_indices_map(shape).values())
    T, R = len(src_devs), len(tgt_idx)
    k = math.ceil(R / T)
    shard = tgt.shard_shape(shape)  # the same for every device (NamedSharding divides evenly)
    line = NamedSharding(Mesh(np.asarray(src_devs), (_UNION_AXIS,)), PartitionSpec(_UNION_AXIS))

    def cut(x):
        x = x.astype(out_dtype)
        zero = jnp.zeros(shard, out_dtype)
        rows = [jnp.stack([x[tgt_idx[r * T + i]] if r * T + i < R else zero for r in range(k)])
                for i in range(T)]
        return jnp.stack(rows)

    return jax.jit(cut, out_shardings=line), T, R, k, shard


@functools.lru_cache(maxsize=512)
def _send_fn(src_devs: tuple, tgt_devs: tuple, k: int, shard: tuple, dtype):
    """Step 2: [N, k, *shard] on the union (sources hold their rows) -> [N, *shard] (targets
    hold their shard) by `ppermute` rounds."""
    T, R = len(src_devs), len(tgt_devs)
    union = Mesh(np.asarray(src_devs + tgt_devs), (_UNION_AXIS,))
    spec = PartitionSpec(_UNION_AXIS)
    combine = jnp.logical_or if jnp.dtype(dtype) == jnp.bool_ else jnp.add

    def body(block):  # block [1, k, *shard]
        out = None
        for r in range(k):
            pairs = [(i, T + r * T + i) for i in range(T) if r * T + i < R]
            got = jax.lax.ppermute(block[:, r], _UNION_AXIS, perm=pairs)
            out = got if out is None else combine(out, got)
        return out

    fn = jax.shard_map(body, mesh=union, in_specs=spec, out_specs=spec)
    return jax.jit(fn, donate_argnums=(0,)), NamedSharding(union, spec)


def _transfer_leaf(x: jax.Array, target: NamedSharding, dtype) -> jax.Array:
    shape = tuple(x.shape)
    out_dtype = jnp.dtype(dtype) if dtype is not None and jnp.issubdtype(x.dtype, jnp.floating) else x.dtype
    cut, T, R, k, shard = _cut_fn(x.sharding, target, shape, x.dtype, out_dtype)
    rows = cut(x)
    src_devs = tuple(x.sharding.mesh.devices.flat)
    tgt_devs = tuple(target.devices_indices_map(shape))
    send, union_sharding = _send_fn(src_devs, tgt_devs, k, shard, out_dtype)
    mine = {s.device: s.data for s in rows.addressable_shards}
    pieces = [mine[d] if d in mine else jnp.zeros((1, k) + shard, out_dtype, device=d)
              for d in union_sharding.mesh.devices.flat if d.process_index == jax.process_index()]
    stacked = jax.make_array_from_single_device_arrays((T + R, k) + shard, union_sharding, pieces)
    got = send(stacked)
    recv = {s.device: s.data for s in got.addressable_shards}
    local = [recv[d].reshape(shard) for d in target.addressable_devices_indices_map(shape)]
    return jax.make_array_from_single_device_arrays(shape, target, local)


def transfer(tree: Any, target_shardings: Any, *, dtype: Any = None) -> Any:
    """Every leaf of `tree` on its target `NamedSharding`, whose devices must be disjoint from
    the leaf's (a different mesh, e.g. training -> rollout replicas), with floating-point leaves
    cast to `dtype` if given. A collective: every process calls it with the same trees, in the
    same order, and no other program may use these devices' collectives meanwhile."""
    leaves, treedef = jax.tree.flatten(tree)
    targets = jax.tree.leaves(target_shardings, is_leaf=lambda s: isinstance(s, NamedSharding))
    if len(targets) != len(leaves):
        raise ValueError(f"transfer: {len(leaves)} arrays but {len(targets)} target shardings")
    out = []
    for x, t in zip(leaves, targets):
        if not isinstance(x.sharding, NamedSharding) or set(x.sharding.device_set) & set(t.device_set):
            raise ValueError("transfer: source and target must be NamedShardings on disjoint devices "
                             "(use sharding.reshard on one device set)")
        out.append(_transfer_leaf(x, t, dtype))
    return jax.tree.unflatten(treedef, out)


__all__ = ["REPLICA_AXIS", "replica_mesh", "local_replica", "transfer"]
