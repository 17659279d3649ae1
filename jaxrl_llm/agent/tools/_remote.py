"""Tool classes from a tool config file run in a process of their own (`RemoteTool`).

A user's `BaseTool` subclass keeps per-trajectory state between `create`, `execute`,
`calc_reward` and `release`, so all calls of one tool go to one host process
(`python -m jaxrl_llm._worker_main host`), which builds the tool object from its class name,
config and schema and runs it on its own asyncio loop (calls of different trajectories overlap,
as in-process). The host starts through a `jaxrl_llm.sandbox` backend: a scrubbed environment
without the trainer's secrets, a scratch dir as HOME, an address-space limit (RLIMIT_AS). Calls
and results travel as JSON lines (a `ToolResponse` as its text; nothing is unpickled), so the
config, the call arguments and the results must be JSON data. Every call has a timeout. A call
that overruns it kills the host's process group before the error is reported; a host that dies
(`os._exit`, a segfault) is restarted on the next call. Either way the calls in flight fail with
an error the agent loop turns into a message for the model, and the tool's state for the
trajectories it held is gone (their next calls are errors). Built-in tools (`calculator`,
`python`) are trusted code and run in the trainer's process.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import sys
import threading
from typing import Any

from jaxrl_llm._subprocess_worker import WorkerBroken, WorkerProcess
from jaxrl_llm._worker_main import TOOL_RESPONSE_KEY
from jaxrl_llm.agent.tools._base import BaseTool, ToolResponse, create_arguments
from jaxrl_llm.agent.tools._schema import OpenAIFunctionToolSchema
from jaxrl_llm.sandbox import Limits, Sandbox, make_sandbox


def _class_files(cls: type) -> tuple[str, ...]:
    """What the host must be able to read to import `cls`: its top-level package (or module)."""
    top = sys.modules.get(cls.__module__.partition(".")[0])
    if top is None:
        return ()
    paths = getattr(top, "__path__", None)
    return tuple(paths) if paths else ((top.__file__,) if getattr(top, "__file__", None) else ())


def _decode(value: Any) -> Any:
    """A host's result back in Python: {TOOL_RESPONSE_KEY: text} -> ToolResponse, a list at
    the top -> tuple (verl's (id, response) and (response, reward, metrics))."""
    def one(v):
        if isinstance(v, dict) and set(v) == {TOOL_RESPONSE_KEY} and isinstance(
                v[TOOL_RESPONSE_KEY], str):
            return ToolResponse(text=v[TOOL_RESPONSE_KEY])
        return v
    return tuple(one(v) for v in value) if isinstance(value, list) else one(value)


class _Host:
    """The parent's side of one host process: sends calls, a reader thread resolves them."""

    def __init__(self, class_name: str, config: dict, schema: dict | None, *,
                 memory_limit_gb: float, sandbox: Sandbox, ro_paths: tuple[str, ...],
                 start_timeout_s: float = 120.0):
        self.class_name = class_name
        self._init = {"class_name": class_name, "config": config, "schema": schema}
        self._limits = Limits(memory_mb=int(memory_limit_gb * 1024))
        self._sandbox, self._ro_paths = sandbox, ro_paths
        self.start_timeout_s = start_timeout_s
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._pending: dict[int, concurrent.futures.Future] = {}
        self.worker: WorkerProcess | None = None
        self.schema = self._start()

    def _start(self) -> dict:
        what = f"tool class {self.class_name!r}"
        worker = WorkerProcess(["host"], sandbox=self._sandbox, limits=self._limits,
                               ro_paths=self._ro_paths, name=f"tool host {self.class_name}")
        try:
            worker.send(self._init)
        except (TypeError, ValueError) as e:
            worker.kill()
            raise ValueError(f"{what}: its config and tool_schema must be JSON data to reach "
                             f"its process ({e})") from None
        except WorkerBroken:
            pass  # wait_ready reports it
        ready = worker.wait_ready(self.start_timeout_s, what)
        if not isinstance(ready.get("schema"), dict):
            worker.kill()
            raise RuntimeError(f"{what}: its process sent no tool schema")
        self.worker = worker
        threading.Thread(target=self._read, args=(worker,), daemon=True,
                         name=f"tool-host-{self.class_name}").start()
        return ready["schema"]

    def _read(self, worker: WorkerProcess) -> None:
        while True:
            try:
                reply = worker.receive(None)
            except WorkerBroken as e:
                self._fail_all(worker, str(e) if e.exit_code is None
                               else f"its process ended (exit code {e.exit_code})")
                worker.kill()
                return
            req_id = reply.get("id")
            with self._lock:
                fut = self._pending.pop(req_id, None) if isinstance(req_id, int) else None
            if fut is None or fut.done():
                continue
            if reply.get("ok") is True:
                fut.set_result(_decode(reply.get("result")))
            else:
                error = reply.get("error")
                fut.set_exception(RuntimeError(error if isinstance(error, str)
                                               else "malformed reply from its process"))

    def _fail_all(self, worker: WorkerProcess, why: str) -> None:
        with self._lock:
            if worker is not self.worker:
                return
            pending, self._pending = self._pending, {}
            self.worker = None
        for fut in pending.values():
            if not fut.done():
                fut.set_exception(RuntimeError(f"tool {self.class_name!r} failed: {why}"))

    def submit(self, method: str, args: tuple, kwargs: dict) -> concurrent.futures.Future:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if self.worker is None:
                self._start()
            req_id = next(self._ids)
            try:
                self.worker.send({"id": req_id, "method": method, "args": list(args),
                                  "kwargs": kwargs})
            except (TypeError, ValueError) as e:
                fut.set_exception(TypeError(f"tool {self.class_name!r}: the arguments of "
                                            f"{method} must be JSON data ({e})"))
                return fut
            except WorkerBroken:
                pass  # the reader thread fails every pending call, this one included
            self._pending[req_id] = fut
        return fut

    def restart(self, why: str) -> None:
        """Kills the host (its calls in flight fail); the next call starts a new one."""
        worker = self.worker
        if worker is not None:
            self._fail_all(worker, why)
            worker.signal_group()
            worker.wait_exit()  # dead before the caller reports the call as failed

    def close(self) -> None:
        with self._lock:
            worker, self.worker = self.worker, None
        if worker is not None:
            try:
                worker.process.stdin.close()  # the host's loop ends
            except OSError:
                pass
            worker.wait_exit()
            worker.kill()


class RemoteTool(BaseTool):
    """A tool config entry's class, run in its own process (see the module docstring)."""

    def __init__(self, class_name: str, config: dict | None, tool_schema: dict | None, *,
                 timeout_s: float, memory_limit_gb: float, sandbox: Sandbox | str = "auto"):
        from jaxrl_llm.agent.tools._registry import get_tool_class

        self._cls = get_tool_class(class_name)
        self._host = _Host(class_name, dict(config or {}), tool_schema,
                           memory_limit_gb=memory_limit_gb,
                           sandbox=make_sandbox(sandbox) if isinstance(sandbox, str) else sandbox,
                           ro_paths=_class_files(self._cls))
        super().__init__(tool_schema=OpenAIFunctionToolSchema.from_dict(self._host.schema))
        self.timeout_s = timeout_s

    async def _call(self, method: str, *args, **kwargs):
        fut = self._host.submit(method, args, kwargs)
        try:
            return await asyncio.wait_for(asyncio.wrap_future(fut), self.timeout_s)
        except (asyncio.TimeoutError, asyncio.CancelledError):
            self._host.restart(f"a {method} call ran past {self.timeout_s:g} s")
            raise

    def create_arguments(self, create_kwargs: dict[str, Any]) -> dict[str, Any]:
        return create_arguments(self._cls.create, create_kwargs)  # the real class's signature

    async def create(self, instance_id: str | None = None, **kwargs):
        return await self._call("create", instance_id, **kwargs)

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs):
        return await self._call("execute", instance_id, parameters, **kwargs)

    async def calc_reward(self, instance_id: str, **kwargs) -> float:
        return await self._call("calc_reward", instance_id, **kwargs)

    async def release(self, instance_id: str, **kwargs) -> None:
        await self._call("release", instance_id, **kwargs)

    def close(self) -> None:
        self._host.close()
