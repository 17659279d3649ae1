"""`python`: runs a snippet of Python code in a fresh interpreter and returns its output.

Each call gets its own process (`python -I` reading the code from stdin, an empty temporary
working directory, the scrubbed environment of `jaxrl_llm.sandbox.clean_env`) run through a
sandbox (`rollout.multi_turn.sandbox`: "auto" | "bwrap" | "process"), with a wall-clock timeout
(the whole process group is killed), an address-space limit (RLIMIT_AS), a CPU-time backstop
(RLIMIT_CPU), a file-size limit (RLIMIT_FSIZE) and, under `bwrap`, a process cap. stdout and
stderr go to files, not pipes, so a background child that outlives the snippet cannot stall the
call; what the model sees is cut at `max_output_chars`. Every failure (timeout, non-zero exit,
killed, out of memory, too many processes) is an "Error: ..." message and `metrics["error"]`,
so it counts in the agent loop's `tool_errors`.

Under `bwrap` the code sees no file of the user or the run (only the system, the Python
installation and its scratch dir), no network, no other process and no parent environment.
Under `process` it is resource control only: it can read and write the user's files, use the
network, read `/proc/<pid>/environ` of processes of the same user, and a child that calls
setsid() escapes the kill. docs/agents.md ("What the sandbox contains and what it does not")
has the exact lists.
"""
from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import sys
import tempfile
from typing import Any

from jaxrl_llm.agent.tools._base import BaseTool, ToolResponse, check_config_keys
from jaxrl_llm.agent.tools._schema import OpenAIFunctionToolSchema, make_schema
from jaxrl_llm.sandbox import Limits, Sandbox, make_sandbox

_MAX_FILE_MB = 64  # any file the snippet writes, its stdout and stderr included


@dataclasses.dataclass(frozen=True)
class PythonRun:
    """The outcome of one run. `returncode` < 0 means killed by that signal."""

    stdout: str
    stderr: str
    returncode: int | None
    timed_out: bool


def _read_capped(path: str, limit: int) -> str:
    with open(path, "rb") as f:
        kept = f.read(limit)
    dropped = os.path.getsize(path) - len(kept)
    text = kept.decode("utf-8", errors="replace")
    return text + (f"\n... [{dropped} more bytes truncated]" if dropped > 0 else "")


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


async def _run_in(tmp: str, code: str, box: Sandbox, limits: Limits, timeout_s: float,
                  max_output_chars: int) -> PythonRun:
    workdir, files = os.path.join(tmp, "work"), {n: os.path.join(tmp, n) for n in
                                                 ("code", "stdout", "stderr")}
    os.mkdir(workdir)
    with open(files["code"], "w", encoding="utf-8") as f:
        f.write(code)
    argv, env = box.wrap([sys.executable, "-I", "-"], scratch=workdir, limits=limits)
    with open(files["code"], "rb") as stdin, open(files["stdout"], "wb") as stdout, \
            open(files["stderr"], "wb") as stderr:
        proc = await asyncio.create_subprocess_exec(
            *argv, stdin=stdin, stdout=stdout, stderr=stderr, cwd=workdir, env=env,
            start_new_session=True)
    timed_out = False
    try:
        await asyncio.wait_for(proc.wait(), timeout_s)
    except asyncio.TimeoutError:
        timed_out = True
    finally:
        _kill_group(proc.pid)  # the snippet's children too (under bwrap: its PID namespace)
        await proc.wait()
    return PythonRun(_read_capped(files["stdout"], max_output_chars),
                     _read_capped(files["stderr"], max_output_chars), proc.returncode,
                     timed_out)


async def run_python(code: str, *, timeout_s: float = 5.0, memory_mb: int = 512,
                     max_processes: int = 64, max_output_chars: int = 4096,
                     sandbox: Sandbox | None = None) -> PythonRun:
    """Runs `code` under the limits above in `sandbox` (None: `make_sandbox("auto")`); never
    raises for anything the code does."""
    box = sandbox if sandbox is not None else make_sandbox("auto")
    limits = Limits(cpu_s=int(timeout_s) + 1, memory_mb=memory_mb, nproc=max_processes,
                    fsize_mb=_MAX_FILE_MB)
    with tempfile.TemporaryDirectory(prefix="jaxrl_python_tool_") as tmp:
        return await _run_in(tmp, code, box, limits, timeout_s, max_output_chars)


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def run_error(run: PythonRun, *, timeout_s: float, memory_mb: int, max_processes: int
              ) -> tuple[str, str] | None:
    """(kind, message) when the run failed, else None. kind: timeout | memory | processes |
    killed | exit_code."""
    if run.timed_out:
        return "timeout", f"timed out after {timeout_s:g} s"
    if run.returncode == 0:
        return None
    if "MemoryError" in run.stderr:
        return "memory", f"memory limit exceeded ({memory_mb} MB)"
    if "BlockingIOError" in run.stderr or "Resource temporarily unavailable" in run.stderr:
        return "processes", f"process limit reached ({max_processes} processes)"
    if run.returncode is not None and run.returncode < 0:
        return "killed", f"killed by {_signal_name(-run.returncode)}"
    if run.returncode is not None and run.returncode > 128:  # bwrap: 128 + the child's signal
        name = _signal_name(run.returncode - 128)
        return "killed", f"exit code {run.returncode} (killed by {name}?)"
    return "exit_code", f"exit code {run.returncode}"


def format_run(run: PythonRun, *, timeout_s: float, memory_mb: int,
               max_processes: int = 64) -> str:
    """The tool message: the output, or "Error: ..." first when the run failed."""
    output = run.stdout + (f"\n[stderr]\n{run.stderr}" if run.stderr.strip() else "")
    error = run_error(run, timeout_s=timeout_s, memory_mb=memory_mb, max_processes=max_processes)
    if error is None:
        return output if output.strip() else "(no output)"
    return f"Error: {error[1]}" + ("\n" + output if output.strip() else "")


class PythonTool(BaseTool):
    """Built-in `python`. Config: `timeout_s` (5), `memory_mb` (512), `max_processes` (64;
    enforced under the `bwrap` sandbox only), `max_output_chars` (4096 bytes per stream).
    `sandbox`: a backend name ("auto" | "bwrap" | "process") or a `Sandbox`; the agent runner
    passes `rollout.multi_turn.sandbox`."""

    _CONFIG_KEYS = {"timeout_s", "memory_mb", "max_processes", "max_output_chars"}

    @classmethod
    def default_tool_schema(cls) -> OpenAIFunctionToolSchema:
        return make_schema(
            "python", "Run Python 3 code in a fresh interpreter and return what it prints "
            "(stdout, then stderr). Use print() to see results.",
            {"code": {"type": "string", "description": "The Python code to run."}}, ["code"])

    def __init__(self, config: dict[str, Any] | None = None, tool_schema=None, *,
                 sandbox: str | Sandbox = "auto"):
        super().__init__(config, tool_schema)
        check_config_keys("python", self.config, self._CONFIG_KEYS)
        self.timeout_s = float(self.config.get("timeout_s", 5.0))
        self.memory_mb = int(self.config.get("memory_mb", 512))
        self.max_processes = int(self.config.get("max_processes", 64))
        self.max_output_chars = int(self.config.get("max_output_chars", 4096))
        if min(self.timeout_s, self.memory_mb, self.max_processes, self.max_output_chars) <= 0:
            raise ValueError(f"tool 'python': timeout_s, memory_mb, max_processes and "
                             f"max_output_chars must be positive, got {self.config}")
        self.sandbox = make_sandbox(sandbox) if isinstance(sandbox, str) else sandbox

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs
                      ) -> tuple[ToolResponse, float, dict]:
        error = self.validate_arguments(parameters)
        if error:
            return ToolResponse(text=error), 0.0, {"error": "invalid_arguments"}
        run = await run_python(parameters["code"], timeout_s=self.timeout_s,
                               memory_mb=self.memory_mb, max_processes=self.max_processes,
                               max_output_chars=self.max_output_chars, sandbox=self.sandbox)
        limits = dict(timeout_s=self.timeout_s, memory_mb=self.memory_mb,
                      max_processes=self.max_processes)
        metrics = {"returncode": run.returncode, "timed_out": run.timed_out}
        failure = run_error(run, **limits)
        if failure is not None:  # counted in the agent loop's tool_errors
            metrics["error"] = failure[0]
        return ToolResponse(text=format_run(run, **limits)), 0.0, metrics
