"""Multi-controller JAX: one GRPO step on an 8-device mesh spread over 2 processes x 4 CPU devices
equals the same step in one process with 8 devices — with the local backend (every process runs
`python -m jaxrl_llm.train` with --coordinator_address/--num_processes/--process_id) and with the
Ray backend (one controller, 2 HostWorker actors that call jax.distributed.initialize). And
one-step-off-policy training with a rollout replica on each host equals it on one host.

Each run is a subprocess (XLA reads the device count once per process); the single-process
reference runs in-process on the 8 fake devices of tests/conftest.py.
"""
from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import portpicker
import pytest

from jaxrl_llm.config import load_config

ROOT = Path(__file__).resolve().parents[2]
CONFIG = f"{ROOT}/configs/quickstart.py:tiny,local"
REWARD_FN = ROOT / "tests" / "fixtures" / "rewards" / "length_parity.py"
TIMEOUT_S = 600
# wall-clock and hardware-dependent metrics; everything else must agree
VOLATILE = ("timing_s/", "timing_per_token_ms/", "perf/", "rollout/sync_time_s")


def _overrides(run_dir: Path, **extra) -> dict:
    o = {
        "trainer.default_local_dir": str(run_dir),
        "data.builtin_val_size": 0,  # no validation
        "trainer.progress_bar": False, "trainer.plot": False, "trainer.logger": "jsonl",
        "trainer.async_save": False, "trainer.export_hf": False,
        "trainer.val_before_train": False, "trainer.total_training_steps": 1,
        "sft.steps": 0, "rollout.max_concurrent_decodes": 16,
        "reward.custom_reward_function.path": str(REWARD_FN),
        "reward.custom_reward_function.name": "compute_score",
    }
    o.update(extra)
    return o


def _cli(run_dir: Path, **extra) -> list[str]:
    return [sys.executable, "-m", "jaxrl_llm.train", f"--config={CONFIG}"] + [
        f"--config.{k}={v}" for k, v in _overrides(run_dir, **extra).items()]


def _env(num_devices: int) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "JAX_COORDINATOR_ADDRESS")}
    flags = f"--xla_force_host_platform_device_count={num_devices} {os.environ.get('JAXRL_TEST_XLA_FLAGS', '')}"
    env.update(XLA_FLAGS=flags.strip(), JAX_PLATFORMS="cpu",
               TOKENIZERS_PARALLELISM="false", PYTHONPATH=str(ROOT))
    return env


def _run_all(cmds: list[list[str]], env: dict, log_dir: Path) -> None:
    """Starts every command at once, waits for all; on any failure shows each one's log tail."""
    procs = []
    for i, cmd in enumerate(cmds):
        log = open(log_dir / f"proc{i}.log", "w")
        procs.append((subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                       start_new_session=True), log))
    codes = []
    try:
        for p, _ in procs:
            codes.append(p.wait(timeout=TIMEOUT_S))
    finally:
        for p, log in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
            log.close()
    if any(codes):
        tails = "\n".join(f"--- process {i} (exit {c}) ---\n"
                          + (log_dir / f"proc{i}.log").read_text()[-4000:] for i, c in enumerate(codes))
        pytest.fail(f"a training process failed:\n{tails}")


def _metrics(run_dir: Path) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def _assert_same_metrics(got: dict, want: dict) -> None:
    keys = sorted(k for k in want if not k.startswith(VOLATILE))
    assert sorted(k for k in got if not k.startswith(VOLATILE)) == keys
    diffs = {k: (got[k], want[k]) for k in keys
             if not math.isclose(got[k], want[k], rel_tol=1e-4, abs_tol=1e-6)}
    assert not diffs, f"multi-process metrics differ from the single-process run: {diffs}"


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    """Step-1 metrics of the same job in this process, on its 8 devices."""
    import jax

    from jaxrl_llm.trainer import RLTrainer

    assert jax.device_count() == 8 and jax.process_count() == 1
    run_dir = tmp_path_factory.mktemp("reference")
    run = load_config(CONFIG, _overrides(run_dir))
    RLTrainer(run).fit()
    (metrics,) = _metrics(run_dir)
    assert metrics["actor/grad_norm"] > 0  # a step that really updates (non-constant rewards)
    return metrics


def test_two_processes_of_four_devices_match_one_process_of_eight(reference, tmp_path):
    run_dir, port = tmp_path / "run", portpicker.pick_unused_port()
    # export_hf exercises the collective gather of sharded weights (process 0 writes)
    cmds = [_cli(run_dir, **{"trainer.export_hf": True}) + [
        f"--coordinator_address=localhost:{port}", "--num_processes=2", f"--process_id={i}"]
        for i in range(2)]
    _run_all(cmds, _env(4), tmp_path)
    logged = _metrics(run_dir)
    assert len(logged) == 1, "only process 0 may write metrics"
    _assert_same_metrics(logged[0], reference)
    assert (run_dir / "checkpoints" / "1" / "state").is_dir()  # orbax multi-host save finished
    assert (run_dir / "hf_actor" / "config.json").is_file()
    assert (run_dir / "hf_actor" / "model.safetensors").is_file()


def test_ray_backend_with_two_host_actors_matches_one_process_of_eight(reference, tmp_path):
    run_dir = tmp_path / "run"
    # one controller; 2 actors of 4 fake devices each (the env is forwarded to the actors)
    _run_all([_cli(run_dir, **{"trainer.backend": "ray"}) + ["--num_hosts=2"]], _env(4), tmp_path)
    logged = _metrics(run_dir)
    assert len(logged) == 1
    _assert_same_metrics(logged[0], reference)
    assert (run_dir / "checkpoints" / "1" / "state").is_dir()


# separate placement, one-step-off: 4 training devices (fsdp), 4 rollout devices
_ONE_STEP_OFF = {"placement.mode": "separate", "placement.one_step_off_policy": True, "mesh.fsdp": 4,
                 "placement.rollout_mesh.tensor": 2, "trainer.total_training_steps": 3}


def test_one_step_off_policy_on_two_processes_matches_one_process(tmp_path):
    """2 processes x 4 devices: on each host 2 devices train (one fsdp=4 mesh over both hosts) and
    2 hold that host's rollout replica (tensor=2), which generates its half of the prompts while
    the actor trains; weights reach the replicas by `sharding.transfer`. One process of 8: the
    same training mesh and one engine of data=2 x tensor=2 (the two replicas as one). Step 3's
    rollout is the first made with trained weights (one update old), so equal metrics there
    mean the transferred weights are the trainer's."""
    from jaxrl_llm.trainer import RLTrainer

    ref_dir, run_dir = tmp_path / "reference", tmp_path / "run"
    RLTrainer(load_config(CONFIG, _overrides(ref_dir, **_ONE_STEP_OFF,
                                             **{"placement.rollout_mesh.data": 2}))).fit()
    want = _metrics(ref_dir)
    port = portpicker.pick_unused_port()
    cmds = [_cli(run_dir, **_ONE_STEP_OFF) + [
        f"--coordinator_address=localhost:{port}", "--num_processes=2", f"--process_id={i}"]
        for i in range(2)]
    _run_all(cmds, _env(4), tmp_path)
    got = _metrics(run_dir)
    assert len(got) == len(want) == 3
    assert [m["rollout/off_policy_steps"] for m in got] == [0.0, 1.0, 1.0]
    assert want[0]["actor/grad_norm"] > 0 and want[2]["rollout/logprob_abs_diff/mean"] > 1e-4
    for g, w in zip(got, want):
        _assert_same_metrics(g, w)
