"""Sandbox backends. INTERFACE DRAFT (issue 28 item 3): `process` works; `bwrap` is filled in by
the sandbox work. Callers use only what is public here:

    box = make_sandbox("auto")                      # or "bwrap" / "process"
    argv, env = box.wrap([sys.executable, "-I", "-"], scratch=tmpdir, limits=Limits(...),
                         ro_paths=(file_the_code_needs,))
    subprocess.Popen(argv, env=env, cwd=scratch, start_new_session=True, ...)

The wrapped command applies the rlimits itself (a tiny bootstrap that execs the real command:
limits survive exec; no `preexec_fn`, which can deadlock a parent running JAX's threads). The
wall-clock timeout is the caller's (kill the process group).
"""
from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Sequence

SANDBOX_KINDS = ("auto", "bwrap", "process")
# what a worker keeps of the parent's environment: nothing secret, only what finds programs and
# picks a locale; HOME is the scratch dir
_KEEP_ENV = ("PATH", "LANG", "LC_ALL", "LC_CTYPE", "SYSTEMROOT")


class SandboxError(RuntimeError):
    """A sandbox backend was asked for but cannot run here (e.g. bwrap missing)."""


@dataclasses.dataclass(frozen=True)
class Limits:
    """Per-process resource limits; 0 = not limited. `cpu_s`: CPU seconds (RLIMIT_CPU),
    `memory_mb`: address space (RLIMIT_AS), `nproc`: processes of the user (RLIMIT_NPROC),
    `fsize_mb`: largest file it may write (RLIMIT_FSIZE)."""

    cpu_s: int = 0
    memory_mb: int = 0
    nproc: int = 0
    fsize_mb: int = 64


def clean_env(home: str, extra: dict[str, str] | None = None) -> dict[str, str]:
    """The scrubbed environment: PATH and locale only, HOME=`home`, one thread per library."""
    env = {k: os.environ[k] for k in _KEEP_ENV if k in os.environ}
    env.update(HOME=home, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1",
               PYTHONDONTWRITEBYTECODE="1")
    env.update(extra or {})
    return env


_BOOTSTRAP = (
    "import os, resource, sys\n"
    "cpu, mem, nproc, fsize = (int(a) for a in sys.argv[1:5])\n"
    "for lim, v, hard in ((resource.RLIMIT_CPU, cpu, cpu + 1), (resource.RLIMIT_AS, mem, mem),\n"
    "                     (resource.RLIMIT_NPROC, nproc, nproc), (resource.RLIMIT_FSIZE, fsize, fsize)):\n"
    "    if v > 0:\n"
    "        resource.setrlimit(lim, (v, hard))\n"
    "os.execv(sys.argv[5], sys.argv[5:])\n"
)


def _limit_argv(limits: Limits, argv: Sequence[str]) -> list[str]:
    return [sys.executable, "-I", "-S", "-c", _BOOTSTRAP, str(limits.cpu_s),
            str(limits.memory_mb << 20), str(limits.nproc), str(limits.fsize_mb << 20), *argv]


class Sandbox:
    """Base: `name`, `contained` (True when files, network, processes and the environment of
    the parent are out of reach), `wrap`."""

    name = "process"
    contained = False

    def wrap(self, argv: Sequence[str], *, scratch: str, limits: Limits,
             ro_paths: Sequence[str] = (), env: dict[str, str] | None = None
             ) -> tuple[list[str], dict[str, str]]:
        raise NotImplementedError


class ProcessSandbox(Sandbox):
    """rlimits and a scrubbed environment only: the code still sees the user's files, the
    network and other processes (`/proc/<pid>/environ` of the trainer included)."""

    def wrap(self, argv, *, scratch, limits, ro_paths=(), env=None):
        return _limit_argv(limits, argv), clean_env(scratch, env)


def make_sandbox(kind: str) -> Sandbox:
    if kind not in SANDBOX_KINDS:
        raise ValueError(f"sandbox must be one of {SANDBOX_KINDS}, got {kind!r}")
    if kind == "bwrap":
        raise SandboxError("bwrap backend: not written yet (issue 28 item 3)")
    return ProcessSandbox()
