"""A small process pool for scoring with a per-call timeout and replaceable workers.

`concurrent.futures` cannot kill one hung task, so each worker here is its own process with a
pipe: the parent hands out one task at a time, and a worker that overruns `timeout_s` on its
task (or dies) is killed and replaced while the others keep going. Workers start with a
"forkserver" (default) or "spawn" context, never "fork": the parent runs JAX's threads.
Workers are daemon processes, so a scorer may not start `multiprocessing` children of its own.
Each worker may get an address-space limit (`memory_limit_gb`): a scorer that allocates past
it gets a MemoryError (a counted failure) instead of taking the trainer's memory. After
`max_consecutive_timeouts` timeouts in a row (across calls) `run` gives up: `ConsecutiveTimeouts`.
"""
from __future__ import annotations

import collections
import dataclasses
import multiprocessing as mp
import resource
import signal
import time
from multiprocessing import connection
from typing import Any

from jaxrl_llm.rewards._registry import score_one

_READY = "ready"
_STARTUP_TIMEOUT_S = 120.0


class ConsecutiveTimeouts(RuntimeError):
    """Too many scoring calls in a row ran past the timeout."""

    def __init__(self, count: int):
        super().__init__(f"{count} scoring calls in a row timed out")
        self.count = count


def _worker_main(conn, custom_fn, memory_limit_gb: float = 0.0) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    if memory_limit_gb > 0:
        limit = int(memory_limit_gb * 2**30)
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    conn.send(_READY)
    while True:
        try:
            task = conn.recv()
        except EOFError:
            return
        if task is None:
            return
        index, data_source, solution_str, ground_truth, extra_info = task
        try:
            score, extras = score_one(custom_fn, data_source, solution_str, ground_truth,
                                      extra_info)
            conn.send((index, "ok", score, extras))
        except Exception as e:  # noqa: BLE001 - any scorer failure is a counted 0
            conn.send((index, "error", f"{type(e).__name__}: {e}", None))


@dataclasses.dataclass
class _Worker:
    process: Any
    conn: Any


class WorkerPool:
    """`num_workers` scoring processes, started lazily and replaced when killed."""

    def __init__(self, num_workers: int, custom_fn=None, start_method: str = "forkserver", *,
                 memory_limit_gb: float = 0.0, max_consecutive_timeouts: int = 0):
        if start_method not in mp.get_all_start_methods() or start_method == "fork":
            raise ValueError(f"start_method must be 'forkserver' or 'spawn' (available: "
                             f"{mp.get_all_start_methods()}), got {start_method!r}")
        self._ctx = mp.get_context(start_method)
        self._custom_fn = custom_fn
        self._workers: list[_Worker | None] = [None] * num_workers
        self.num_started = 0
        self._memory_limit_gb = memory_limit_gb
        self._max_timeouts = max_consecutive_timeouts
        self.consecutive_timeouts = 0

    def _start(self, slots: list[int]) -> None:
        for slot in slots:
            parent, child = self._ctx.Pipe()
            process = self._ctx.Process(target=_worker_main,
                                        args=(child, self._custom_fn, self._memory_limit_gb),
                                        daemon=True, name=f"reward-worker-{slot}")
            process.start()
            child.close()
            self._workers[slot] = _Worker(process, parent)
        for slot in slots:
            worker = self._workers[slot]
            if not worker.conn.poll(_STARTUP_TIMEOUT_S) or worker.conn.recv() != _READY:
                self._kill(slot)
                raise RuntimeError(f"reward worker {slot} did not start within "
                                   f"{_STARTUP_TIMEOUT_S:.0f}s")

    def _kill(self, slot: int) -> None:
        worker = self._workers[slot]
        self._workers[slot] = None
        if worker is None:
            return
        worker.process.kill()
        worker.process.join(timeout=10)
        worker.conn.close()

    def run(self, tasks: list[tuple], timeout_s: float) -> list[tuple]:
        """Scores each (data_source, solution_str, ground_truth, extra_info) task.

        Returns per task ("ok", score, extras), ("error", message, None) or
        ("timeout", message, None).
        """
        results: list[tuple | None] = [None] * len(tasks)
        pending = collections.deque(range(len(tasks)))
        busy: dict[int, tuple[int, float]] = {}  # slot -> (task index, start time)
        while pending or busy:
            idle = [s for s in range(len(self._workers)) if s not in busy]
            missing = [s for s in idle[: len(pending)] if self._workers[s] is None]
            if missing:
                self.num_started += len(missing)
                self._start(missing)
            for slot in idle:
                if not pending:
                    break
                i = pending.popleft()
                try:
                    self._workers[slot].conn.send((i, *tasks[i]))
                except Exception as e:  # noqa: BLE001 - unpicklable task or dead worker
                    results[i] = ("error", f"could not send task: {type(e).__name__}: {e}", None)
                    self._kill(slot)
                    continue
                busy[slot] = (i, time.monotonic())
            if not busy:
                continue
            deadline = min(start for _, start in busy.values()) + timeout_s
            conns = {self._workers[s].conn: s for s in busy}
            for conn in connection.wait(list(conns), max(0.0, deadline - time.monotonic())):
                slot = conns[conn]
                i, _ = busy.pop(slot)
                self.consecutive_timeouts = 0
                try:
                    _, status, value, extras = conn.recv()
                    results[i] = (status, value, extras)
                except (EOFError, OSError):
                    process = self._workers[slot].process
                    process.join(timeout=1)
                    code = process.exitcode
                    self._kill(slot)
                    results[i] = ("error", f"reward worker died while scoring (exit code {code})", None)
            now = time.monotonic()
            for slot, (i, start) in list(busy.items()):
                if now - start >= timeout_s:
                    busy.pop(slot)
                    results[i] = ("timeout", f"scoring took over {timeout_s}s", None)
                    self._kill(slot)
                    self.consecutive_timeouts += 1
            if self._max_timeouts and self.consecutive_timeouts >= self._max_timeouts:
                for slot in list(busy):
                    self._kill(slot)
                raise ConsecutiveTimeouts(self.consecutive_timeouts)
        return results

    def close(self) -> None:
        for slot, worker in enumerate(self._workers):
            if worker is None:
                continue
            try:
                worker.conn.send(None)
                worker.process.join(timeout=2)
            except Exception:  # noqa: BLE001 - best effort; killed below
                pass
            self._kill(slot)
