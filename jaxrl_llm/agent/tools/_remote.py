"""Tool classes from a tool config file run in a process of their own (`RemoteTool`).

A user's `BaseTool` subclass keeps per-trajectory state between `create`, `execute`,
`calc_reward` and `release`, so all calls of one tool go to one host process, which runs the
tool object on its own asyncio loop (calls of different trajectories overlap, as in-process).
The host has an address-space limit (RLIMIT_AS) and every call a timeout. A call that overruns
it restarts the host; a host that dies (`os._exit`, a segfault) is restarted on the next call.
Either way the calls in flight fail with an error the agent loop turns into a message for the
model, and the tool's state for the trajectories it held is gone (their next calls are errors).
Built-in tools (`calculator`, `python`) are trusted code and run in the trainer's process.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import multiprocessing as mp
import resource
import signal
import threading
from typing import Any

from jaxrl_llm.agent.tools._base import BaseTool, ToolResponse
from jaxrl_llm.agent.tools._schema import OpenAIFunctionToolSchema

_METHODS = ("create", "execute", "calc_reward", "release")


def _host_main(conn, class_name: str, config: dict, schema: dict | None, memory_bytes: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    if memory_bytes > 0:
        resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    from jaxrl_llm.agent.tools._registry import get_tool_class

    tool = get_tool_class(class_name)(config=config, tool_schema=schema)
    conn.send(("ready", tool.tool_schema.to_dict()))
    asyncio.run(_serve(conn, tool))


async def _serve(conn, tool: BaseTool) -> None:
    loop = asyncio.get_running_loop()

    async def one(req_id, method, args, kwargs):
        try:
            result = await getattr(tool, method)(*args, **kwargs)
            conn.send((req_id, "ok", result))
        except BaseException as e:  # noqa: BLE001 - reported to the caller, the host lives on
            conn.send((req_id, "error", f"{type(e).__name__}: {e}"))

    tasks = set()
    while True:
        try:
            message = await loop.run_in_executor(None, conn.recv)
        except EOFError:
            return
        if message is None:
            return
        task = loop.create_task(one(*message))
        tasks.add(task)
        task.add_done_callback(tasks.discard)


class _Host:
    """The parent's side of one host process: sends calls, a reader thread resolves them."""

    def __init__(self, class_name: str, config: dict, schema: dict | None, memory_limit_gb: float,
                 start_timeout_s: float = 120.0):
        self.args = (class_name, config, schema, int(memory_limit_gb * 2**30))
        self.start_timeout_s = start_timeout_s
        self._ctx = mp.get_context("forkserver")
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._pending: dict[int, concurrent.futures.Future] = {}
        self.process = self.conn = None
        self.schema = self._start()

    def _start(self) -> dict:
        parent, child = self._ctx.Pipe()
        process = self._ctx.Process(target=_host_main, args=(child, *self.args), daemon=True,
                                    name=f"tool-host-{self.args[0]}")
        process.start()
        child.close()
        if not parent.poll(self.start_timeout_s):
            process.kill()
            raise RuntimeError(f"tool {self.args[0]!r} did not start in {self.start_timeout_s:g} s")
        try:
            _, schema = parent.recv()
        except EOFError:
            process.join(5)
            raise RuntimeError(f"tool class {self.args[0]!r} failed to start in its process (exit "
                               f"code {process.exitcode}); construct it in Python to see why") from None
        self.process, self.conn = process, parent
        threading.Thread(target=self._read, args=(process, parent), daemon=True).start()
        return schema

    def _read(self, process, conn) -> None:
        while True:
            try:
                req_id, status, value = conn.recv()
            except (EOFError, OSError):
                process.join(5)
                self._fail_all(process, f"its process ended (exit code {process.exitcode})")
                return
            with self._lock:
                fut = self._pending.pop(req_id, None)
            if fut is not None and not fut.done():
                if status == "ok":
                    fut.set_result(value)
                else:
                    fut.set_exception(RuntimeError(value))

    def _fail_all(self, process, why: str) -> None:
        with self._lock:
            if process is not self.process:
                return
            pending, self._pending = self._pending, {}
            self.process = None
        for fut in pending.values():
            if not fut.done():
                fut.set_exception(RuntimeError(f"tool {self.args[0]!r} failed: {why}"))

    def submit(self, method: str, args: tuple, kwargs: dict) -> concurrent.futures.Future:
        with self._lock:
            if self.process is None or not self.process.is_alive():
                self._start()
            req_id, fut = next(self._ids), concurrent.futures.Future()
            self._pending[req_id] = fut
            self.conn.send((req_id, method, args, kwargs))
        return fut

    def restart(self, why: str) -> None:
        """Kills the host (its calls in flight fail); the next call starts a new one."""
        process = self.process
        if process is not None:
            process.kill()
            self._fail_all(process, why)

    def close(self) -> None:
        process, self.process = self.process, None
        if process is not None:
            try:
                self.conn.send(None)
            except (BrokenPipeError, OSError):
                pass
            process.join(5)
            if process.is_alive():
                process.kill()


class RemoteTool(BaseTool):
    """A tool config entry's class, run in its own process (see the module docstring)."""

    def __init__(self, class_name: str, config: dict | None, tool_schema: dict | None, *,
                 timeout_s: float, memory_limit_gb: float):
        self._host = _Host(class_name, dict(config or {}), tool_schema, memory_limit_gb)
        super().__init__(tool_schema=OpenAIFunctionToolSchema.from_dict(self._host.schema))
        self.timeout_s = timeout_s

    async def _call(self, method: str, *args, **kwargs):
        fut = self._host.submit(method, args, kwargs)
        try:
            return await asyncio.wait_for(asyncio.wrap_future(fut), self.timeout_s)
        except (asyncio.TimeoutError, asyncio.CancelledError):
            self._host.restart(f"a {method} call ran past {self.timeout_s:g} s")
            raise

    async def create(self, instance_id: str | None = None, **kwargs):
        return await self._call("create", instance_id, **kwargs)

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs):
        return await self._call("execute", instance_id, parameters, **kwargs)

    async def calc_reward(self, instance_id: str, **kwargs) -> float:
        return await self._call("calc_reward", instance_id, **kwargs)

    async def release(self, instance_id: str, **kwargs) -> None:
        return await self._call("release", instance_id, **kwargs)

    def close(self) -> None:
        self._host.close()
