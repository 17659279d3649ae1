"""The parent's side of one worker process for user code (`jaxrl_llm._worker_main`).

`WorkerProcess` starts the worker through a `jaxrl_llm.sandbox.Sandbox` (a scrubbed environment,
a private scratch dir as HOME and cwd, rlimits; the `bwrap` backend adds namespaces), in its own
session so that killing it kills whatever it started. Messages are JSON lines over its
stdin/stdout; a reply longer than `MAX_REPLY_BYTES` or not JSON counts as a broken worker. The
worker sees the user's file and this package read-only (`ro_paths`); its PYTHONPATH is this
package's root and the parent's own sys.path entries (not the interpreter's). Timeouts and the
choice of when to kill are the caller's (the tool pools and the reward pool).
"""
from __future__ import annotations

import json
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence

import jaxrl_llm
from jaxrl_llm.sandbox import Limits, Sandbox

MAX_REPLY_BYTES = 16 << 20
_PACKAGE_DIR = os.path.dirname(os.path.abspath(jaxrl_llm.__file__))


class WorkerBroken(RuntimeError):
    """The worker exited, closed its pipe or sent something that is not one JSON object;
    `exit_code` when it exited."""

    def __init__(self, message: str, exit_code: int | None = None):
        super().__init__(message)
        self.exit_code = exit_code


def _json_default(value):
    if hasattr(value, "tolist"):  # numpy arrays and scalars, as in parquet rows
        return value.tolist()
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")


def encode(message: dict) -> bytes:
    """One JSON line; TypeError/ValueError when `message` holds something JSON cannot carry."""
    return json.dumps(message, default=_json_default, allow_nan=False).encode() + b"\n"


def _python_path() -> str:
    """This package's root first, then the parent's own sys.path entries (a user's modules;
    not the interpreter's, which the worker finds itself)."""
    own = [sys.prefix, sys.base_prefix, sys.exec_prefix]
    paths = [os.path.dirname(_PACKAGE_DIR)]
    for p in sys.path:
        p = os.path.abspath(p or os.curdir)
        if (os.path.isdir(p) and p not in paths
                and not any(p == o or p.startswith(o + os.sep) for o in own)):
            paths.append(p)
    return os.pathsep.join(paths)


class WorkerProcess:
    """One running `python -m jaxrl_llm._worker_main <args>`; `kill()` when done."""

    def __init__(self, args: Sequence[str], *, sandbox: Sandbox, limits: Limits,
                 ro_paths: Sequence[str], name: str):
        self.name = name
        self.scratch = tempfile.mkdtemp(prefix=f"jaxrl-{name.replace(' ', '-')}-")
        argv, env = sandbox.wrap([sys.executable, "-m", "jaxrl_llm._worker_main", *args],
                                 scratch=self.scratch, limits=limits,
                                 ro_paths=(*ro_paths, _PACKAGE_DIR),
                                 env={"PYTHONPATH": _python_path()})
        try:
            self.process = subprocess.Popen(argv, env=env, cwd=self.scratch,
                                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                            start_new_session=True, close_fds=True)
        except OSError:
            shutil.rmtree(self.scratch, ignore_errors=True)
            raise
        self._buffer = bytearray()  # what came after the last whole line

    def fileno(self) -> int:
        return self.process.stdout.fileno()

    @property
    def exit_code(self) -> int | None:
        return self.process.poll()

    def send(self, message: dict) -> None:
        """Writes one request; WorkerBroken if the worker is gone."""
        try:
            self.process.stdin.write(encode(message))
            self.process.stdin.flush()
        except (BrokenPipeError, OSError) as e:
            raise WorkerBroken(f"{self.name}: cannot write to it ({e})") from None

    def read_available(self) -> dict | None:
        """Reads what the pipe holds now (call when it is readable): the reply once a whole
        line came, else None; WorkerBroken on end of file or a malformed reply."""
        chunk = os.read(self.fileno(), 1 << 16)
        if not chunk:
            self.signal_group()  # whatever it started goes too (and it, if it only closed stdout)
            code = self.wait_exit()
            raise WorkerBroken(f"{self.name} exited with {code}", code)
        self._buffer.extend(chunk)
        return self._next_line()

    def _next_line(self) -> dict | None:
        """The first whole line of the buffer as a JSON object (None: no whole line yet)."""
        end = self._buffer.find(b"\n")
        if end < 0:
            if len(self._buffer) > MAX_REPLY_BYTES:
                raise WorkerBroken(f"{self.name} sent a reply over {MAX_REPLY_BYTES >> 20} MiB")
            return None
        line = bytes(self._buffer[:end])
        del self._buffer[:end + 1]
        try:
            reply = json.loads(line)
        except (ValueError, RecursionError):
            reply = None
        if not isinstance(reply, dict):
            raise WorkerBroken(f"{self.name} sent a reply that is not a JSON object")
        return reply

    def receive(self, timeout_s: float | None) -> dict | None:
        """The next reply, or None after `timeout_s` (None = no limit); WorkerBroken."""
        reply = self._next_line()  # several replies may have come in one read
        if reply is not None:
            return reply
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with selectors.DefaultSelector() as selector:
            selector.register(self.fileno(), selectors.EVENT_READ)
            while True:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                if not selector.select(left):
                    if deadline is not None and time.monotonic() >= deadline:
                        return None
                    continue
                reply = self.read_available()
                if reply is not None:
                    return reply

    def wait_exit(self, timeout_s: float = 5.0) -> int | None:
        """The exit code once the process ended (it is ending: its pipe closed)."""
        try:
            return self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            return None

    def signal_group(self) -> None:
        """SIGKILL to the worker and everything it started (its own session). Only until it is
        reaped: after that its id may belong to another process."""
        if self.process.returncode is not None:
            return
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    def kill(self) -> None:
        """Kills the worker's process group, reaps it, closes the pipes, removes its scratch."""
        self.signal_group()
        self.process.wait()
        for pipe in (self.process.stdin, self.process.stdout):
            try:
                pipe.close()
            except OSError:
                pass
        shutil.rmtree(self.scratch, ignore_errors=True)

    def wait_ready(self, timeout_s: float, what: str) -> dict:
        """The worker's first message, {"ready": true, ...}: RuntimeError naming `what` if it
        could not import the user's file, died or did not answer within `timeout_s`."""
        try:
            reply = self.receive(timeout_s)
        except WorkerBroken as e:
            self.kill()
            raise RuntimeError(f"{what}: the worker process died while starting ({e}); run "
                               f"the file with python to see why") from None
        if reply is None:
            self.kill()
            raise RuntimeError(f"{what}: the worker process did not start in {timeout_s:g} s")
        if reply.get("ready") is not True:
            self.kill()
            raise RuntimeError(f"{what}: the worker could not load it: {reply.get('error')}")
        return reply
