"""The command line (`python -m jaxrl_llm.train` / `.sft`): a mistake the user can fix is one
line on stderr and exit status 2, never a traceback."""
import importlib
import importlib.util
import json
import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _tpu_here() -> bool:
    from jaxrl_llm._cli import tpu_present

    return tpu_present()


def _train(*args, cwd=ROOT):
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT}
    return subprocess.run([sys.executable, "-m", "jaxrl_llm.train", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("args, message", [
    (["--config=configs/quickstart.py:tiny", "--config.trainer.totl_training_steps=3"],
     'Did you mean "total_training_steps"'),
    (["--config=configs/quickstart.py:tiny", "--config.algorithm.adv_estimator=grpoo"],
     "algorithm.adv_estimator='grpoo' is not one of"),
    (["--config=configs/quickstart.py:huge"], "unknown quickstart variant 'huge'"),
])
def test_config_mistakes_are_one_line_and_exit_2(args, message):
    out = _train(*args)
    assert out.returncode == 2, out.stderr[-2000:]
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], out.stderr[-2000:]
    assert "Traceback" not in out.stderr


def test_relative_config_path_from_another_directory_says_not_found(tmp_path):
    out = _train("--config=configs/quickstart.py:tiny", cwd=tmp_path)
    assert out.returncode == 2
    assert out.stderr.strip() == (f"error: --config: config file 'configs/quickstart.py' not found "
                                  f"(relative to the current directory {tmp_path})")


def _command(module, *args, cwd=ROOT):
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT}
    return subprocess.run([sys.executable, "-m", module, *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("module, flags", [("jaxrl_llm.train", ["--config", "--num_hosts", "--process_id"]),
                                           ("jaxrl_llm.sft", ["--config"])])
def test_help_points_to_the_config_reference_and_lists_the_flags(module, flags):
    out = _command(module, "--help")
    assert "docs/configs.md" in out.stdout and os.path.isfile(os.path.join(ROOT, "docs", "configs.md"))
    assert all(f"  {flag}:" in out.stdout for flag in flags), out.stdout
    assert "Traceback" not in out.stderr


@pytest.mark.parametrize("module, field, what", [
    ("jaxrl_llm.train", "model.path", "model folder"),
    ("jaxrl_llm.train", "trainer.resume_mode", "checkpoint (a path, or auto / disable)"),
    ("jaxrl_llm.train", "rollout.multi_turn.function_tool_path", "file"),
    ("jaxrl_llm.sft", "model.tokenizer", "tokenizer folder"),
])
def test_a_missing_file_the_config_names_is_one_line_naming_the_field(module, field, what, tmp_path):
    missing = str(tmp_path / "not-there")
    out = _command(module, "--config=configs/quickstart.py:tiny,local", f"--config.{field}={missing}",
                   f"--config.trainer.default_local_dir={tmp_path / 'run'}")
    assert out.returncode == 2, out.stderr[-2000:]
    assert out.stderr.strip() == f"error: {field}={missing!r}: {what} not found", out.stderr[-2000:]
    assert not (tmp_path / "run").exists()  # nothing started


def test_compilation_cache_is_on_by_default_and_respects_the_users_setting(tmp_path, monkeypatch):
    import jax

    from jaxrl_llm import _cli

    before = (jax.config.jax_compilation_cache_dir, jax.config.jax_persistent_cache_min_compile_time_secs)
    try:
        monkeypatch.delenv(_cli.CACHE_ENV, raising=False)
        monkeypatch.delenv(_cli.MIN_TIME_ENV, raising=False)
        monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
        path = _cli.enable_compilation_cache()
        assert path == str(tmp_path / "jaxrl_llm" / "jax") == jax.config.jax_compilation_cache_dir
        assert os.environ[_cli.CACHE_ENV] == path  # Ray workers inherit it (forward_env)
        assert jax.config.jax_persistent_cache_min_compile_time_secs == 0
        from jaxrl_llm.trainer._backend import forward_env
        assert forward_env()[_cli.CACHE_ENV] == path
        monkeypatch.setenv(_cli.CACHE_ENV, str(tmp_path / "mine"))
        assert _cli.enable_compilation_cache() == str(tmp_path / "mine")
        monkeypatch.setenv(_cli.CACHE_ENV, "")  # empty: off
        assert _cli.enable_compilation_cache() is None
    finally:
        jax.config.update("jax_compilation_cache_dir", before[0])
        jax.config.update("jax_persistent_cache_min_compile_time_secs", before[1])


_LIBTPU = importlib.util.find_spec("libtpu") is not None
needs_libtpu_no_tpu = pytest.mark.skipif(
    not _LIBTPU or _tpu_here(), reason="needs libtpu installed (the test extras) on a machine without a TPU")


def _no_platforms_env():
    env = {k: v for k, v in os.environ.items()
           if k not in ("JAX_PLATFORMS", "JAXRL_LLM_AUTO_JAX_PLATFORMS", "RAY_ADDRESS")}
    return {**env, "PYTHONPATH": ROOT}


def _tpu_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if "tpu" in line.lower()]


# What a CPU process of ours reports: its JAX devices, JAX_PLATFORMS and whether libtpu is loaded.
_PROBE = """
import json, os
import jax
jax.devices()
libtpu = any("libtpu" in line for line in open("/proc/self/maps"))
print(json.dumps({"platforms": os.environ.get("JAX_PLATFORMS"), "libtpu": libtpu,
                  "devices": sorted({d.platform for d in jax.devices()})}))
"""


@needs_libtpu_no_tpu
def test_a_cpu_run_does_not_start_libtpu_when_jax_platforms_is_unset():
    # the command-line parser of train/sft runs first, then JAX starts (as in a run)
    code = ("from jaxrl_llm import _cli, train\n"
            "_cli.parse_flags(['train', '--config=configs/quickstart.py:tiny'])\n" + _PROBE)
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=_no_platforms_env(),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report == {"platforms": "cpu", "libtpu": False, "devices": ["cpu"]}, out.stderr[-2000:]
    assert _tpu_lines(out.stderr) == []


def test_the_users_jax_platforms_and_a_tpu_machine_are_left_alone(monkeypatch):
    from jaxrl_llm import _cli

    monkeypatch.setattr(_cli, "tpu_present", lambda: False)
    monkeypatch.setattr(_cli, "_jax_plugins", lambda: [])
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object())  # libtpu installed
    monkeypatch.setenv("JAX_PLATFORMS", "")
    assert _cli.platforms_without_tpu() is None  # set by the user, even empty
    monkeypatch.delenv("JAX_PLATFORMS")
    assert _cli.platforms_without_tpu() == "cpu"
    monkeypatch.setattr(_cli, "_jax_plugins", lambda: ["xla_cuda12"])
    monkeypatch.setattr(os.path, "exists", lambda p: p == "/dev/nvidiactl")
    assert _cli.platforms_without_tpu() == "cuda,cpu"
    monkeypatch.setattr(os.path, "exists", lambda p: False)  # the plugin without a GPU: JAX skips it
    assert _cli.platforms_without_tpu() == "cpu"
    monkeypatch.setattr(_cli, "_jax_plugins", lambda: ["some_other_chip"])
    assert _cli.platforms_without_tpu() is None  # hardware the rule does not know: JAX decides
    monkeypatch.setattr(_cli, "_jax_plugins", lambda: [])
    monkeypatch.setattr(_cli, "tpu_present", lambda: True)
    assert _cli.platforms_without_tpu() is None


def test_the_ray_workers_get_the_setup_hook_and_not_a_jax_platforms_chosen_for_this_machine(monkeypatch):
    from jaxrl_llm import _cli
    from jaxrl_llm.trainer import _backend

    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch.delenv(_cli.PLATFORMS_AUTO_ENV, raising=False)
    env = _backend.worker_runtime_env()
    assert env["env_vars"]["JAX_PLATFORMS"] == "cpu"  # the user's choice reaches every node
    assert env["worker_process_setup_hook"] == "jaxrl_llm._cli.skip_absent_tpu"
    monkeypatch.setenv(_cli.PLATFORMS_AUTO_ENV, "cpu")  # chosen here: another node may hold a TPU
    assert "JAX_PLATFORMS" not in _backend.worker_runtime_env().get("env_vars", {})
    module, name = env["worker_process_setup_hook"].rsplit(".", 1)
    assert getattr(importlib.import_module(module), name) is _cli.skip_absent_tpu


def test_a_local_ray_on_a_machine_without_tpu_streams_no_stale_tpu_logs(monkeypatch):
    from jaxrl_llm import _cli
    from jaxrl_llm.trainer import _backend

    monkeypatch.setattr(_cli, "tpu_present", lambda: False)
    monkeypatch.setenv("TPU_LOG_DIR", "/mine")
    _backend._no_stale_tpu_logs()
    assert os.environ["TPU_LOG_DIR"] == "/mine"
    monkeypatch.delenv("TPU_LOG_DIR")
    _backend._no_stale_tpu_logs()
    empty = os.environ["TPU_LOG_DIR"]
    assert os.path.isdir(empty) and os.listdir(empty) == []
    _backend._remove_if_empty(empty)
    assert not os.path.exists(empty)


@needs_libtpu_no_tpu
def test_a_ray_worker_on_a_node_without_tpu_does_not_start_libtpu():
    # the driver leaves JAX_PLATFORMS unset (a node of a cluster decides for itself): the
    # workers' setup hook keeps libtpu out, and nothing of libtpu's reaches the driver's output
    code = f"""
import json
from jaxrl_llm.trainer._backend import RayGroup

class Probe:
    def info(self):
        return None
    def probe(self):
{textwrap.indent(_PROBE, " " * 8).replace("print(json.dumps(", "return (json.dumps(")}

group = RayGroup(Probe)
print(group.call(Probe.probe)[0])
group.shutdown()
"""
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=_no_platforms_env(),
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report == {"platforms": "cpu", "libtpu": False, "devices": ["cpu"]}, out.stderr[-3000:]
    assert _tpu_lines(out.stderr) == _tpu_lines("\n".join(out.stdout.splitlines()[:-1])) == []
