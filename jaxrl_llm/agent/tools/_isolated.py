"""User function tools run in worker processes: a hung, crashing or memory-hungry tool cannot take
the trainer down with it, and it does not see the trainer's environment.

`load_isolated_function_tools(path)` gives one `IsolatedFunctionTool` per `@function_tool` of a
Python file. The tools share a small pool of worker processes (`python -m
jaxrl_llm._worker_main`, started through a `jaxrl_llm.sandbox` backend: a scrubbed environment
without the trainer's secrets, a private scratch dir as HOME and cwd, an address-space limit;
`bwrap` also hides the file system and the network). Each worker imports the file once and
serves one call at a time, over JSON lines on its stdin/stdout (nothing a worker sends is
unpickled). A call's timeout counts from the moment a worker takes it: a call waiting for a free
worker has no clock running (each call ahead of it ends within its own timeout, and a worker's
start within `start_timeout_s`). A call that overruns its timeout, or whose worker dies
(`os._exit`, a segfault, the memory limit), kills that worker's process group before the error
reaches the model, so a call reported as failed never runs on later; a fresh worker serves the
next call. A cancelled call that has not started never starts. Arguments are checked against
the tool's schema in the parent, before anything is sent. The parent imports the file too, for
the schemas: it is the user's code, trusted like a config file; what the model passes it runs
in the workers only. Stateful `BaseTool` classes (tool config files) run elsewhere
(`RemoteTool`).
"""
from __future__ import annotations

import asyncio
import os
import queue
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from jaxrl_llm._subprocess_worker import WorkerBroken, WorkerProcess
from jaxrl_llm.agent.tools._base import BaseTool, ToolResponse
from jaxrl_llm.agent.tools._files import import_file
from jaxrl_llm.agent.tools._function import FunctionTool
from jaxrl_llm.sandbox import Limits, Sandbox, make_sandbox

_MODULE_PREFIX = "jaxrl_llm_function_tools"


def _file_tools(path: str) -> dict[str, FunctionTool]:
    module = import_file(path, _MODULE_PREFIX)
    return {v.name: v for v in vars(module).values() if isinstance(v, FunctionTool)}


class _Ticket:
    """One call's cancellation state, shared by the event loop and the thread running it."""

    def __init__(self):
        self.cancelled = False
        self.worker: WorkerProcess | None = None  # set while the call runs in it


class ToolProcessPool:
    """`num_workers` processes serving the function tools of `path`; `call` blocks a thread."""

    def __init__(self, path: str, *, num_workers: int, memory_limit_gb: float,
                 sandbox: Sandbox | str = "auto", start_timeout_s: float = 120.0):
        self.path = os.path.abspath(path)
        self.num_workers = max(1, int(num_workers))
        self.limits = Limits(memory_mb=int(memory_limit_gb * 1024))
        self.sandbox = make_sandbox(sandbox) if isinstance(sandbox, str) else sandbox
        self.start_timeout_s = start_timeout_s
        self._workers: list[WorkerProcess | None] = [None] * self.num_workers
        self._idle: queue.Queue[int] = queue.Queue()
        for i in range(self.num_workers):
            self._idle.put(i)
        self._lock = threading.Lock()
        self.executor = ThreadPoolExecutor(self.num_workers, thread_name_prefix="tool-call")
        self._closed = False

    def _start(self, i: int) -> WorkerProcess:
        worker = WorkerProcess(["tools", self.path], sandbox=self.sandbox, limits=self.limits,
                               ro_paths=(self.path,), name=f"tool worker {i}")
        worker.wait_ready(self.start_timeout_s, f"function tools of {self.path}")
        return worker

    def _kill(self, i: int) -> None:
        w, self._workers[i] = self._workers[i], None
        if w is not None:
            w.kill()

    def cancel(self, ticket: _Ticket) -> None:
        """The caller gave up on the call: it never starts, or its worker is killed now."""
        with self._lock:
            ticket.cancelled = True
            if ticket.worker is not None:
                ticket.worker.signal_group()

    def _release(self, ticket: _Ticket) -> None:
        """The call no longer runs in `ticket.worker`: `cancel` must not signal it any more."""
        with self._lock:
            ticket.worker = None

    def call(self, name: str, arguments: dict, timeout_s: float,
             ticket: _Ticket | None = None) -> tuple[str | None, str]:
        """(None, the tool's result as text), or (error kind: "timeout" | "isolated", an error
        message for the model)."""
        ticket = ticket or _Ticket()
        i = self._idle.get()  # waiting for a free worker: not part of the call's time
        try:
            if self._closed:
                return "isolated", "Error: the tool pool is closed"
            if self._workers[i] is None:
                try:
                    self._workers[i] = self._start(i)
                except RuntimeError as e:
                    return "isolated", f"Error: tool {name!r} could not run: {e}"
            return self._run(i, name, arguments, timeout_s, ticket)
        finally:
            self._release(ticket)
            self._idle.put(i)

    def _run(self, i: int, name: str, arguments: dict, timeout_s: float, ticket: _Ticket
             ) -> tuple[str | None, str]:
        w = self._workers[i]
        with self._lock:
            if ticket.cancelled:
                return "isolated", f"Error: tool {name!r} was cancelled before it ran"
            ticket.worker = w
        try:
            w.send({"name": name, "arguments": arguments})
            reply = w.receive(timeout_s)
        except WorkerBroken as e:
            self._release(ticket)
            self._kill(i)
            if ticket.cancelled:
                return "isolated", f"Error: tool {name!r} was cancelled (its process was killed)"
            if e.exit_code is None:  # alive, but it broke the protocol
                return "isolated", f"Error: tool {name!r} broke its worker process ({e})"
            return "isolated", (f"Error: tool {name!r} crashed (its process exited with "
                                f"{e.exit_code})")
        self._release(ticket)
        if reply is None:
            self._kill(i)  # dead before we answer: the call cannot finish later
            return "timeout", f"Error: tool {name!r} timed out after {timeout_s:g} s"
        if reply.get("ok") is True and isinstance(reply.get("text"), str):
            return None, reply["text"]
        if reply.get("ok") is False and isinstance(reply.get("error"), str):
            return "isolated", f"Error: tool {name!r} failed: {reply['error']}"
        self._kill(i)
        return "isolated", f"Error: tool {name!r} sent a malformed reply"

    def close(self) -> None:
        self._closed = True
        self.executor.shutdown(wait=True)
        for i in range(self.num_workers):
            self._kill(i)


class IsolatedFunctionTool(BaseTool):
    """A `@function_tool` of a file, executed in a `ToolProcessPool` worker."""

    times_own_calls = True

    def __init__(self, tool: FunctionTool, pool: ToolProcessPool, timeout_s: float):
        super().__init__(tool_schema=tool.tool_schema)
        self.pool, self.timeout_s = pool, timeout_s

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs
                      ) -> tuple[ToolResponse, float, dict]:
        error = self.validate_arguments(parameters)
        if error:
            return ToolResponse(text=error), 0.0, {"error": "invalid_arguments"}
        loop = asyncio.get_running_loop()
        ticket = _Ticket()
        try:
            error, text = await loop.run_in_executor(self.pool.executor, self.pool.call, self.name,
                                                  dict(parameters), self.timeout_s, ticket)
        except asyncio.CancelledError:
            self.pool.cancel(ticket)
            raise
        return ToolResponse(text=text), 0.0, ({} if error is None else {"error": error})


def load_isolated_function_tools(path: str | os.PathLike, *, timeout_s: float,
                                 memory_limit_gb: float, num_workers: int = 2,
                                 sandbox: Sandbox | str = "auto"
                                 ) -> tuple[dict[str, IsolatedFunctionTool], ToolProcessPool]:
    """The file's function tools, run in worker processes contained by `sandbox` (a
    `jaxrl_llm.sandbox.Sandbox` or its kind: "auto" | "bwrap" | "process"); close the returned
    pool when done."""
    path = os.fspath(path)
    tools = _file_tools(path)  # the schemas (and import errors) here, in the parent
    if not tools:
        raise ValueError(f"{path} defines no @function_tool functions (decorate them with "
                         f"jaxrl_llm.agent.tools.function_tool)")
    pool = ToolProcessPool(path, num_workers=num_workers, memory_limit_gb=memory_limit_gb,
                           sandbox=sandbox)
    wrapped = {name: IsolatedFunctionTool(t, pool, timeout_s) for name, t in tools.items()}
    return wrapped, pool
