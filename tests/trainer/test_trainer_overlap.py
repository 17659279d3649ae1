"""One-step-off-policy overlap (rollout of step k+1 while step k trains) and a colocated rollout
mesh that re-meshes the training devices (fsdp training, tensor-parallel decode)."""
import json
import math
import time
import types

import jax
import numpy as np
import pytest

from jaxrl_llm.config import ConfigError, load_config
from jaxrl_llm.trainer import RLTrainer
from jaxrl_llm.workers import _host
from jaxrl_llm.workers import HostWorker
from trainer_helpers import QUICKSTART, param_checksum, tiny_overrides

_SEPARATE = {"mesh.fsdp": 4, "placement.mode": "separate", "placement.rollout_mesh.tensor": 4,
             "model.init.num_key_value_heads": 4, "data.max_response_length": 24}


def _record_calls(worker, names):
    """Wraps worker methods to log (name, start, end) of every call."""
    log = []
    for name in names:
        fn = getattr(worker, name)

        def wrapped(*a, _fn=fn, _name=name, **k):
            t0 = time.perf_counter()
            try:
                return _fn(*a, **k)
            finally:
                log.append((_name, t0, time.perf_counter()))
        setattr(worker, name, wrapped)
    return log


def test_one_step_off_policy_overlaps_rollout_with_training(tiny_run):
    run = tiny_run(**_SEPARATE, **{"placement.one_step_off_policy": True, "trainer.total_training_steps": 3,
                                   "algorithm.rollout_correction.rollout_is": "token"})
    trainer = RLTrainer(run)
    try:
        trainer.call0(HostWorker.start_rl, 3)
        host = trainer.group.workers[0]
        calls = _record_calls(host, ["generate", "update_actor", "sync_weights"])
        before = param_checksum(trainer)
        metrics = []
        for _ in range(3):
            metrics.append(trainer.train_step())
            if trainer.global_step == 1:  # with a rollout in flight, a checkpoint saves the data
                meta = trainer._meta()     # position from before its prompts were drawn
                assert meta["data"] == trainer.source._pending[2] != trainer.loader.get_state()
            trainer.global_step += 1
        assert trainer.source._pending is None  # the last step starts no rollout
        after = param_checksum(trainer)
    finally:
        trainer.close()
    assert after != before
    assert [m["rollout/off_policy_steps"] for m in metrics] == [0.0, 1.0, 1.0]
    # step 1 generated with the weights it trains from; steps 2-3 with the weights of one update
    # earlier, so the recomputed old log-probs differ from the rollout's
    assert metrics[0]["rollout/logprob_abs_diff/mean"] < 1e-4
    assert all(m["rollout/logprob_abs_diff/mean"] > 1e-4 for m in metrics[1:])
    assert all(math.isfinite(m["actor/pg_loss"]) for m in metrics)
    assert all("timing_s/gen_async" in m for m in metrics[1:])
    # rollout correction sees the stale rollouts: IS weights near 1, spread wider than on-policy
    assert all(abs(m["rollout_corr/rollout_is_mean"] - 1.0) < 1e-2 for m in metrics)
    assert all(m["rollout_corr/rollout_is_std"] > metrics[0]["rollout_corr/rollout_is_std"] for m in metrics[1:])
    gens = sorted((c for c in calls if c[0] == "generate"), key=lambda c: c[1])
    updates = sorted((c for c in calls if c[0] == "update_actor"), key=lambda c: c[1])
    assert len(gens) == 3 and len(updates) == 3
    for k in range(2):  # the rollout for step k+2 started before step k+1's update finished
        assert gens[k + 1][1] < updates[k][2]
    # weights are synced into the engine only while it is idle (no generate in flight)
    for name, t0, t1 in calls:
        if name == "sync_weights":
            assert not any(g0 < t0 < g1 or g0 < t1 < g1 for _, g0, g1 in gens)


def test_one_step_off_policy_fit_with_ray_backend(tmp_path):
    run = load_config(f"{QUICKSTART}:tiny", tiny_overrides(
        tmp_path / "run", **_SEPARATE, **{"placement.one_step_off_policy": True,
                                          "trainer.total_training_steps": 2, "trainer.export_hf": False}))
    assert run.trainer.backend == "ray"
    final = RLTrainer(run).fit()
    assert any(k.startswith("val-core/") for k in final)
    lines = [json.loads(x) for x in open(f"{run.trainer.default_local_dir}/metrics.jsonl")]
    steps = {x["training/global_step"]: x for x in lines if "actor/pg_loss" in x}
    assert steps[1]["rollout/off_policy_steps"] == 0.0 and steps[2]["rollout/off_policy_steps"] == 1.0
    assert np.isfinite(steps[2]["actor/grad_norm"])


def test_one_step_off_policy_needs_separate_placement_and_training_devices_on_every_host(tmp_path, tiny_run):
    with pytest.raises(ConfigError, match=r"placement.one_step_off_policy\) needs placement.mode='separate'"):
        load_config(f"{QUICKSTART}:tiny,local",
                    tiny_overrides(tmp_path / "run", **{"placement.one_step_off_policy": True}))
    # several hosts (tests/multihost runs them): every host gives rollout_mesh devices to its own
    # replica and the rest to training, so a replica may not take a whole host
    run = tiny_run(**_SEPARATE, **{"placement.one_step_off_policy": True})
    hosts = [types.SimpleNamespace(process_index=p, id=4 * p + i) for p in range(2) for i in range(4)]
    with pytest.raises(ValueError, match="rollout_mesh uses 4 devices per host but there are 4"):
        _host._split_separate(run, hosts)


def test_colocated_rollout_mesh_re_meshes_the_training_devices(tiny_run):
    run = tiny_run(**{"mesh.fsdp": 8, "placement.rollout_mesh.tensor": -1,
                      "model.init.num_key_value_heads": 8, "model.init.num_attention_heads": 8})
    trainer = RLTrainer(run)
    try:
        trainer.call0(HostWorker.start_rl, 1)
        host = trainer.group.workers[0]
        assert dict(host.mesh.shape) == {"data": 1, "fsdp": 8, "context": 1, "tensor": 1}
        assert dict(host.rollout_mesh.shape) == {"data": 1, "fsdp": 1, "context": 1, "tensor": 8}
        assert set(host.mesh.devices.flat) == set(host.rollout_mesh.devices.flat)
        # the engine's weights are split over heads/mlp/vocab (tensor), none over fsdp
        specs = [str(x.sharding.spec) for x in jax.tree.leaves(host.engine.params)]
        assert any("tensor" in s for s in specs) and not any("fsdp" in s for s in specs)
        metrics = trainer.train_step()
    finally:
        trainer.close()
    assert metrics["rollout/sync_zero_copy"] == 0.0 and metrics["rollout/sync_bytes_moved"] > 0
    assert metrics["rollout/logprob_abs_diff/mean"] < 1e-4 and math.isfinite(metrics["actor/pg_loss"])


def test_colocated_rollout_mesh_must_cover_the_training_devices(tiny_run):
    run = tiny_run(**{"mesh.fsdp": 8, "placement.rollout_mesh.tensor": 3})
    with pytest.raises(ValueError, match=r"placement.rollout_mesh \(colocated\) must cover the 8 training devices"):
        RLTrainer(run)
