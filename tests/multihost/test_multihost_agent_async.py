"""Agent loops and the asynchronous (rollouter) mode on several processes: 2 processes x 4 CPU
devices, each host with its own rollout replica (engine + `RolloutServer` on its 4 devices,
weights resharded onto it from the training mesh that spans both hosts), against 1 process of 8
devices with one server on the training mesh; the agent run also with the Ray backend (one
controller, 2 HostWorker actors). Same seeds: a row samples by (seed, row), so which
host runs it does not change its tokens.

What is compared: every metric a step logs (rollout lengths, rewards, the rollout log-probs'
difference to the trainer's, losses, grad norms, entropies, turn / tool counts, staleness and
policy versions), at rel 1e-4 (the same key set), except the wall-clock ones (`_VOLATILE`,
`_AGENT_TIMING`, and timing_s/ perf/ as test_multihost_grpo.py). There is no per-row dump, so
tokens are compared through these: response lengths, scores, turn counts, log-prob differences
and grad norms at step 2 (trained on rows generated with step 1's weights, moved to every
replica by the sync) differ if any token or weight differs (a seed off by one on one host fails
the agent test). The async test also checks each host's checkpointed rollouter state holds
its share of batch 2 and that a 2-process resume from step 1 repeats step 2.
"""
from __future__ import annotations

import sys
from pathlib import Path

import portpicker
import pytest

from jaxrl_llm.config import load_config
from test_multihost_grpo import ROOT, _assert_same_metrics, _env, _metrics, _overrides, _run_all

TOOLS = f"{ROOT}/configs/quickstart_tools.py:tiny,local"
# wall-clock metrics: the agent loops' seconds, the trainer's and the rollouter's idle
# ratios, the sync's seconds (the only metrics that differed between the runs)
_VOLATILE = ("fully_async/rollouter/idle_ratio", "fully_async/trainer/idle_ratio", "rollout/sync_time_s",
             "rollout/sync_wait_s", "rollout/sync_pause_wait_s")
_AGENT_TIMING = ("/generate_s/mean", "/tool_calls_s/mean", "/interaction_s/mean", "/total_s/mean")


def _comparable(m: dict) -> dict:
    return {k: v for k, v in m.items()
            if not k.startswith(_VOLATILE) and not (k.startswith("agent/") and k.endswith(_AGENT_TIMING))}


def _two_processes(config: str, run_dir: Path, log_dir: Path, **extra) -> list[dict]:
    log_dir.mkdir(exist_ok=True)
    port = portpicker.pick_unused_port()
    cli = [sys.executable, "-m", "jaxrl_llm.train", f"--config={config}"] + [
        f"--config.{k}={v}" for k, v in _overrides(run_dir, **extra).items()]
    _run_all([cli + [f"--coordinator_address=localhost:{port}", "--num_processes=2", f"--process_id={i}"]
              for i in range(2)], _env(4), log_dir)
    return _metrics(run_dir)


def _one_process(config: str, run_dir: Path, **extra) -> list[dict]:
    import jax

    from jaxrl_llm.trainer import RLTrainer

    assert jax.device_count() == 8 and jax.process_count() == 1
    RLTrainer(load_config(config, _overrides(run_dir, **extra))).fit()
    return _metrics(run_dir)


def _assert_same_steps(got: list[dict], want: list[dict]) -> None:
    assert len(got) == len(want), "only process 0 writes metrics, one line a step"
    for g, w in zip(got, want):
        _assert_same_metrics(_comparable(g), _comparable(w))


# the agent quickstart (tool_agent loop, calculator tool), 2 steps; a step's 8 prompts x n=2
# rows: rows 0-7 run on host 0's server, 8-15 on host 1's, then every host collates all 16
_AGENT = {"trainer.total_training_steps": 2, "trainer.save_freq": 0, "trainer.test_freq": 0}


def _multi_turn_data(folder: Path) -> dict:
    """The quickstart's multiplication prompts with a simulated user (`answer_check`: a wrong
    answer gets "try again" and another turn), so the untrained model's trajectories have
    several turns (sessions on one server); overrides that use them."""
    import json

    import pyarrow as pa
    import pyarrow.parquet as pq

    pairs = [(10 + (7 * k) % 90, 10 + (13 * k) % 90) for k in range(32)]
    rows = [{"data_source": "arithmetic", "agent_name": "tool_agent",
             "prompt": [{"role": "user", "content": f"{a}*{b}="}], "ability": "arithmetic",
             "reward_model": {"style": "rule", "ground_truth": str(a * b)},
             "extra_info": {"index": i, "interaction_kwargs": {"name": "answer_check"}}}
            for i, (a, b) in enumerate(pairs)]
    pq.write_table(pa.Table.from_pylist(rows), folder / "train.parquet")
    (folder / "interaction.json").write_text(json.dumps({"interaction": [
        {"name": "answer_check", "class_name": "answer_check", "config": {"max_attempts": 3}}]}))
    return {"data.train_files": folder / "train.parquet",
            "rollout.multi_turn.interaction_config_path": folder / "interaction.json"}


@pytest.fixture(scope="module")
def agent_reference(tmp_path_factory) -> tuple[dict, list[dict]]:
    """(overrides, metrics) of the agent run in this process: 8 devices, one replica."""
    folder = tmp_path_factory.mktemp("agent")
    o = {**_AGENT, **_multi_turn_data(folder)}
    return o, _one_process(TOOLS, folder / "reference", **o)


def test_agent_loop_on_two_processes_matches_one_process(tmp_path, agent_reference):
    o, want = agent_reference
    got = _two_processes(TOOLS, tmp_path / "run", tmp_path / "logs", **o)
    assert want[1]["actor/grad_norm"] > 0 and want[1]["num_turns/max"] > 2  # several turns (a single answer counts 2)
    _assert_same_steps(got, want)
    # the Ray backend: one controller, 2 HostWorker actors of 4 devices, the same worker code
    ray_dir, logs = tmp_path / "ray", tmp_path / "logs-ray"
    logs.mkdir()
    cli = [sys.executable, "-m", "jaxrl_llm.train", f"--config={TOOLS}", "--num_hosts=2"] + [
        f"--config.{k}={v}" for k, v in _overrides(ray_dir, **o, **{"trainer.backend": "ray"}).items()]
    _run_all([cli], _env(4), logs)
    _assert_same_steps(_metrics(ray_dir), want)


def _routed(key: str) -> bool:
    """The router's metrics, and the weight sync's stats, which add up over the replicas (each
    gets its own copy; one replica on the training mesh shares its buffers: zero-copy)."""
    return key.startswith(("rollout/replica/", "rollout/router/", "rollout/sync_"))


def test_agent_loop_on_several_replicas_per_host_matches_one_replica(tmp_path, agent_reference):
    """rollout.replicas_per_host=2: 2 replicas of 4 devices behind the router on one process, and
    2 of 2 devices on each of 2 processes (4 in all), give the one-replica run's metrics (a row
    samples by (seed, row) on whichever replica the router picks); the router's metrics come
    with every step: each replica took requests, every later turn of a session went to its
    replica (stickiness 1), nothing died."""
    o, want = agent_reference
    two = {**o, "rollout.replicas_per_host": 2}
    one_proc = _one_process(TOOLS, tmp_path / "one", **two)
    two_proc = _two_processes(TOOLS, tmp_path / "two", tmp_path / "logs", **two)
    for got, replicas in ((one_proc, 2), (two_proc, 4)):
        _assert_same_steps(*([{k: v for k, v in m.items() if not _routed(k)} for m in ms] for ms in (got, want)))
        for m in got:
            assert sorted({k.split("/")[2] for k in m if k.startswith("rollout/replica/")}) == \
                [str(i) for i in range(replicas)]
            assert all(m[f"rollout/replica/{i}/requests"] > 0 for i in range(replicas))
            assert m["rollout/router/live_replicas"] == replicas and m["rollout/router/dead_replicas"] == 0
            assert m["rollout/router/stickiness"] == 1.0 and m["rollout/router/imbalance_requests"] >= 1.0


# colocate_async with num_warmup_batches=0: each sync interval starts exactly the groups one step
# takes (batch b at step b), so which groups train at which step does not depend on timing; each
# host's rollouter runs the groups of index = its process index mod 2 and takes 4 of the 8
_ASYNC = {"trainer.v1.trainer_mode": "colocate_async", "trainer.v1.colocate_async.num_warmup_batches": 0.0,
          "trainer.total_training_steps": 2, "trainer.save_freq": 1, "trainer.max_to_keep": 2,
          "trainer.test_freq": 0}
QUICKSTART = f"{ROOT}/configs/quickstart.py:tiny,local"


def test_colocate_async_on_two_processes_matches_one_process_and_resumes(tmp_path):
    """Also a resume on 2 processes from step 1's checkpoint (each host's queue and unfinished
    prompts: batch 2's groups, started after step 1's sync) gives step 2 as both runs had it."""
    import json

    want = _one_process(QUICKSTART, tmp_path / "reference", **_ASYNC)
    got = _two_processes(QUICKSTART, tmp_path / "run", tmp_path / "logs", **_ASYNC)
    assert len(want) == 2 and want[1]["rollout/policy_version"] == want[0]["rollout/policy_version"] + 1
    _assert_same_steps(got, want)
    meta = json.loads((tmp_path / "run" / "checkpoints" / "1" / "meta" / "metadata").read_text())
    hosts = meta["fully_async"]["hosts"]  # each host's rollouter state, its share of batch 2
    assert [sorted(p["index"] % 2 for p in h["pending"]) for h in hosts] == [[0] * 4, [1] * 4]
    resumed = _two_processes(QUICKSTART, tmp_path / "run", tmp_path / "logs-resume",
                             **{**_ASYNC, "trainer.resume_mode": str(tmp_path / "run" / "checkpoints" / "1")})
    assert "resumed from" in (tmp_path / "logs-resume" / "proc0.log").read_text()
    # the resume sets the rows after step 1 aside and logs step 2 again
    assert [m["training/global_step"] for m in resumed] == [1, 2]
    _assert_same_steps(resumed[1:], want[1:])


def test_colocate_async_with_two_replicas_matches_one(tmp_path):
    """colocate_async through the router (hold: every replica asleep over the update; sync and
    wake fanned out; each replica's held requests re-prefilled) on one process: the one-replica
    run's metrics, and both replicas at the trainer's policy version."""
    o = {**_ASYNC, "trainer.save_freq": 0}
    want = _one_process(QUICKSTART, tmp_path / "one", **o)
    got = _one_process(QUICKSTART, tmp_path / "two", **o, **{"rollout.replicas_per_host": 2})
    _assert_same_steps(*([{k: v for k, v in m.items() if not _routed(k)} for m in ms] for ms in (got, want)))
    for m in got:
        assert m["colocate_async/kv_bytes_released"] > 0
        assert m["rollout/replica/0/policy_version"] == m["rollout/replica/1/policy_version"] \
            == m["rollout/policy_version"]


# separate_async (configs/quickstart_async.py, the fully async quickstart) without run-ahead:
# num_warmup_batches=0 lets the rollouter start exactly one step's groups per sync interval
# (batch b at step b, generated with the weights of sync b-1), so which groups train at which
# step does not depend on timing. That needs partial_rollout off (the config's check: with no
# run-ahead no request is in flight at a sync). With run-ahead (the quickstart's 0.5) more groups
# run than a step takes, a take hands out the first to finish, and a group running at a sync goes
# on with the new weights: which step trains a group and its tokens' policy versions depend on how
# fast each host decodes, so 1 process of 8 and 2 of 4 could differ by timing, not bugs.
# Separate placement as the one-step-off test: 4 training devices (fsdp=4 over both hosts) and 2
# per host for that host's replica (tensor=2); 1 process: one engine of data=2 x tensor=2.
ASYNC_QUICKSTART = f"{ROOT}/configs/quickstart_async.py:tiny,local"
_SEPARATE_ASYNC = {"trainer.v1.colocate_async.num_warmup_batches": 0.0, "async_training.partial_rollout": False,
                   "trainer.total_training_steps": 2, "trainer.save_freq": 0, "trainer.test_freq": 0,
                   "mesh.fsdp": 4, "placement.rollout_mesh.tensor": 2}


def test_separate_async_on_two_processes_matches_one_process(tmp_path):
    """Each host's rollouter runs its half of the groups on its own replica while the actor
    trains on the 4 training devices; step 2 trains groups generated with step 1's weights,
    moved to every replica by `sharding.transfer`."""
    want = _one_process(ASYNC_QUICKSTART, tmp_path / "reference",
                        **_SEPARATE_ASYNC, **{"placement.rollout_mesh.data": 2})
    got = _two_processes(ASYNC_QUICKSTART, tmp_path / "run", tmp_path / "logs", **_SEPARATE_ASYNC)
    assert len(want) == 2 and want[1]["rollout/policy_version"] == want[0]["rollout/policy_version"] + 1
    assert want[1]["actor/grad_norm"] > 0 and want[1]["rollout/logprob_abs_diff/mean"] > 0
    _assert_same_steps(got, want)
