"""Start-up noise with a cause in our code: the controller must not start JAX's backend before
the worker group (Ray) has started its processes, or JAX warns that os.fork() was called."""
import os
import subprocess
import sys

from trainer_helpers import QUICKSTART, ROOT

_PROBE = r"""
import os, sys, traceback
from jaxrl_llm.config import load_config
from jaxrl_llm.trainer import _rl
calls = []
orig = os.register_at_fork
os.register_at_fork = lambda **kw: (calls.append(traceback.format_stack()), orig(**kw))[1]
class Stop(Exception):
    pass
def fake_group(*a, **k):  # where Ray would start: JAX's fork hook must not be installed yet
    raise Stop("".join(calls[0]) if calls else "")
_rl.make_group = fake_group
run_dir = sys.argv[2]
c = load_config(sys.argv[1], [f"trainer.default_local_dir={run_dir}"])
try:
    _rl.RLTrainer(c)
except Stop as e:
    print("JAX STARTED BEFORE THE GROUP:\n" + str(e) if str(e) else "clean")
"""


def test_controller_starts_no_jax_backend_before_the_worker_group(tmp_path):
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT}
    out = subprocess.run([sys.executable, "-c", _PROBE, f"{QUICKSTART}:tiny", str(tmp_path)], env=env,
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.stdout.strip().splitlines()[-1:] == ["clean"], out.stdout[-3000:] + out.stderr[-2000:]
