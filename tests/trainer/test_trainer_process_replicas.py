"""rollout.replica_backend="process" in the trainer: the agent quickstart (tiny: 2 SFT steps, 2 RL steps)
with 2 rollout replicas, each a child process behind the router, and one child SIGKILLed during
step 1's rollout (at the end of a decode loop once it has admitted 4 requests: `_kill_child`).
The run completes; the router warns and counts the death and the restart; the logged metrics
(rollout lengths, scores, turn counts, the engine's log-probs against the trainer's, losses,
grad norms) and the trained weights equal those of the same run without the kill: the dead
child's requests re-ran on the other replica with the same (seed, row, step) keys (the engine's
log-probs of a re-prefilled session: to float32's last bits, see _ATOL).

Cost: two runs of 2 children each plus the restarted one (a child starts in about 3 s)."""
import functools
import json
import logging

import jax
import numpy as np
import pytest

from jaxrl_llm.config import ConfigError, load_config
from jaxrl_llm.trainer import RLTrainer
from jaxrl_llm.workers import HostWorker
from trainer_helpers import REWARD_FN, ROOT

import _kill_child

TOOLS = f"{ROOT}/configs/quickstart_tools.py:tiny,local"
PROCESS = {"rollout.replica_backend": "process", "rollout.replicas_per_host": 2}
# wall-clock metrics, and the router's per-replica counts (which replica ran what moves with the kill)
_VOLATILE = ("timing_s/", "timing_per_token_ms/", "perf/", "rollout/router/", "rollout/replica/", "rollout/sync_")
# The engine's log-probs of a session's later turn whose replica died: prefilled in full on the
# new replica, where the clean run reused the KV parked turn by turn; the two KV computations
# differ in float32's last bits, so a few log-probs differ by ~5e-7 (measured: 4 tokens of 2 rows
# at step 1, the tokens themselves all equal). The metrics comparing them to the trainer's get that
# slack; every other metric, and the weights (trained on the trainer's own log-probs), are exact.
_ATOL = {"logprob_abs_diff": 1e-6, "probs_diff": 1e-6}
_TIMING = ("/generate_s/mean", "/tool_calls_s/mean", "/interaction_s/mean", "/total_s/mean")


def _data(folder) -> dict:
    """Multiplication prompts with a simulated user (a wrong answer gets "try again": sessions of
    several turns) and the length-parity reward (rewards that differ within a group: a gradient);
    the overrides that use them."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder.mkdir(parents=True, exist_ok=True)
    pairs = [(10 + (7 * k) % 90, 10 + (13 * k) % 90) for k in range(16)]
    rows = [{"data_source": "arithmetic", "agent_name": "tool_agent",
             "prompt": [{"role": "user", "content": f"{a}*{b}="}], "ability": "arithmetic",
             "reward_model": {"style": "rule", "ground_truth": str(a * b)},
             "extra_info": {"index": i, "interaction_kwargs": {"name": "answer_check"}}}
            for i, (a, b) in enumerate(pairs)]
    pq.write_table(pa.Table.from_pylist(rows), folder / "train.parquet")
    (folder / "interaction.json").write_text(json.dumps({"interaction": [
        {"name": "answer_check", "class_name": "answer_check", "config": {"max_attempts": 3}}]}))
    return {"data.train_files": folder / "train.parquet",
            "rollout.multi_turn.interaction_config_path": folder / "interaction.json",
            "reward.custom_reward_function.path": REWARD_FN, "reward.custom_reward_function.name": "compute_score"}


def _config(run_dir, **extra):
    o = {**_data(run_dir.parent / "data"), "trainer.default_local_dir": str(run_dir), "trainer.progress_bar": False, "trainer.plot": False,
         "trainer.logger": "jsonl", "trainer.async_save": False, "trainer.save_freq": 0,
         "trainer.val_before_train": False, "trainer.test_freq": 0, **PROCESS, **extra}
    return load_config(TOOLS, [f"{k}={v}" for k, v in o.items()])


def _run(run_dir, monkeypatch, kill_after=None):
    """(metrics of every step, the trained actor params, what the router saw: the children's
    pids after start_rl, its stats and replicas at the end)."""
    start_rl, seen = HostWorker.start_rl, {}

    def armed(self, *args, **kwargs):
        out = start_rl(self, *args, **kwargs)
        seen["pids"] = [r.pid for r in self.server.replicas]
        if kill_after is not None:
            self.server.replicas[0].run_in_child(functools.partial(_kill_child.arm_kill, after=kill_after))
        return out

    armed.__name__ = "start_rl"  # the trainer calls worker methods by name
    monkeypatch.setattr(HostWorker, "start_rl", armed)
    trainer = RLTrainer(_config(run_dir))
    close = HostWorker.close

    def keep_stats(self):  # the router's counters and children, read before they are closed
        if self.server is not None:
            seen["stats"] = self.server.stats
            seen["children"] = list(self.server.replicas)
            seen["params"] = jax.tree.map(np.asarray, jax.device_get(self.actor.params))
        close(self)

    monkeypatch.setattr(HostWorker, "close", keep_stats)
    trainer.fit()
    monkeypatch.undo()
    metrics = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    return metrics, seen.pop("params"), seen


def _comparable(m: dict) -> dict:
    return {k: v for k, v in m.items() if not k.startswith(_VOLATILE) and not k.endswith(_TIMING)}


def test_a_run_goes_on_when_a_replica_process_is_killed_and_trains_as_without_the_kill(
        tmp_path, monkeypatch, caplog):
    want, want_params, clean = _run(tmp_path / "clean", monkeypatch)
    with caplog.at_level(logging.WARNING, logger="rollout._router"):
        got, got_params, killed = _run(tmp_path / "killed", monkeypatch, kill_after=4)
    assert len(got) == len(want) == 2
    # the kill happened and the router handled it: the child died, was restarted, nothing else died
    first = killed["children"][0]
    assert first.pid != killed["pids"][0] and killed["children"][1].pid == killed["pids"][1]
    assert killed["stats"]["dead_replicas"] == 1 and killed["stats"]["restarted_replicas"] == 1
    assert killed["stats"]["retried_requests"] >= 1
    assert clean["stats"].get("dead_replicas", 0) == 0 == clean["stats"].get("retried_requests", 0)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("replica 0 failed" in w and "restarting it" in w for w in warnings), warnings
    assert any("replica 0 restarted at policy version" in w for w in warnings), warnings
    # the step metrics show it: step 1 counts the death; the restart is back before step 2's
    # rollout (the sync waits for it), every replica then at the trainer's version
    assert got[0]["rollout/router/dead_replicas"] == 1 and got[0]["rollout/router/retried_requests"] >= 1
    assert got[1]["rollout/router/restarted_replicas"] == 1 and got[1]["rollout/router/live_replicas"] == 2
    assert got[1]["rollout/replica/0/policy_version"] == got[1]["rollout/replica/1/policy_version"]
    assert got[1]["rollout/replica/0/requests"] > 0  # the restarted child served step 2
    assert all(m["rollout/router/dead_replicas"] == 0 for m in want)
    # ... and changed nothing the run computed: every step's metrics and the trained weights
    assert want[1]["actor/grad_norm"] > 0 and want[0]["num_turns/max"] > 2
    # the children decode with the trainer's weights (they start on zeros: the syncs reached them)
    assert all(m["rollout/logprob_abs_diff/max"] < 1e-4 for m in want + got)
    for g, w in zip(got, want):
        g, w = _comparable(g), _comparable(w)
        assert g.keys() == w.keys()
        assert {k: (g[k], w[k]) for k in w if g[k] != pytest.approx(w[k], rel=0, abs=_ATOL.get(k.split("/")[1], 0))} == {}
    for a, b in zip(jax.tree.leaves(got_params), jax.tree.leaves(want_params)):
        np.testing.assert_array_equal(a, b)


def test_process_replicas_need_the_request_level_server(tmp_path):
    QUICK = f"{ROOT}/configs/quickstart.py:tiny,local"
    with pytest.raises(ConfigError, match=r"rollout.replica_backend='process' runs each replica's request-level"):
        load_config(QUICK, [f"trainer.default_local_dir={tmp_path}", "rollout.replica_backend=process"])
    with pytest.raises(ConfigError, match=r"rollout.replica_backend='thread' is not one of"):
        _config(tmp_path, **{"rollout.replica_backend": "thread"})
    with pytest.raises(ConfigError, match=r"rollout.replica_max_restarts must be >= 0"):
        _config(tmp_path, **{"rollout.replica_max_restarts": -1})
    with pytest.raises(ConfigError, match=r"rollout.replica_restart_backoff_s must be >= 0"):
        _config(tmp_path, **{"rollout.replica_restart_backoff_s": -0.5})
    with pytest.raises(ConfigError, match=r"rollout.replica_restart_backoff_s must be a finite number"):
        _config(tmp_path, **{"rollout.replica_restart_backoff_s": float("inf")})


def test_process_replicas_are_refused_off_cpu(tmp_path, monkeypatch):
    """A child cannot get devices of its own where the trainer's process claims every one."""
    import types

    c = _config(tmp_path / "run")
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    with pytest.raises(ConfigError, match=r"rollout.replica_backend='process' runs on one process on CPU"):
        HostWorker._start_process_replicas(types.SimpleNamespace(config=c), {})
