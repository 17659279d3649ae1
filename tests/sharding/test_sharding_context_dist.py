"""Activation constraints by logical name, multi-host env resolution, host-local batches."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import sharding
from sharding import DistributedSpec


def test_constrain_is_identity_without_context():
    x = jnp.ones((8, 4))
    assert sharding.current_mesh() is None
    assert sharding.constrain(x, ("batch", "embed")) is x


def test_constrain_applies_inside_jit_with_context():
    mesh = sharding.make_mesh((1, 2, 4))

    def f(x):
        return sharding.constrain(x * 2.0, ("batch", "length", "heads"))

    x = jnp.ones((4, 3, 8))
    with sharding.use_rules(mesh, "train"):
        assert sharding.current_mesh() is mesh
        assert sharding.current_rules() is sharding.TRAIN_RULES
        y = jax.jit(f)(x)
        hlo = jax.jit(f).lower(x).as_text()
    assert sharding.current_mesh() is None
    assert y.sharding.is_equivalent_to(NamedSharding(mesh, P(("data", "fsdp"), None, "tensor")), 3)
    assert "sharding" in hlo
    np.testing.assert_array_equal(y, 2.0 * np.ones((4, 3, 8)))
    # the same function traced without the context carries no constraint (no stale trace)
    assert "sharding_constraint" not in jax.jit(f).lower(x).as_text()


def test_switching_rules_on_one_mesh_retraces():
    mesh = sharding.make_mesh((1, 2, 4))

    def f(x):
        return sharding.constrain(x + 1.0, (None, None, "embed"))

    x = jnp.ones((4, 3, 8))
    with sharding.use_rules(mesh, "rollout"):
        rollout_hlo = jax.jit(f).lower(x).as_text()
    with sharding.use_rules(mesh, "train"):
        train_hlo = jax.jit(f).lower(x).as_text()
        y = jax.jit(f)(x)
    assert '{"fsdp"}' in train_hlo and '{"fsdp"}' not in rollout_hlo
    assert y.sharding.is_equivalent_to(NamedSharding(mesh, P(None, None, "fsdp")), 3)


def test_use_rules_works_inside_jit():
    mesh = sharding.make_mesh((2, 1, 4))

    def g(x):
        with sharding.use_rules(mesh, "train"):
            return sharding.constrain(x * 3.0, ("batch", "heads"))

    y = jax.jit(g)(jnp.ones((4, 8)))
    assert y.sharding.is_equivalent_to(NamedSharding(mesh, P("data", "tensor")), 2)


def test_constrain_rank_mismatch_is_an_error():
    mesh = sharding.make_mesh((8, 1, 1))
    with sharding.use_rules(mesh, sharding.ROLLOUT_RULES):
        with pytest.raises(ValueError, match=r"have 2 entries but the array has shape \(8,\)"):
            sharding.constrain(jnp.ones(8), ("batch", "embed"))


def test_use_rules_nests_and_restores():
    outer, inner = sharding.make_mesh((8, 1, 1)), sharding.make_mesh((1, 1, 8))
    with sharding.use_rules(outer, "train"):
        with sharding.use_rules(inner, "rollout"):
            assert sharding.current_mesh() is inner
        assert sharding.current_mesh() is outer


SLURM = {"SLURM_NTASKS": "4", "SLURM_PROCID": "2", "SLURM_JOB_NODELIST": "gpu[07-09,12]"}


@pytest.mark.parametrize("env, expected", [
    (SLURM, DistributedSpec("slurm", "gpu07:12345", 4, 2)),
    ({**SLURM, "JAXRL_COORDINATOR_PORT": "2222"}, DistributedSpec("slurm", "gpu07:2222", 4, 2)),
    ({"SLURM_JOB_NUM_NODES": "2", "SLURM_PROCID": "1", "SLURM_NODELIST": "a1,b2"},
     DistributedSpec("slurm", "a1:12345", 2, 1)),
    ({"TPU_WORKER_HOSTNAMES": "t0,t1,t2,t3", "TPU_WORKER_ID": "1"}, DistributedSpec("tpu", auto=True)),
    ({"TPU_ACCELERATOR_TYPE": "v5p-64"}, DistributedSpec("tpu", auto=True)),
    ({"JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "0"},
     DistributedSpec("env", "10.0.0.1:1234", 2, 0)),
])
def test_resolve_distributed_env_sources(env, expected):
    assert sharding.resolve_distributed_env(env) == expected


@pytest.mark.parametrize("env", [
    {},
    {"HOME": "/root", "SLURM_JOB_ID": "5"},  # salloc shell, no srun task
    {"SLURM_NTASKS": "1", "SLURM_PROCID": "0", "SLURM_JOB_NODELIST": "n1"},
    {"TPU_WORKER_HOSTNAMES": "localhost", "TPU_ACCELERATOR_TYPE": "v4-8"},
])
def test_resolve_distributed_env_single_host_is_none(env):
    assert sharding.resolve_distributed_env(env) is None


def test_explicit_arguments_win_over_environment():
    spec = sharding.resolve_distributed_env(SLURM, coordinator_address="h:1", num_processes=8,
                                            process_id=5, local_device_ids=[0, 1])
    assert spec == DistributedSpec("explicit", "h:1", 8, 5, (0, 1))
    partial = sharding.resolve_distributed_env(SLURM, coordinator_address="head:9")
    assert partial == DistributedSpec("slurm", "head:9", 4, 2)
    assert partial.initialize_kwargs() == {"coordinator_address": "head:9", "num_processes": 4,
                                           "process_id": 2}


def test_partial_explicit_without_cluster_names_missing_fields():
    with pytest.raises(ValueError, match=r"\['num_processes', 'process_id'\]"):
        sharding.resolve_distributed_env({}, coordinator_address="h:1")


def test_bad_env_values_are_named():
    with pytest.raises(ValueError, match=r"SLURM_PROCID='x' is not an integer"):
        sharding.resolve_distributed_env({**SLURM, "SLURM_PROCID": "x"})
    with pytest.raises(ValueError, match=r"\['JAX_PROCESS_ID'\] are not"):
        sharding.resolve_distributed_env({"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "2"})


@pytest.mark.parametrize("nodelist, hosts", [
    ("node[01-03,07]", ["node01", "node02", "node03", "node07"]),
    ("a1,b[2-3]", ["a1", "b2", "b3"]),
    ("r[1-2]-n[9-10]", ["r1-n9", "r1-n10", "r2-n9", "r2-n10"]),
    ("solo", ["solo"]),
])
def test_expand_hostlist(nodelist, hosts):
    assert sharding.expand_hostlist(nodelist) == hosts


def test_initialize_distributed_is_a_noop_on_single_host(monkeypatch):
    for key in list(__import__("os").environ):
        if key.startswith(("SLURM_", "TPU_", "JAX_COORDINATOR", "JAX_NUM_PROC", "JAX_PROCESS")):
            monkeypatch.delenv(key)
    calls = []
    monkeypatch.setattr(jax.distributed, "initialize", lambda *a, **k: calls.append(k))
    assert sharding.initialize_distributed() is False
    assert sharding.initialize_distributed() is False
    assert calls == [] and jax.process_count() == 1


def test_initialize_distributed_passes_resolved_spec_once(monkeypatch):
    from sharding import _distributed
    calls = []
    monkeypatch.setattr(jax.distributed, "initialize", lambda *a, **k: calls.append(k))
    monkeypatch.setattr(_distributed, "_STATE", {"initialized": False})
    for key, value in SLURM.items():
        monkeypatch.setenv(key, value)
    assert sharding.initialize_distributed() is True
    assert sharding.initialize_distributed() is True
    assert calls == [{"coordinator_address": "gpu07:12345", "num_processes": 4, "process_id": 2}]


def test_global_batch_sharding_and_host_local_to_global():
    mesh = sharding.make_mesh((2, 2, 2))
    s = sharding.global_batch_sharding(mesh, "train", ndim=2)
    assert s.spec == P(("data", "fsdp"), None)
    rows = sharding.process_batch_slice(8)
    assert rows == slice(0, 8)
    local = {"input_ids": np.arange(8 * 5).reshape(8, 5)[rows], "mask": np.ones((8,), bool)}
    leading = sharding.global_batch_sharding(mesh, "train", ndim=1)  # fits leaves of any rank
    batch = sharding.host_local_to_global(mesh, leading.spec, local)
    assert batch["input_ids"].shape == (8, 5) and batch["mask"].shape == (8,)
    assert batch["input_ids"].sharding.is_equivalent_to(s, 2)
    assert batch["input_ids"].addressable_shards[0].data.shape == (2, 5)
    np.testing.assert_array_equal(batch["input_ids"], local["input_ids"])


def test_process_batch_slice_splits_rows_by_process():
    assert sharding.process_batch_slice(12, process_index=2, process_count=4) == slice(6, 9)
    with pytest.raises(ValueError, match=r"global batch size 10 is not divisible .* \(4\)"):
        sharding.process_batch_slice(10, process_index=0, process_count=4)
