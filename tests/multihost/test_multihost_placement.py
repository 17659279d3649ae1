"""Multi-host plumbing without starting processes: where Ray host actors go, how the cluster
environment resolves, and the driver's multi-host-safe host reads."""
from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sharding
from jaxrl_llm.trainer import _backend


def _fake_ray(nodes):
    return types.SimpleNamespace(nodes=lambda: nodes)


def _id(i: int) -> str:
    return f"{i:056x}"  # Ray node ids are 28-byte hex strings


def _node(i, alive=True, host=True):
    res = {"CPU": 8.0, **({_backend.HOST_RESOURCE: 1.0} if host else {})}
    return {"NodeID": _id(i), "NodeManagerAddress": f"10.0.0.{i}", "Alive": alive, "Resources": res}


def test_one_actor_per_tagged_node_in_address_order():
    nodes = [_node(2), _node(1), _node(3, host=False), _node(4, alive=False)]
    placements = _backend.host_placements(_fake_ray(nodes), 2)
    assert [p["scheduling_strategy"].node_id for p in placements] == [_id(1), _id(2)]
    assert all(p["resources"] == {_backend.HOST_RESOURCE: 1} for p in placements)


def test_untagged_cluster_uses_alive_nodes_and_single_node_holds_all():
    placements = _backend.host_placements(_fake_ray([_node(1, host=False), _node(2, host=False)]), 2)
    assert [p["scheduling_strategy"].node_id for p in placements] == [_id(1), _id(2)]
    assert "resources" not in placements[0]
    placements = _backend.host_placements(_fake_ray([_node(1, host=False)]), 2)
    assert [p["scheduling_strategy"].node_id for p in placements] == [_id(1), _id(1)]
    assert _backend.host_placements(_fake_ray([]), 1) == [{}]


def test_too_few_nodes_is_a_clear_error():
    with pytest.raises(ValueError, match=r"num_hosts=3 but the Ray cluster has 2 nodes with the 'jaxrl_host'"):
        _backend.host_placements(_fake_ray([_node(1), _node(2)]), 3)


def test_jaxrl_distributed_auto_defers_to_jax_detection():
    spec = sharding.resolve_distributed_env({"JAXRL_DISTRIBUTED": "auto"})
    assert spec.auto and spec.initialize_kwargs() == {}
    assert sharding.resolve_distributed_env({}) is None
    with pytest.raises(ValueError, match="JAXRL_DISTRIBUTED='yes'"):
        sharding.resolve_distributed_env({"JAXRL_DISTRIBUTED": "yes"})
    # SLURM still wins over the fallback
    spec = sharding.resolve_distributed_env({"JAXRL_DISTRIBUTED": "auto", "SLURM_PROCID": "1",
                                             "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "n[1-2]"})
    assert (spec.source, spec.process_id) == ("slurm", 1)


def test_host_read_of_sharded_and_replicated_arrays():
    mesh = sharding.make_mesh(sharding.MeshConfig(1, 8, 1))
    x = np.arange(32, dtype=np.int32).reshape(16, 2)
    sharded = jax.device_put(x, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("fsdp")))
    np.testing.assert_array_equal(sharding.to_host(sharded), x)
    np.testing.assert_array_equal(sharding.to_host(jnp.int32(3)), 3)
    np.testing.assert_array_equal(sharding.to_host(x), x)
