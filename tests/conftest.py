"""Test set-up: 8 fake CPU devices so every mesh shape runs on a laptop or CI box.

XLA reads XLA_FLAGS once, when the backend starts, so this must run before anything imports JAX.
"""
import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import importlib.util  # noqa: E402 - after the environment set-up above
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


@pytest.fixture
def load_script():
    """load_script("bench_e2e") -> scripts/bench_e2e.py as a module (scripts are not a package)."""
    def load(name: str):
        spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    return load
