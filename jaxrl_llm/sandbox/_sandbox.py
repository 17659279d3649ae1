"""Sandbox backends for code we do not trust. Callers use only what is public here:

    box = make_sandbox("auto")                      # or "bwrap" / "process"
    argv, env = box.wrap([sys.executable, "-I", "-"], scratch=tmpdir, limits=Limits(...),
                         ro_paths=(file_the_code_needs,))
    subprocess.Popen(argv, env=env, cwd=scratch, start_new_session=True, ...)

The wrapped command applies the rlimits itself (a tiny bootstrap that execs the real command:
limits survive exec; no `preexec_fn`, which can deadlock a parent running JAX's threads). The
wall-clock timeout is the caller's (kill the process group; under `bwrap` that kills every
process of the sandbox, since they all live in its PID namespace).

`bwrap` (bubblewrap): new mount, PID, IPC, UTS and network namespaces; only the system dirs, the
Python installation and `ro_paths` are visible, read-only; `scratch` is the one writable dir
(cwd and HOME), /tmp is empty, private and `fsize_mb` large. Run as root, the code drops to an
unprivileged uid of its own (random, >= 2**20) after the mounts, so that the process cap
(RLIMIT_NPROC, which the kernel skips for uid 0) holds and counts this sandbox's processes only;
run as another user, bwrap makes a user namespace and the cap counts the processes inside it.
`process`: the rlimits (not the process cap) and a scrubbed environment only.
docs/agents.md, "What the sandbox contains and what it does not", has the exact lists.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Sequence

log = logging.getLogger(__name__)

SANDBOX_KINDS = ("auto", "bwrap", "process")
# what a worker keeps of the parent's environment: nothing secret, only what finds programs and
# picks a locale; HOME is the scratch dir
_KEEP_ENV = ("PATH", "LANG", "LC_ALL", "LC_CTYPE", "SYSTEMROOT")
# system paths bound read-only under bwrap (a symlink is recreated as a symlink); /etc only in
# the pieces the dynamic loader, the locale and user/group lookups read
_SYSTEM_PATHS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
_ETC_PATHS = ("/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/localtime",
              "/etc/nsswitch.conf", "/etc/passwd", "/etc/group", "/etc/alternatives")
_UID_BASE = 1 << 20  # sandbox uids when run as root: far above any real account


class SandboxError(RuntimeError):
    """A sandbox backend was asked for but cannot run here (e.g. bwrap missing)."""


@dataclasses.dataclass(frozen=True)
class Limits:
    """Per-process resource limits; 0 = not limited. `cpu_s`: CPU seconds (RLIMIT_CPU),
    `memory_mb`: address space (RLIMIT_AS), `nproc`: processes (RLIMIT_NPROC; enforced by the
    `bwrap` backend only), `fsize_mb`: largest file it may write (RLIMIT_FSIZE; under `bwrap`
    also the size of its private /tmp)."""

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


# argv: cpu_s, memory bytes, nproc, fsize bytes, uid (-1: keep), scratch, command...
# As root with a uid: the scratch dir is handed to that uid, then groups, gid and uid are
# dropped (every capability goes with uid 0), then RLIMIT_NPROC is set and holds.
_BOOTSTRAP = (
    "import os, resource, sys\n"
    "cpu, mem, nproc, fsize, uid = (int(a) for a in sys.argv[1:6])\n"
    "for lim, v, hard in ((resource.RLIMIT_CPU, cpu, cpu + 1), (resource.RLIMIT_AS, mem, mem),\n"
    "                     (resource.RLIMIT_FSIZE, fsize, fsize)):\n"
    "    if v > 0:\n"
    "        resource.setrlimit(lim, (v, hard))\n"
    "if uid >= 0:\n"
    "    os.chown(sys.argv[6], uid, uid)\n"
    "    os.setgroups([])\n"
    "    os.setresgid(uid, uid, uid)\n"
    "    os.setresuid(uid, uid, uid)\n"
    "if nproc > 0:\n"
    "    resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))\n"
    "os.execv(sys.argv[7], sys.argv[7:])\n"
)


def _limit_argv(limits: Limits, argv: Sequence[str], *, nproc: int, uid: int = -1,
                scratch: str = "") -> list[str]:
    return [sys.executable, "-I", "-S", "-c", _BOOTSTRAP, str(limits.cpu_s),
            str(limits.memory_mb << 20), str(nproc), str(limits.fsize_mb << 20), str(uid),
            scratch or ".", *argv]


class Sandbox:
    """Base: `name`, `contained` (True when files, network, processes and the environment of
    the parent are out of reach), `describe()` (one line: what is contained), `wrap`."""

    name = "process"
    contained = False

    def wrap(self, argv: Sequence[str], *, scratch: str, limits: Limits,
             ro_paths: Sequence[str] = (), env: dict[str, str] | None = None
             ) -> tuple[list[str], dict[str, str]]:
        """(argv, env) that run `argv` contained, with `scratch` as its writable dir and cwd,
        `ro_paths` readable, `env` added to the clean environment."""
        raise NotImplementedError

    def describe(self) -> str:
        raise NotImplementedError


class ProcessSandbox(Sandbox):
    """rlimits and a scrubbed environment only: the code still sees the user's files, the
    network and other processes (`/proc/<pid>/environ` of the trainer included). The process
    cap is not applied: as root the kernel ignores it, as another user it would count all of
    that user's processes (the trainer's threads too)."""

    def wrap(self, argv, *, scratch, limits, ro_paths=(), env=None):
        return _limit_argv(limits, argv, nproc=0), clean_env(scratch, env)

    def describe(self) -> str:
        return ("process: CPU time, memory and file size limits and a scrubbed environment; "
                "NOT contained: the user's files (read and write), the network, other "
                "processes and their /proc/<pid>/environ, the number of processes")


def _python_roots() -> list[str]:
    """The Python installation(s) the interpreter needs: prefixes and the executable's."""
    exe = os.path.realpath(sys.executable)
    roots = {os.path.realpath(sys.base_prefix), os.path.realpath(sys.prefix),
             os.path.dirname(os.path.dirname(exe))}
    return sorted(r for r in roots if not r.startswith("/usr/"))


class BwrapSandbox(Sandbox):
    """bubblewrap: namespaces, read-only system, private scratch, unprivileged uid, rlimits."""

    name = "bwrap"
    contained = True

    def __init__(self, bwrap: str):
        self.bwrap = bwrap

    def _mounts(self, scratch: str, ro_paths: Sequence[str], tmp_mb: int) -> list[str]:
        args, made, bound = ["--perms", "0755", "--dir", "/etc"], {"/etc"}, []

        def bind(how: str, path: str) -> None:
            # parents bwrap would make are mode 0700: make them 0755 so the dropped uid passes
            parts = path.strip(os.sep).split(os.sep)[:-1]
            for i in range(1, len(parts) + 1):
                parent = os.sep + os.path.join(*parts[:i])
                inside_bind = any(parent == b or parent.startswith(b + os.sep) for b in bound)
                if parent not in made and not inside_bind:
                    args.extend(["--perms", "0755", "--dir", parent])
                    made.add(parent)
            args.extend([how, os.path.realpath(path), path])
            bound.append(path)

        for path in _SYSTEM_PATHS:
            if os.path.islink(path):
                args += ["--symlink", os.readlink(path), path]
            elif os.path.isdir(path):
                bind("--ro-bind", path)
        for path in _ETC_PATHS:
            args += ["--ro-bind-try", path, path]
        for root in _python_roots():
            bind("--ro-bind", root)
        args += ["--proc", "/proc", "--dev", "/dev", "--perms", "1777"]
        args += ["--size", str(tmp_mb << 20)] if tmp_mb > 0 else []  # /tmp is host memory
        args += ["--tmpfs", "/tmp"]
        made.add("/tmp")
        binds = [(os.path.abspath(p), "--ro-bind") for p in ro_paths]
        binds.append((os.path.abspath(scratch), "--bind"))
        for path, how in sorted(binds, key=lambda b: b[0].count(os.sep)):  # parents first
            if not os.path.exists(path):
                raise SandboxError(f"sandbox: {path} does not exist (a read-only path or the "
                                   f"scratch dir given to Sandbox.wrap)")
            bind(how, path)
        return args

    def wrap(self, argv, *, scratch, limits, ro_paths=(), env=None):
        env = clean_env(scratch, env)
        as_root = os.geteuid() == 0
        # as root: no user namespace (it would map the code back to uid 0), a uid of its own
        unshare = (["--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts",
                    "--unshare-cgroup-try"] if as_root else ["--unshare-all"])
        args = [self.bwrap, *unshare, "--die-with-parent", "--new-session",
                "--hostname", "sandbox", *self._mounts(scratch, ro_paths, limits.fsize_mb),
                "--chdir", os.path.abspath(scratch),
                "--clearenv"]
        for key, value in env.items():
            args += ["--setenv", key, value]
        uid = _UID_BASE + secrets.randbelow(1 << 24) if as_root else -1
        inner = _limit_argv(limits, argv, nproc=limits.nproc, uid=uid, scratch=scratch)
        return [*args, "--", *inner], env

    def describe(self) -> str:
        return ("bwrap: own mount, PID, IPC, UTS and network namespaces; read-only system and "
                "Python dirs; a private scratch dir; no parent environment; CPU, memory, file "
                "size and process limits")


_probe_lock = threading.Lock()
_probe: dict[str, str] = {}  # bwrap path -> "" (works) or why it does not
_warned: list[bool] = []


def _probe_bwrap(bwrap: str) -> str:
    """"" when a trivial command runs under the bwrap backend here, else why not (cached)."""
    with _probe_lock:
        if bwrap not in _probe:
            with tempfile.TemporaryDirectory(prefix="jaxrl_sandbox_probe_") as scratch:
                try:
                    argv, env = BwrapSandbox(bwrap).wrap(
                        [sys.executable, "-I", "-S", "-c", "pass"], scratch=scratch,
                        limits=Limits(cpu_s=10, nproc=8))
                    done = subprocess.run(argv, env=env, cwd=scratch, capture_output=True,
                                          timeout=60, check=False)
                    _probe[bwrap] = "" if done.returncode == 0 else (
                        f"exit code {done.returncode}: "
                        f"{' '.join(done.stderr.decode(errors='replace').split())[-300:]}")
                except (OSError, subprocess.SubprocessError, SandboxError) as e:
                    _probe[bwrap] = f"{type(e).__name__}: {e}"
        return _probe[bwrap]


def make_sandbox(kind: str) -> Sandbox:
    """The backend for `kind`: "bwrap" (an error when it cannot run here), "process", or
    "auto" (bwrap when a probe run works here, else process and one warning per process)."""
    if kind not in SANDBOX_KINDS:
        raise ValueError(f"sandbox must be one of {SANDBOX_KINDS}, got {kind!r}")
    if kind == "process":
        return ProcessSandbox()
    bwrap = shutil.which("bwrap")
    why = _probe_bwrap(bwrap) if bwrap else "bwrap is not installed"
    if not why:
        return BwrapSandbox(bwrap)
    if kind == "bwrap":
        raise SandboxError(f"sandbox 'bwrap' cannot run here ({why}); install bubblewrap "
                           f"(apt-get install bubblewrap) or choose sandbox 'process'")
    if not _warned:
        _warned.append(True)
        log.warning("sandbox 'auto': bwrap cannot run here (%s), so untrusted code runs with "
                    "the 'process' backend. %s. Install bubblewrap to contain it.", why,
                    ProcessSandbox().describe())
    return ProcessSandbox()
