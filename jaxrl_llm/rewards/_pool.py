"""A small process pool for scoring with a per-call timeout and replaceable workers.

Each worker is its own process (`python -m jaxrl_llm._worker_main reward [file name]`, started
through a `jaxrl_llm.sandbox` backend: a scrubbed environment without the trainer's secrets, a
private scratch dir, an address-space limit `memory_limit_gb`; `bwrap` also hides the file system
and the network). It imports the reward file itself and talks JSON lines over its stdin/stdout:
a task's fields go in (numpy values as lists/numbers), a score and numeric extras come out and
are checked again here; nothing a worker sends is unpickled. The parent hands out one task at a
time per worker; a task's clock starts when a worker takes it. A worker that overruns
`timeout_s` on its task, dies or sends a malformed reply is killed (its whole process group) and
replaced while the others keep going. A scorer that allocates past the memory limit gets a
MemoryError (a counted failure) instead of taking the trainer's memory. Two breakers end `run`:
`max_consecutive_timeouts` timeouts in a row (`ConsecutiveTimeouts`) and
`max_consecutive_deaths` worker deaths in a row (`ConsecutiveDeaths`, with the exit codes);
0 turns either off.
"""
from __future__ import annotations

import collections
import os
import selectors
import sys
import time

from jaxrl_llm._subprocess_worker import WorkerBroken, WorkerProcess
from jaxrl_llm.rewards._custom import CustomRewardFn
from jaxrl_llm.rewards._registry import normalize_result
from jaxrl_llm.sandbox import Limits, Sandbox, make_sandbox

_STARTUP_TIMEOUT_S = 120.0


class ConsecutiveTimeouts(RuntimeError):
    """Too many scoring calls in a row ran past the timeout."""

    def __init__(self, count: int):
        super().__init__(f"{count} scoring calls in a row timed out")
        self.count = count


class ConsecutiveDeaths(RuntimeError):
    """Too many reward workers in a row died while scoring; `exit_codes` are the last ones."""

    def __init__(self, count: int, exit_codes: list[int | None]):
        super().__init__(f"{count} reward workers in a row died (last exit codes {exit_codes})")
        self.count, self.exit_codes = count, exit_codes


def reward_source(custom_fn) -> tuple[str, str] | None:
    """(file, function name) a worker imports for `custom_fn`; None for the built-in scorers.
    `custom_fn`: a `CustomRewardFn` or a function defined at the top level of a .py file."""
    if custom_fn is None:
        return None
    if isinstance(custom_fn, CustomRewardFn):
        return custom_fn.path, custom_fn.name
    module = sys.modules.get(getattr(custom_fn, "__module__", None) or "")
    name = getattr(custom_fn, "__qualname__", "")
    path = getattr(module, "__file__", None)
    if path is None or "." in name or getattr(module, name, None) is not custom_fn:
        raise TypeError(f"custom reward function {custom_fn!r}: worker processes load it from "
                        f"its file, so give load_custom_reward_fn(path, name) or a function "
                        f"defined at the top level of a .py file")
    return os.path.abspath(path), name


def _outcome(reply: dict) -> tuple | None:
    """A worker's reply as ("ok", score, extras) / ("error", message, None); None if it is
    not a reply our worker would send."""
    if reply.get("ok") is False and isinstance(reply.get("error"), str):
        return "error", reply["error"], None
    extras = reply.get("extras")
    if reply.get("ok") is not True or not isinstance(extras, dict):
        return None
    try:
        return ("ok", *normalize_result({**extras, "score": reply.get("score")}))
    except (TypeError, ValueError):
        return None


class WorkerPool:
    """`num_workers` scoring processes, started lazily and replaced when killed."""

    def __init__(self, num_workers: int, custom_fn=None, *, sandbox: Sandbox | str = "auto",
                 memory_limit_gb: float = 0.0, max_consecutive_timeouts: int = 0,
                 max_consecutive_deaths: int = 0):
        source = reward_source(custom_fn)
        self._args = ["reward", *(source or ())]
        self._ro_paths = (source[0],) if source else ()
        self._what = (f"custom reward function {source[1]!r} of {source[0]}" if source
                      else "built-in scorers")
        self._sandbox = make_sandbox(sandbox) if isinstance(sandbox, str) else sandbox
        self._limits = Limits(memory_mb=int(memory_limit_gb * 1024))
        self._workers: list[WorkerProcess | None] = [None] * num_workers
        self.num_started = 0
        self._max_timeouts = max_consecutive_timeouts
        self._max_deaths = max_consecutive_deaths
        self.consecutive_timeouts = 0
        self.consecutive_deaths = 0
        # exit codes of the last deaths in a row
        self._death_codes: collections.deque = collections.deque(maxlen=5)

    def _start(self, slots: list[int]) -> None:
        self.num_started += len(slots)
        for slot in slots:
            self._workers[slot] = WorkerProcess(self._args, sandbox=self._sandbox,
                                                limits=self._limits, ro_paths=self._ro_paths,
                                                name=f"reward worker {slot}")
        for slot in slots:
            try:
                self._workers[slot].wait_ready(_STARTUP_TIMEOUT_S, self._what)
            except RuntimeError:
                self._workers[slot] = None  # wait_ready killed it
                for other in slots:
                    self._kill(other)
                raise

    def _kill(self, slot: int) -> None:
        worker, self._workers[slot] = self._workers[slot], None
        if worker is not None:
            worker.kill()

    def _died(self, slot: int, broken: WorkerBroken) -> str:
        self._kill(slot)
        self._death_codes.append(broken.exit_code)
        self.consecutive_deaths += 1
        if broken.exit_code is None:  # alive, but it broke the protocol
            return f"reward worker broke while scoring: {broken}"
        return f"reward worker died while scoring (exit code {broken.exit_code})"

    def _dispatch(self, tasks, pending, busy, results) -> None:
        idle = [s for s in range(len(self._workers)) if s not in busy]
        missing = [s for s in idle[: len(pending)] if self._workers[s] is None]
        if missing:
            self._start(missing)
        for slot in idle:
            if not pending:
                break
            i = pending.popleft()
            data_source, solution_str, ground_truth, extra_info = tasks[i]
            try:
                self._workers[slot].send(dict(
                    data_source=data_source, solution_str=solution_str,
                    ground_truth=ground_truth, extra_info=extra_info))
            except (TypeError, ValueError) as e:  # nothing was written: the worker is fine
                results[i] = ("error", f"could not send task: {type(e).__name__}: {e}", None)
                continue
            except WorkerBroken as e:
                results[i] = ("error", self._died(slot, e), None)
                continue
            busy[slot] = (i, time.monotonic())

    def _collect(self, busy, results, timeout_s: float) -> None:
        deadline = min(start for _, start in busy.values()) + timeout_s
        with selectors.DefaultSelector() as selector:
            for slot in busy:
                selector.register(self._workers[slot].fileno(), selectors.EVENT_READ, slot)
            ready = selector.select(max(0.0, deadline - time.monotonic()))
        for key, _ in ready:
            slot = key.data
            try:
                reply = self._workers[slot].read_available()
            except WorkerBroken as e:
                results[busy.pop(slot)[0]] = ("error", self._died(slot, e), None)
                continue
            if reply is None:
                continue  # part of a line: the rest comes later
            i, _ = busy.pop(slot)
            outcome = _outcome(reply)
            if outcome is None:
                self._kill(slot)
                outcome = ("error", "reward worker sent a malformed reply", None)
            results[i] = outcome
            self.consecutive_timeouts = 0
            self.consecutive_deaths = 0
            self._death_codes.clear()

    def run(self, tasks: list[tuple], timeout_s: float) -> list[tuple]:
        """Scores each (data_source, solution_str, ground_truth, extra_info) task.

        Returns per task ("ok", score, extras), ("error", message, None) or
        ("timeout", message, None).
        """
        results: list[tuple | None] = [None] * len(tasks)
        pending = collections.deque(range(len(tasks)))
        busy: dict[int, tuple[int, float]] = {}  # slot -> (task index, start time)
        while pending or busy:
            self._dispatch(tasks, pending, busy, results)
            if busy:
                self._collect(busy, results, timeout_s)
            now = time.monotonic()
            for slot, (i, start) in list(busy.items()):
                if now - start >= timeout_s:
                    busy.pop(slot)
                    results[i] = ("timeout", f"scoring took over {timeout_s}s", None)
                    self._kill(slot)
                    self.consecutive_timeouts += 1
            if self._max_timeouts and self.consecutive_timeouts >= self._max_timeouts:
                self._kill_all(busy)
                raise ConsecutiveTimeouts(self.consecutive_timeouts)
            if self._max_deaths and self.consecutive_deaths >= self._max_deaths:
                self._kill_all(busy)
                raise ConsecutiveDeaths(self.consecutive_deaths, list(self._death_codes))
        return results

    def _kill_all(self, busy) -> None:
        for slot in list(busy):
            self._kill(slot)

    def close(self) -> None:
        for slot in range(len(self._workers)):
            self._kill(slot)
