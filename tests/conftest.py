"""Test set-up: 8 fake CPU devices so every mesh shape runs on a laptop or CI box.

XLA reads XLA_FLAGS once, when the backend starts, so this must run before anything imports JAX.
"""
import os

# XLA's CPU backend compiles without LLVM's optimisation passes (`TEST_XLA_FLAGS`): the tests' tiny
# programs run a few times each, so compiling them is most of the suite's time, and the passes
# (not XLA's own HLO passes, which still run) made it about twice as slow. The demos' learning
# runs start without these flags, as a user's plain CPU would (tests/trainer/test_trainer_quickstart*.py).
TEST_XLA_FLAGS = "--xla_backend_optimization_level=0"
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count=8 {TEST_XLA_FLAGS}"
).strip()
os.environ["JAXRL_TEST_XLA_FLAGS"] = TEST_XLA_FLAGS  # for tests that start processes with their own XLA_FLAGS
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# JAX's persistent compilation cache for the whole session: a test that builds programs another
# test (or an earlier run in the same test, e.g. before a resume) already compiled loads them
# instead of compiling again. The variables reach subprocesses and Ray workers too. A new empty
# folder per session, removed at the end, so a run here costs what it costs on a clean CI machine;
# set JAX_COMPILATION_CACHE_DIR yourself to keep one across sessions (empty: no cache).
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    import atexit  # noqa: E402
    import shutil  # noqa: E402
    import tempfile  # noqa: E402

    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="jaxrl_llm_tests_jax_cache_")
    atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")

import gc  # noqa: E402 - after the environment set-up above
import importlib.util  # noqa: E402
import sys  # noqa: E402
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


def _mapped_regions() -> int:
    try:
        with open("/proc/self/maps") as f:
            return sum(1 for _ in f)
    except OSError:  # not Linux
        return 0


@pytest.fixture(scope="module", autouse=True)
def _release_compiled_programs():
    """Drops JAX's in-memory compiled programs after each test module. XLA:CPU maps every compiled
    kernel's code into the process (about three mappings each) for as long as a jit cache holds
    the program; over the whole suite that reached Linux's default `vm.max_map_count` (65,530)
    near the trainer tests, and the next compile's mmap failed inside LLVM as a segmentation fault
    (CI at 302df48..11ab2dc, ~62,000 mappings measured before the crash). A later module that needs
    the same program loads it from the persistent cache."""
    yield
    _PEAK_REGIONS[0] = max(_PEAK_REGIONS[0], _mapped_regions())
    if "jax" in sys.modules:
        sys.modules["jax"].clear_caches()
    gc.collect()


_PEAK_REGIONS = [0]


def pytest_terminal_summary(terminalreporter):
    try:
        limit = int(Path("/proc/sys/vm/max_map_count").read_text())
    except (OSError, ValueError):
        return
    terminalreporter.write_line(f"memory mappings at a module's end, most: {_PEAK_REGIONS[0]:,} "
                                f"(vm.max_map_count {limit:,})")
