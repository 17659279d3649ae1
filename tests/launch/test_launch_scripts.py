"""Each launch script's `--help` works and its `--dry-run` prints exactly the commands it would run.

The scripts print one `+ <command>` line per command, quoted for a POSIX shell, so the tests
parse them with `shlex.split` and check the arguments that matter.
"""
from __future__ import annotations

import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TPU = ROOT / "scripts" / "tpu" / "launch.sh"
SBATCH = ROOT / "scripts" / "gpu" / "slurm.sbatch"
GPU = ROOT / "scripts" / "gpu" / "launch.sh"
RAY = ROOT / "scripts" / "ray" / "cluster.sh"


def _run(script: Path, *args: str, env: dict | None = None, ok: bool = True) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    full_env.update(env or {})
    res = subprocess.run(["bash", str(script), *args], capture_output=True, text=True, env=full_env,
                         cwd=ROOT, timeout=60)
    if ok:
        assert res.returncode == 0, res.stderr
    return res


def _commands(stdout: str) -> list[list[str]]:
    return [shlex.split(line[2:]) for line in stdout.splitlines() if line.startswith("+ ")]


def _flag(cmd: list[str], name: str) -> str:
    (value,) = [a.split("=", 1)[1] for a in cmd if a.startswith(f"{name}=")]
    return value


def _remote(cmd: list[str]) -> str:
    return _flag(cmd, "--command")


@pytest.mark.parametrize("script", [TPU, SBATCH, GPU, RAY], ids=lambda p: p.name)
def test_every_script_has_help(script):
    res = _run(script, "--help")
    assert "--dry-run" in res.stdout and len(res.stdout.splitlines()) > 5


@pytest.fixture
def tpu_config(tmp_path):
    def make(**over):
        values = dict(TPU_NAME="t1", PROJECT="proj", ZONE="us-east5-a", ACCELERATOR_TYPE="v5p-16",
                      RUNTIME_VERSION="v2-alpha-tpuv5", QUEUED="0", CONFIG="configs/grpo_gsm8k.py",
                      OVERRIDES="--config.mesh.fsdp=-1 --config.model.path=/data/m")
        values.update(over)
        path = tmp_path / "tpu.env"
        path.write_text("".join(f"{k}={shlex.quote(v)}\n" for k, v in values.items()))
        return str(path)
    return make


def test_tpu_up_creates_installs_on_all_workers_and_runs_the_same_command(tpu_config):
    res = _run(TPU, "-c", tpu_config(), "--dry-run", "up", "--", "--config.actor.optim.lr=1e-6")
    cmds = _commands(res.stdout)
    create, tar, scp, install, start, logs = cmds
    assert create[:5] == ["gcloud", "compute", "tpus", "tpu-vm", "create"] and create[5] == "t1"
    assert _flag(create, "--accelerator-type") == "v5p-16" and _flag(create, "--zone") == "us-east5-a"
    assert _flag(create, "--project") == "proj" and _flag(create, "--version") == "v2-alpha-tpuv5"
    assert tar[0] == "tar" and scp[:5] == ["gcloud", "compute", "tpus", "tpu-vm", "scp"]
    for c in (scp, install, start):
        assert "--worker=all" in c
    assert "pip install" in _remote(install) and ".[tpu]" in _remote(install)
    # the training command, unwrapped from `nohup bash -c '<train>' > log &`
    nohup = shlex.split(_remote(start))
    assert nohup[:3] == ["nohup", "bash", "-c"] and nohup[-1] == "&"
    train = shlex.split(nohup[3])
    assert "JAXRL_DISTRIBUTED=auto" in train
    i = train.index("-m")
    assert train[i + 1] == "jaxrl_llm.train"
    assert train[i + 2:] == ["--config=configs/grpo_gsm8k.py", "--config.trainer.backend=local",
                             "--config.mesh.fsdp=-1", "--config.model.path=/data/m",
                             "--config.actor.optim.lr=1e-6"]
    assert logs[:5] == ["gcloud", "compute", "tpus", "tpu-vm", "ssh"] and "--worker=0" in logs


def test_tpu_queued_resource_create_and_delete(tpu_config):
    cfg = tpu_config(QUEUED="1", SPOT="1")
    create, wait = _commands(_run(TPU, "-c", cfg, "--dry-run", "create").stdout)
    assert create[:5] == ["gcloud", "compute", "tpus", "queued-resources", "create"]
    assert _flag(create, "--node-id") == "t1" and "--spot" in create
    assert _flag(create, "--runtime-version") == "v2-alpha-tpuv5"
    assert wait[:5] == ["gcloud", "compute", "tpus", "queued-resources", "describe"]
    (delete,) = _commands(_run(TPU, "-c", cfg, "--dry-run", "delete").stdout)
    assert delete[:5] == ["gcloud", "compute", "tpus", "queued-resources", "delete"] and "--force" in delete
    (delete,) = _commands(_run(TPU, "-c", tpu_config(), "--dry-run", "delete").stdout)
    assert delete[:6] == ["gcloud", "compute", "tpus", "tpu-vm", "delete", "t1"]


def test_tpu_example_config_is_complete():
    cmds = _commands(_run(TPU, "-c", "scripts/tpu/example.env", "--dry-run", "up").stdout)
    assert len(cmds) == 7  # queued create + wait, tar, scp, install, run, logs


def test_tpu_errors_name_the_problem(tpu_config):
    res = _run(TPU, "--dry-run", "up", ok=False)
    assert res.returncode == 2 and "--config-file is required" in res.stderr
    res = _run(TPU, "-c", tpu_config(ZONE=""), "--dry-run", "up", ok=False)
    assert res.returncode == 2 and "ZONE is not set" in res.stderr
    res = _run(TPU, "-c", tpu_config(), "--dry-run", "launch", ok=False)
    assert res.returncode == 2 and "unknown command 'launch'" in res.stderr


@pytest.mark.parametrize("tasks_per,ntasks,gpu_flag", [("node", "1", "--gpus-per-node=8"),
                                                       ("gpu", "8", "--gpus-per-task=1")])
def test_sbatch_runs_one_srun_with_the_training_command(tasks_per, ntasks, gpu_flag):
    env = {"SLURM_JOB_NUM_NODES": "4", "SLURM_JOB_NODELIST": "gpu[01-04]", "TASKS_PER": tasks_per}
    res = _run(SBATCH, "--dry-run", "--config=configs/grpo_gsm8k.py", "--config.mesh.fsdp=-1", env=env)
    (srun,) = _commands(res.stdout)
    assert srun[0] == "srun" and _flag(srun, "--nodes") == "4"
    assert _flag(srun, "--ntasks-per-node") == ntasks and gpu_flag in srun
    i = srun.index("-m")
    assert srun[i + 1:] == ["jaxrl_llm.train", "--config=configs/grpo_gsm8k.py", "--config.mesh.fsdp=-1",
                            "--config.trainer.backend=local"]


def test_sbatch_header_and_its_coordinator_match_the_slurm_resolver():
    import sharding

    header = [line for line in SBATCH.read_text().splitlines() if line.startswith("#SBATCH")]
    assert "#SBATCH --ntasks-per-node=1" in header
    # what each srun task resolves (sharding reads SLURM_* and the port the script exports)
    spec = sharding.resolve_distributed_env({"SLURM_PROCID": "3", "SLURM_NTASKS": "4",
                                             "SLURM_JOB_NODELIST": "gpu[01-04]",
                                             "JAXRL_COORDINATOR_PORT": "12345"})
    assert (spec.coordinator_address, spec.num_processes, spec.process_id) == ("gpu01:12345", 4, 3)


def test_sbatch_outside_slurm_refuses_to_run():
    res = _run(SBATCH, "--config=configs/grpo_gsm8k.py", ok=False)
    assert res.returncode == 2 and "not inside a SLURM allocation" in res.stderr


def test_gpu_ssh_starts_one_process_per_host_with_its_process_id(tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("# cluster\nnode-a\nnode-b\n\nnode-c  # last\n")
    res = _run(GPU, "ssh", f"--hostfile={hostfile}", "--port=2222", "--dry-run", "--",
               "--config=configs/grpo_gsm8k.py", "--config.trainer.experiment_name=a b")
    cmds = _commands(res.stdout)
    assert [c[:2] for c in cmds] == [["ssh", "node-a"], ["ssh", "node-b"], ["ssh", "node-c"]]
    for i, c in enumerate(cmds):
        remote = shlex.split(c[2])
        assert "--coordinator_address=node-a:2222" in remote and "--num_processes=3" in remote
        assert f"--process_id={i}" in remote and "--config.trainer.experiment_name=a b" in remote
        assert remote[remote.index("-m") + 1] == "jaxrl_llm.train"


def test_gpu_slurm_submits_the_sbatch_script():
    res = _run(GPU, "slurm", "--nodes=4", "--tasks-per=gpu", "--dry-run", "--", "--config=configs/x.py")
    (cmd,) = _commands(res.stdout)
    i = cmd.index("sbatch")
    assert "TASKS_PER=gpu" in cmd[:i] and _flag(cmd, "--nodes") == "4"
    assert _flag(cmd, "--ntasks-per-node") == "8"
    assert cmd[-2:] == [str(SBATCH), "--config=configs/x.py"]


def test_gpu_launch_needs_hosts_and_flags():
    res = _run(GPU, "ssh", "--dry-run", "--", "--config=c.py", ok=False)
    assert res.returncode == 2 and "--hosts" in res.stderr
    res = _run(GPU, "ssh", "--hosts=a", "--dry-run", ok=False)
    assert res.returncode == 2 and "--config" in res.stderr


def test_ray_up_starts_head_and_workers_with_the_host_resource():
    res = _run(RAY, "up", "--hosts=h0,h1,h2", "--gpus-per-host=4", "--dry-run")
    cmds = _commands(res.stdout)
    assert [c[:2] for c in cmds] == [["ssh", "h0"], ["ssh", "h1"], ["ssh", "h2"]]
    head = shlex.split(cmds[0][2])
    assert head[:3] == ["ray", "start", "--head"] and "--num-gpus=4" in head
    assert _flag(head, "--resources") == '{"jaxrl_host": 1}'
    for c in cmds[1:]:
        worker = shlex.split(c[2])
        assert _flag(worker, "--address") == "h0:6379" and _flag(worker, "--resources") == '{"jaxrl_host": 1}'


def test_ray_tpu_head_declares_no_gpus():
    (head,) = _commands(_run(RAY, "head", "--accelerator=tpu", "--dry-run").stdout)
    assert head[:3] == ["ray", "start", "--head"] and not any(a.startswith("--num-gpus") for a in head)


def test_ray_submit_runs_the_trainer_once_with_the_ray_backend():
    res = _run(RAY, "submit", "--head=10.0.0.1", "--num-hosts=4", "--dry-run", "--",
               "--config=configs/grpo_gsm8k.py")
    (cmd,) = _commands(res.stdout)
    assert cmd[:3] == ["ray", "job", "submit"] and _flag(cmd, "--address") == "http://10.0.0.1:8265"
    train = cmd[cmd.index("--") + 1:]
    assert train[1:] == ["-m", "jaxrl_llm.train", "--config=configs/grpo_gsm8k.py",
                         "--config.trainer.backend=ray", "--num_hosts=4"]


def test_ray_backend_resource_name_matches_the_script():
    from jaxrl_llm.trainer import _backend

    assert f'"{_backend.HOST_RESOURCE}": 1' in RAY.read_text()


def test_gpu_stop_kills_only_the_recorded_runs(tmp_path):
    """`stop` kills the pids that `ssh` recorded (if they still run jaxrl_llm.train), never a
    process matched by name: another user's run with the same command line lives on."""
    import sys
    fake = [sys.executable, "-c", "import time; time.sleep(120)"]
    ours = subprocess.Popen([*fake, "jaxrl_llm.train", "--coordinator_address=a:1"])
    other = subprocess.Popen([*fake, "jaxrl_llm.train", "--coordinator_address=a:1"])  # not recorded
    reused = subprocess.Popen(["sleep", "120"])  # a recorded pid now taken by something else
    try:
        (tmp_path / "jaxrl_run.0.pid").write_text(f"{ours.pid}\n")
        (tmp_path / "jaxrl_run.1.pid").write_text(f"{reused.pid}\n")
        res = _run(GPU, "stop", "--hosts=h", f"--repo-dir={tmp_path}", "--dry-run")
        (cmd,) = _commands(res.stdout)
        assert cmd[:2] == ["ssh", "h"] and "pkill" not in cmd[2]
        subprocess.run(["bash", "-c", cmd[2]], check=True, timeout=60)  # what the host would run
        assert ours.wait(timeout=30) is not None
        assert other.poll() is None and reused.poll() is None
        assert not list(tmp_path.glob("jaxrl_run.*.pid"))
    finally:
        for p in (ours, other, reused):
            if p.poll() is None:
                p.kill()
                p.wait()


def test_gpu_ssh_records_each_runs_pid():
    res = _run(GPU, "ssh", "--hosts=a,b", "--dry-run", "--", "--config=c.py")
    for i, c in enumerate(_commands(res.stdout)):
        assert c[2].endswith(f"> jaxrl_run.{i}.log 2>&1 & echo $! > jaxrl_run.{i}.pid")


def test_tpu_check_runs_the_aot_compile_before_anything_is_booked(tpu_config):
    cfg = tpu_config(TOPOLOGY="v5p:2x2x2", AOT_MODEL="qwen2.5-7b")
    check, create, *_ = _commands(_run(TPU, "-c", cfg, "--dry-run", "--check", "up").stdout)
    assert check[1].endswith("scripts/tpu/aot_compile.py") and "--check" in check
    assert _flag(check, "--topology") == "v5p:2x2x2" and _flag(check, "--model") == "qwen2.5-7b"
    assert _flag(check, "--config") == "configs/grpo_gsm8k.py" and "--config.mesh.fsdp=-1" in check
    assert create[:5] == ["gcloud", "compute", "tpus", "tpu-vm", "create"]


def test_tpu_failing_check_stops_the_launch(tpu_config):
    res = _run(TPU, "-c", tpu_config(TOPOLOGY="v5e:2x4", PYTHON="false"), "--check", "up", ok=False)
    assert res.returncode != 0 and "gcloud" not in res.stdout  # nothing after the failed check
    res = _run(TPU, "-c", tpu_config(), "--dry-run", "check", ok=False)
    assert res.returncode == 2 and "TOPOLOGY" in res.stderr


_REPO_PATH = re.compile(r"\b(?:configs|scripts|docs|tests|jaxrl_llm|rollout|sharding)/[\w./-]*\w")


@pytest.mark.parametrize("script", [TPU, SBATCH, GPU, RAY], ids=lambda p: p.name)
def test_every_repo_path_in_usage_and_messages_exists(script):
    """The usage text (`--help`) and the script's messages name only files that are in the repo:
    a user copies them as they are."""
    help_text = _run(script, "--help").stdout
    paths = set(_REPO_PATH.findall(help_text))
    assert any(p.startswith("scripts/") for p in paths), help_text  # the usage names the script itself
    paths |= set(_REPO_PATH.findall(script.read_text()))
    missing = sorted(p for p in paths if not (ROOT / p).exists())
    assert missing == [], f"{script.name} names files that do not exist: {missing}"
