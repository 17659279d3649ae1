"""User function tools run in worker processes: a hung, crashing or memory-hungry tool cannot take
the trainer down with it.

`load_isolated_function_tools(path)` gives one `IsolatedFunctionTool` per `@function_tool` of a
Python file. The tools share a small pool of worker processes ("forkserver" context, never
"fork": the parent runs JAX's threads); each worker imports the file once, has an address-space
limit (RLIMIT_AS), and serves one call at a time. A call that overruns its timeout, or whose
worker dies (`os._exit`, a segfault, the memory limit hit outside Python), kills and replaces
that worker and comes back to the model as an error message. Arguments are checked against the
tool's schema in the parent, before anything is sent. Stateful `BaseTool` classes (tool config
files) run in the trainer's process like built-in tools: they are trusted code, with a timeout
per call (`run_tool_call`).
"""
from __future__ import annotations

import asyncio
import dataclasses
import multiprocessing as mp
import os
import queue
import resource
import signal
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from jaxrl_llm.agent.tools._base import BaseTool, ToolResponse
from jaxrl_llm.agent.tools._files import import_file
from jaxrl_llm.agent.tools._function import FunctionTool, _to_text

_MODULE_PREFIX = "jaxrl_llm_function_tools"


def _file_tools(path: str) -> dict[str, FunctionTool]:
    module = import_file(path, _MODULE_PREFIX)
    return {v.name: v for v in vars(module).values() if isinstance(v, FunctionTool)}


def _worker_main(conn, path: str, memory_bytes: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    if memory_bytes > 0:
        resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    tools = _file_tools(path)
    conn.send("ready")
    while True:
        try:
            task = conn.recv()
        except EOFError:
            return
        if task is None:
            return
        name, arguments = task
        try:
            result = tools[name].fn(**arguments)
            if asyncio.iscoroutine(result):
                result = asyncio.run(result)
            text = result.text if isinstance(result, ToolResponse) else _to_text(result)
            conn.send(("ok", text))
        except BaseException as e:  # noqa: BLE001 - MemoryError, SystemExit...: a message
            conn.send(("error", f"{type(e).__name__}: {e}"))


@dataclasses.dataclass
class _Worker:
    process: Any
    conn: Any


class ToolProcessPool:
    """`num_workers` processes serving the function tools of `path`; `call` blocks a thread."""

    def __init__(self, path: str, *, num_workers: int, memory_limit_gb: float,
                 start_timeout_s: float = 120.0):
        self.path = os.path.abspath(path)
        self.num_workers = max(1, int(num_workers))
        self.memory_bytes = int(memory_limit_gb * 2**30)
        self.start_timeout_s = start_timeout_s
        self._ctx = mp.get_context("forkserver")
        self._workers: list[_Worker | None] = [None] * self.num_workers
        self._idle: queue.Queue[int] = queue.Queue()
        for i in range(self.num_workers):
            self._idle.put(i)
        self.executor = ThreadPoolExecutor(self.num_workers, thread_name_prefix="tool-call")
        self._closed = False

    def _start(self, i: int) -> _Worker:
        parent, child = self._ctx.Pipe()
        process = self._ctx.Process(target=_worker_main, args=(child, self.path, self.memory_bytes),
                                    daemon=True, name=f"tool-worker-{i}")
        process.start()
        child.close()
        if not parent.poll(self.start_timeout_s):
            process.kill()
            raise RuntimeError(f"tool worker for {self.path} did not start in "
                               f"{self.start_timeout_s:g} s")
        try:
            ready = parent.recv()
        except EOFError:
            raise RuntimeError(f"tool worker for {self.path} died while importing it (exit code "
                               f"{process.exitcode}); run the file with python to see why") from None
        assert ready == "ready", ready
        return _Worker(process, parent)

    def _kill(self, i: int) -> None:
        w, self._workers[i] = self._workers[i], None
        if w is not None:
            w.process.kill()
            w.process.join(5)
            w.conn.close()

    def call(self, name: str, arguments: dict, timeout_s: float) -> tuple[bool, str]:
        """(ok, text): the tool's result as text, or an error message for the model."""
        i = self._idle.get()
        try:
            if self._closed:
                return False, "Error: the tool pool is closed"
            if self._workers[i] is None:
                self._workers[i] = self._start(i)
            w = self._workers[i]
            w.conn.send((name, arguments))
            if not w.conn.poll(timeout_s):
                self._kill(i)
                return False, f"Error: tool {name!r} timed out after {timeout_s:g} s"
            try:
                status, text = w.conn.recv()
            except EOFError:
                w.process.join(5)  # it is exiting: collect its exit code
                code = w.process.exitcode
                self._kill(i)
                return False, f"Error: tool {name!r} crashed (its process exited with {code})"
            return status == "ok", text if status == "ok" else f"Error: tool {name!r} failed: {text}"
        finally:
            self._idle.put(i)

    def close(self) -> None:
        self._closed = True
        self.executor.shutdown(wait=True)
        for i in range(self.num_workers):
            w = self._workers[i]
            if w is not None:
                try:
                    w.conn.send(None)
                except (BrokenPipeError, OSError):
                    pass
                self._kill(i)


class IsolatedFunctionTool(BaseTool):
    """A `@function_tool` of a file, executed in a `ToolProcessPool` worker."""

    def __init__(self, tool: FunctionTool, pool: ToolProcessPool, timeout_s: float):
        super().__init__(tool_schema=tool.tool_schema)
        self.pool, self.timeout_s = pool, timeout_s

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs
                      ) -> tuple[ToolResponse, float, dict]:
        error = self.validate_arguments(parameters)
        if error:
            return ToolResponse(text=error), 0.0, {"error": "invalid_arguments"}
        loop = asyncio.get_running_loop()
        ok, text = await loop.run_in_executor(self.pool.executor, self.pool.call, self.name,
                                              dict(parameters), self.timeout_s)
        return ToolResponse(text=text), 0.0, ({} if ok else {"error": "isolated"})


def load_isolated_function_tools(path: str | os.PathLike, *, timeout_s: float,
                                 memory_limit_gb: float, num_workers: int = 2
                                 ) -> tuple[dict[str, IsolatedFunctionTool], ToolProcessPool]:
    """The file's function tools, run in worker processes; close the returned pool when done."""
    path = os.fspath(path)
    tools = _file_tools(path)  # the schemas (and import errors) here, in the parent
    if not tools:
        raise ValueError(f"{path} defines no @function_tool functions (decorate them with "
                         f"jaxrl_llm.agent.tools.function_tool)")
    pool = ToolProcessPool(path, num_workers=num_workers, memory_limit_gb=memory_limit_gb)
    wrapped = {name: IsolatedFunctionTool(t, pool, timeout_s) for name, t in tools.items()}
    return wrapped, pool
