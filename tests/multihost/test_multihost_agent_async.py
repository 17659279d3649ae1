"""Agent loops and the asynchronous (rollouter) mode on several processes: 2 processes x 4 CPU
devices, each host with its own rollout replica (engine + `RolloutServer` on its 4 devices,
weights resharded onto it from the training mesh that spans both hosts), against 1 process of 8
devices with one server on the training mesh. Same seeds: a row samples by (seed, row), so which
host runs it does not change its tokens.

What is compared: every metric a step logs (rollout lengths, rewards, the rollout log-probs'
difference to the trainer's, losses, grad norms, entropies, turn / tool counts, staleness and
policy versions), at rel 1e-4, except wall-clock ones and the few that describe one replica
rather than the batch (`_VOLATILE`). Response lengths, log-prob differences and grad norms at
step 2 (trained on rows generated with step 1's weights, moved to every replica by the sync)
differ if any token or weight differs.
"""
from __future__ import annotations

import sys
from pathlib import Path

import portpicker

from jaxrl_llm.config import load_config
from test_multihost_grpo import ROOT, _assert_same_metrics, _env, _metrics, _overrides, _run_all

TOOLS = f"{ROOT}/configs/quickstart_tools.py:tiny,local"
# wall-clock metrics (per agent loop and the rollouter's idle time) and per-replica ones: the
# KV cache one replica releases, the seconds a sync waited for the rollouter
_VOLATILE = ("agent/", "fully_async/rollouter/idle_ratio", "fully_async/trainer/idle_ratio",
             "colocate_async/kv_bytes_released", "rollout/sync_")
_AGENT_TIMING = ("generate_s/mean", "tool_calls_s/mean", "interaction_s/mean", "total_s/mean")


def _comparable(m: dict) -> dict:
    """The metrics without the volatile ones (agent/<loop>/count stays: rows per loop)."""
    keep = {}
    for k, v in m.items():
        if k.startswith("agent/") and not k.endswith(_AGENT_TIMING):
            keep[k] = v
        elif not k.startswith(_VOLATILE):
            keep[k] = v
    return keep


def _two_processes(config: str, run_dir: Path, tmp_path: Path, **extra) -> list[dict]:
    port = portpicker.pick_unused_port()
    cli = [sys.executable, "-m", "jaxrl_llm.train", f"--config={config}"] + [
        f"--config.{k}={v}" for k, v in _overrides(run_dir, **extra).items()]
    _run_all([cli + [f"--coordinator_address=localhost:{port}", "--num_processes=2", f"--process_id={i}"]
              for i in range(2)], _env(4), tmp_path)
    return _metrics(run_dir)


def _one_process(config: str, run_dir: Path, **extra) -> list[dict]:
    import jax

    from jaxrl_llm.trainer import RLTrainer

    assert jax.device_count() == 8 and jax.process_count() == 1
    RLTrainer(load_config(config, _overrides(run_dir, **extra))).fit()
    return _metrics(run_dir)


def _assert_same_steps(got: list[dict], want: list[dict]) -> None:
    assert len(got) == len(want) == 2, "only process 0 writes metrics, one line a step"
    for g, w in zip(got, want):
        _assert_same_metrics(_comparable(g), _comparable(w))


# the agent quickstart (tool_agent loop, calculator tool), 2 steps; a step's 8 prompts x n=2
# rows: rows 0-7 run on host 0's server, 8-15 on host 1's, then every host collates all 16
_AGENT = {"trainer.total_training_steps": 2, "trainer.save_freq": 0, "trainer.test_freq": 0}


def test_agent_loop_on_two_processes_matches_one_process(tmp_path):
    want = _one_process(TOOLS, tmp_path / "reference", **_AGENT)
    got = _two_processes(TOOLS, tmp_path / "run", tmp_path, **_AGENT)
    assert want[1]["actor/grad_norm"] > 0 and want[1]["num_turns/min"] >= 1
    _assert_same_steps(got, want)


# colocate_async with num_warmup_batches=0: each sync interval starts exactly the groups one step
# takes (batch b at step b), so which groups train at which step does not depend on timing; each
# host's rollouter runs the groups of index = its process index mod 2 and takes 4 of the 8
_ASYNC = {"trainer.v1.trainer_mode": "colocate_async", "trainer.v1.colocate_async.num_warmup_batches": 0.0,
          "trainer.total_training_steps": 2, "trainer.save_freq": 1, "trainer.max_to_keep": 2,
          "trainer.test_freq": 0}


def test_colocate_async_on_two_processes_matches_one_process(tmp_path):
    want = _one_process(f"{ROOT}/configs/quickstart.py:tiny,local", tmp_path / "reference", **_ASYNC)
    got = _two_processes(f"{ROOT}/configs/quickstart.py:tiny,local", tmp_path / "run", tmp_path, **_ASYNC)
    assert want[1]["rollout/policy_version"] == want[0]["rollout/policy_version"] + 1
    _assert_same_steps(got, want)
