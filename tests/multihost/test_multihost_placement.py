"""Multi-host plumbing without starting processes: where Ray host actors go, how the cluster
environment resolves, and the driver's multi-host-safe host reads."""
from __future__ import annotations

import os
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


# -- agent loops and the async modes on several hosts (the pieces that need no second process) --

def _run_config(tmp_path, **extra):
    from jaxrl_llm.config import load_config

    o = {"trainer.default_local_dir": str(tmp_path / "run"), **extra}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return load_config(f"{root}/configs/quickstart.py:tiny,local", [f"{k}={v}" for k, v in o.items()])


def test_async_mode_needs_a_batch_that_splits_over_the_processes(tmp_path):
    from jaxrl_llm.config import ConfigError
    from jaxrl_llm.workers import _host

    run = _run_config(tmp_path, **{"trainer.v1.trainer_mode": "colocate_async"})  # train_batch_size 8
    _host._check_rollouter_split(run, 2)
    with pytest.raises(ConfigError, match=r"data.train_batch_size=8 must be a multiple of the 3 processes in "
                                          r"trainer.v1.trainer_mode='colocate_async'"):
        _host._check_rollouter_split(run, 3)
    _host._check_rollouter_split(_run_config(tmp_path), 3)  # the synchronous trainer splits rows, not groups


def test_colocated_replica_shape_is_checked_per_host(tmp_path):
    from jaxrl_llm.workers import _host

    devices = [types.SimpleNamespace(process_index=i // 4) for i in range(8)]
    run = _run_config(tmp_path, **{"rollout.multi_turn.enable": True, "placement.rollout_mesh.data": 3})
    with pytest.raises(ValueError, match=r"each host holds one replica of data/2 x fsdp x tensor = 4 devices"):
        _host._colocated_replicas(run, devices)
    # the batch rollout of a colocated run keeps its SPMD engine on the training mesh: no replicas
    assert _host._rollout_replicas(_run_config(tmp_path), devices) is None


def _group(index):
    return {"prompt": {"index": index, "sample": {}, "seed": 1, "first_row": 0, "n": 2},
            "results": [], "started_version": 3}


def test_async_state_merges_per_host_and_splits_for_another_host_count():
    from jaxrl_llm.workers import _host

    def host_state(me):
        return {"queued": [_group(me)], "pending": [{"index": i} for i in (me + 2, me + 4)],
                "consumed_since_sync": 2, "taken": 4, "deterministic": True,
                "counters": {"groups_started": 3, "groups_failed": me},
                "window": {"gen_tokens": 10, "dropped_staleness_max": 1 + me}, "policy_version": 3}

    hosts = [host_state(0), host_state(1)]
    merged = _host._merge_async_states(hosts)
    assert [p["index"] for p in merged["pending"]] == [2, 3, 4, 5]  # by index, as one host keeps them
    assert len(merged["queued"]) == 2 and merged["consumed_since_sync"] == 4 and merged["taken"] == 8
    assert merged["counters"] == {"groups_started": 6, "groups_failed": 1}
    assert merged["window"]["gen_tokens"] == 20 and merged["window"]["dropped_staleness_max"] == 2
    assert merged["hosts"] == hosts and merged["policy_version"] == 3
    # resumed on one process: everything; on 2 processes by another split rule: index mod 2
    one = _host._split_async_state(merged, 0, 1)
    assert [p["index"] for p in one["pending"]] == [2, 3, 4, 5] and one["counters"] == merged["counters"]
    second = _host._split_async_state(merged, 1, 2)
    assert [p["index"] for p in second["pending"]] == [3, 5] and second["counters"] == {}
    assert [g["prompt"]["index"] for g in second["queued"]] == [1]
    assert one["taken"] == 8 and second["taken"] == 4  # the deterministic schedule's take count
    assert merged["deterministic"] and one["deterministic"] and second["deterministic"]


def test_replicas_per_host_split_the_data_axis_and_are_checked(tmp_path):
    from jaxrl_llm.config import ConfigError
    from jaxrl_llm.workers import _host

    mesh = sharding.make_mesh(sharding.MeshConfig(4, 1, 2), devices=jax.devices()[:8])
    parts = _host._split_replica(mesh, 2)
    assert [p.devices.shape for p in parts] == [(2, 1, 1, 2)] * 2 and parts[0].axis_names == mesh.axis_names
    assert [d.id for p in parts for d in p.devices.flat] == [d.id for d in mesh.devices.flat]
    with pytest.raises(ValueError, match=r"rollout.replicas_per_host=3 must divide the data axis"):
        _host._split_replica(mesh, 3)
    with pytest.raises(ConfigError, match=r"rollout.replicas_per_host=2 needs the request-level server"):
        _run_config(tmp_path, **{"rollout.replicas_per_host": 2})
    with pytest.raises(ConfigError, match=r"max_concurrent_decodes=15 must be a multiple of rollout.replicas_per_host=2"):
        _run_config(tmp_path, **{"rollout.replicas_per_host": 2, "rollout.multi_turn.enable": True,
                                 "rollout.max_concurrent_decodes": 15})
