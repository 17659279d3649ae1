"""The command line (`python -m jaxrl_llm.train` / `.sft`): a mistake the user can fix is one
line on stderr and exit status 2, never a traceback."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(__file__))


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
