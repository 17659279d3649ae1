"""`python`: runs a snippet of Python code in a fresh interpreter and returns its output.

Each call gets its own process (`python -I` reading the code from stdin, an empty temporary
working directory, a minimal environment) in its own process group, with a wall-clock timeout
(the whole group is killed), an address-space limit (RLIMIT_AS), a CPU-time backstop
(RLIMIT_CPU) and a file-size limit (RLIMIT_FSIZE). stdout and stderr go to files, not pipes,
so a background child that outlives the snippet cannot stall the call; what the model sees
is cut at `max_output_chars`. The limits are set by a tiny bootstrap that then execs the
interpreter (limits survive exec), not by a `preexec_fn`, which can deadlock a parent that
runs threads (JAX does).

This is resource control, not a security sandbox: the code can read files and use the network
as the current user, and a child that calls setsid() escapes the kill. Run untrusted code in a
container or a VM.
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

_BOOTSTRAP = (
    "import os, resource, sys\n"
    "mem, cpu, fsize = (int(a) for a in sys.argv[1:4])\n"
    "resource.setrlimit(resource.RLIMIT_AS, (mem, mem))\n"
    "resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))\n"
    "resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))\n"
    "os.execv(sys.executable, [sys.executable, '-I', '-'])\n"
)
_KEEP_ENV = ("PATH", "LANG", "LC_ALL", "LD_LIBRARY_PATH", "SYSTEMROOT")
_MAX_FILE_BYTES = 64 << 20  # any file the snippet writes, its stdout and stderr included


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


def _environment(home: str) -> dict[str, str]:
    env = {k: os.environ[k] for k in _KEEP_ENV if k in os.environ}
    env.update(HOME=home, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
    return env


async def _run_in(tmp: str, code: str, timeout_s: float, memory_mb: int,
                  max_output_chars: int) -> PythonRun:
    workdir, files = os.path.join(tmp, "work"), {n: os.path.join(tmp, n) for n in
                                                 ("code", "stdout", "stderr")}
    os.mkdir(workdir)
    with open(files["code"], "w", encoding="utf-8") as f:
        f.write(code)
    with open(files["code"], "rb") as stdin, open(files["stdout"], "wb") as stdout, \
            open(files["stderr"], "wb") as stderr:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-I", "-c", _BOOTSTRAP, str(memory_mb << 20),
            str(int(timeout_s) + 1), str(_MAX_FILE_BYTES), stdin=stdin, stdout=stdout,
            stderr=stderr, cwd=workdir, env=_environment(workdir), start_new_session=True)
    timed_out = False
    try:
        await asyncio.wait_for(proc.wait(), timeout_s)
    except asyncio.TimeoutError:
        timed_out = True
    finally:
        _kill_group(proc.pid)  # the snippet's children too, timed out or not
        await proc.wait()
    return PythonRun(_read_capped(files["stdout"], max_output_chars),
                     _read_capped(files["stderr"], max_output_chars), proc.returncode,
                     timed_out)


async def run_python(code: str, *, timeout_s: float = 5.0, memory_mb: int = 512,
                     max_output_chars: int = 4096) -> PythonRun:
    """Runs `code` under the limits above; never raises for anything the code does."""
    with tempfile.TemporaryDirectory(prefix="jaxrl_python_tool_") as tmp:
        return await _run_in(tmp, code, timeout_s, memory_mb, max_output_chars)


def format_run(run: PythonRun, *, timeout_s: float, memory_mb: int) -> str:
    """The tool message: the output, or "Error: ..." first when the run failed."""
    output = run.stdout + (f"\n[stderr]\n{run.stderr}" if run.stderr.strip() else "")
    if run.timed_out:
        error = f"Error: timed out after {timeout_s:g} s"
    elif run.returncode == 0:
        return output if output.strip() else "(no output)"
    elif "MemoryError" in run.stderr:
        error = f"Error: memory limit exceeded ({memory_mb} MB)"
    elif run.returncode is not None and run.returncode < 0:
        error = f"Error: killed by signal {signal.Signals(-run.returncode).name}"
    else:
        error = f"Error: exit code {run.returncode}"
    return error + ("\n" + output if output.strip() else "")


class PythonTool(BaseTool):
    """Built-in `python`. Config: `timeout_s` (5), `memory_mb` (512), `max_output_chars`
    (4096 bytes per stream)."""

    @classmethod
    def default_tool_schema(cls) -> OpenAIFunctionToolSchema:
        return make_schema(
            "python", "Run Python 3 code in a fresh interpreter and return what it prints "
            "(stdout, then stderr). Use print() to see results.",
            {"code": {"type": "string", "description": "The Python code to run."}}, ["code"])

    def __init__(self, config: dict[str, Any] | None = None, tool_schema=None):
        super().__init__(config, tool_schema)
        check_config_keys("python", self.config, {"timeout_s", "memory_mb", "max_output_chars"})
        self.timeout_s = float(self.config.get("timeout_s", 5.0))
        self.memory_mb = int(self.config.get("memory_mb", 512))
        self.max_output_chars = int(self.config.get("max_output_chars", 4096))
        if self.timeout_s <= 0 or self.memory_mb <= 0 or self.max_output_chars <= 0:
            raise ValueError(f"tool 'python': timeout_s, memory_mb and max_output_chars must "
                             f"be positive, got {self.config}")

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs
                      ) -> tuple[ToolResponse, float, dict]:
        error = self.validate_arguments(parameters)
        if error:
            return ToolResponse(text=error), 0.0, {"error": "invalid_arguments"}
        run = await run_python(parameters["code"], timeout_s=self.timeout_s,
                               memory_mb=self.memory_mb, max_output_chars=self.max_output_chars)
        metrics = {"returncode": run.returncode, "timed_out": run.timed_out}
        text = format_run(run, timeout_s=self.timeout_s, memory_mb=self.memory_mb)
        return ToolResponse(text=text), 0.0, metrics
