"""`ProcessReplica`: a rollout replica (engine + `RolloutServer`) in its own child process, behind
the `Replica` protocol, so a replica can crash or be killed (SIGKILL, OOM, a device error that
takes the process down) without taking the run with it.

The child is started with multiprocessing's "spawn" context (a fresh interpreter: no forked JAX
runtime or threads) and builds its server by calling `factory()`, a picklable callable (a
module-level function or a `functools.partial` of one) returning a `RolloutServer`. The child
inherits the parent's environment (XLA_FLAGS, JAX_PLATFORMS, the compilation cache dir); `env`
adds variables set in the child before the factory runs (e.g. CUDA_VISIBLE_DEVICES for a replica
that owns other devices).

RPC: one duplex `multiprocessing` pipe (a socketpair on Linux: loopback only) carrying pickled
tuples. Each call has an id; a reader thread in the parent resolves the call's Future when the
reply comes. Chosen because it needs nothing beyond the standard library, the child's end closes
when the process dies for any reason (the reader sees EOF at once: death detection needs no
heartbeat or timeout), and pickling carries our dataclasses and numpy trees as they are. A Ray
actor handle would give the same shape (remote methods returning futures, death surfacing as an
error on every pending call) plus placement across hosts, at the cost of a Ray cluster per run;
the pipe is the one-host version with no dependency, and the `Replica` protocol is the seam where
a Ray-actor replica would go.

Parent side:
- `submit` sends the request and waits for the child's acknowledgement (one round trip), so a
  request the child refuses raises ValueError / TypeError in the caller, as `LocalReplica`'s
  does; the returned Future resolves when the child sends the result. Requests are validated
  here first, with the engine's limits the child reported at start-up (no round trip).
- Request and sync Futures are resolved on a dispatcher thread, never the reader thread, so a
  callback that submits again (the router's pump) can wait for its acknowledgement.
- Streaming (`submit(on_tokens=...)`): the child's server gets an `on_tokens` that sends
  ("tokens", call id, ids) down the pipe after each decode loop (one small message a loop per
  streaming request); the parent calls the caller's `on_tokens` on the dispatcher thread, in pipe
  order, so every token message of a request comes before its result (and before the failures
  of a death).
- `abort`, the properties (`policy_version`, `suspended`, `asleep`, `stats`) and the controls
  (`suspend`, `resume`, `sleep`, `wake`) are blocking calls; the child answers the cheap ones
  from its reader loop and runs the controls, in order, on one worker thread.
- `submit_update(params)`: the params (an `nnx.State`, a pure dict or a `CausalLM`, on any
  devices) are copied to host numpy in the caller's thread, pickled through the pipe and put on
  the child's devices by the child's engine. This is the path for a replica that does not share
  the trainer's devices (or its process); it costs, per sync, one device-to-host copy of the
  weights in the trainer's process, a pickle and a pipe copy (memory bandwidth, about a second per
  GB), and one host-to-device copy in the child, against zero copies for a colocated
  `LocalReplica` on the trainer's buffers. (A shared-memory segment would save the pipe copy;
  left for when the transfer shows up in a profile.)

Death: EOF on the pipe (the child exited or was killed) sets `error` to a RuntimeError naming the
pid and exit code, and every pending call and request Future fails with it at once; calls made
afterwards raise it. A failure of the child's scheduler thread reaches the parent as the failed
requests' errors and sets `error` too. `ReplicaRouter` sees either as a dead replica (its
requests retried on the others; restarted when the router has `restart`).

`close()` closes the child's server (its requests resolve as "abort"), waits for the child to
exit and kills it if it does not; it always reaps the process.

Left to others: replicas on other hosts (this pipe is local), and sharing device buffers with a
child (each child holds its own weights).
"""
from __future__ import annotations

import concurrent.futures
import itertools
import logging
import multiprocessing
import os
import pickle
import queue
import threading
import traceback
import types
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from ._engine import _pure
from ._replica import check_step_offset
from ._sampling import SamplingParams
from ._server import RolloutServer, _set_future

log = logging.getLogger(__name__)

_CLOSE_WAIT_S = 60.0  # close(): how long the child may take to exit before it is killed
START_TIMEOUT_S = 600.0  # the default start_timeout_s: a child building a large engine compiles for minutes


class _RemoteError(RuntimeError):
    """An exception from the child that could not be pickled, by its repr."""


def _picklable(error: BaseException) -> BaseException:
    try:
        pickle.dumps(error)
        return error
    except Exception:  # noqa: BLE001 - e.g. an XLA runtime error
        return _RemoteError(repr(error))


# ---------------------------------------------------------------------- the child process
def _child_main(conn, factory: Callable[[], RolloutServer], env: dict[str, str]) -> None:
    """The child: builds the server, answers calls until "close" or the parent goes away."""
    os.environ.update(env)
    try:
        server = factory()
        if not isinstance(server, RolloutServer):
            raise TypeError(f"the replica factory returned {type(server).__name__}, not a RolloutServer")
        e = server.engine
        conn.send(("ready", {"capacity": int(e.max_concurrent_decodes), "policy_version": server.policy_version,
                             "max_target_length": int(e.max_target_length),
                             "vocab_size": int(e.config.vocab_size)}))
    except BaseException:  # noqa: BLE001 - reported to the parent, then exit
        conn.send(("failed", traceback.format_exc()))
        conn.close()
        return
    _Child(conn, server).serve()


class _Child:
    def __init__(self, conn, server: RolloutServer):
        self.conn, self.server = conn, server
        self.send_lock = threading.Lock()
        self.controls = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="replica-control")

    def send(self, msg) -> None:
        with self.send_lock:
            try:
                self.conn.send(msg)
            except (OSError, EOFError):  # the parent is gone: nothing to tell
                pass

    def reply(self, call_id: int, ok: bool, value) -> None:
        if not ok:
            value = _picklable(value)
        try:
            self.send(("reply", call_id, ok, value))
        except Exception as error:  # noqa: BLE001 - an unpicklable result
            self.send(("reply", call_id, False, _RemoteError(f"unpicklable reply: {error!r}")))

    def forward(self, call_id: int, future: concurrent.futures.Future) -> None:
        """Replies with `future`'s result when it resolves (the server's failure flagged)."""
        def done(f):
            error = f.exception() if not f.cancelled() else RuntimeError("cancelled in the replica")
            if error is None:
                self.reply(call_id, True, f.result())
            else:
                self.send(("failed_server", self.server._error is not None))
                self.reply(call_id, False, error)
        future.add_done_callback(done)

    def serve(self) -> None:
        s = self.server
        try:
            while True:
                try:
                    call_id, name, args, kwargs = self.conn.recv()
                except (EOFError, OSError):
                    break  # the parent died or closed the pipe: shut down
                if name == "close":
                    break
                try:
                    if name == "submit":
                        if kwargs.pop("stream", False):  # the parent's on_tokens, over the pipe
                            kwargs["on_tokens"] = lambda ids, c=call_id: self.send(("tokens", c, ids))
                        self.forward(call_id, s.submit(*args, **kwargs))
                        self.reply(-call_id, True, None)  # the acknowledgement
                    elif name == "submit_update":
                        self.forward(call_id, s.submit_update(*args, **kwargs))
                    elif name in ("suspend", "resume", "sleep", "wake", "run"):
                        fn = (lambda f=args[0]: f(s)) if name == "run" else getattr(s, name)
                        self.forward(call_id, self.controls.submit(fn))
                    elif name in ("policy_version", "suspended", "asleep", "stats"):
                        self.reply(call_id, True, getattr(s, name))
                    elif name in ("abort", "release_session"):
                        self.reply(call_id, True, getattr(s, name)(*args))
                    else:
                        raise ValueError(f"unknown replica call {name!r}")
                except Exception as error:  # noqa: BLE001 - the caller's error
                    self.reply(-call_id if name == "submit" else call_id, False, error)
        finally:
            s.close()  # the requests left resolve as "abort" and are sent back
            self.controls.shutdown(wait=True)
            self.send(("closed",))
            self.conn.close()


# ---------------------------------------------------------------------- the parent side
class ProcessReplica:
    """A `Replica` whose `RolloutServer` runs in a child process (see the module docstring).

    factory: picklable, called in the child, returns the `RolloutServer` (it builds the engine on
    the child's devices). env: environment variables set in the child before `factory` runs.
    The constructor starts the child and waits until its server is up: it raises RuntimeError
    with the child's traceback if the factory fails, and, if the child has not reported ready
    within `start_timeout_s` seconds (None: no limit), kills and reaps it and raises RuntimeError
    naming the timeout (a factory stuck on a device, a lock, a download).
    """

    streams = True  # submit takes on_tokens: the child sends each loop's tokens over the pipe

    def __init__(self, factory: Callable[[], RolloutServer], *, env: dict[str, str] | None = None,
                 name: str = "rollout-replica", start_timeout_s: float | None = START_TIMEOUT_S):
        if start_timeout_s is not None and (isinstance(start_timeout_s, bool)
                                            or not isinstance(start_timeout_s, (int, float))
                                            or not start_timeout_s > 0):
            raise ValueError(f"start_timeout_s must be a number of seconds > 0 or None (no limit), "
                             f"got {start_timeout_s!r}")
        ctx = multiprocessing.get_context("spawn")
        self._conn, child_conn = ctx.Pipe(duplex=True)
        self.process = ctx.Process(target=_child_main, args=(child_conn, factory, dict(env or {})),
                                   name=name, daemon=True)
        self.process.start()
        child_conn.close()  # ours: the child's end must close with the child, for EOF
        self._error: BaseException | None = None
        self._closing = False
        self._lock = threading.Lock()  # pending calls, error
        self._send_lock = threading.Lock()
        self._ids = itertools.count(1)
        self._pending: dict[int, tuple[concurrent.futures.Future, bool]] = {}  # id -> (future, user's)
        self._streams: dict[int, Callable[[list[int]], Any]] = {}  # submit's call id -> its on_tokens
        self._server_failed = False
        try:
            if self._conn.poll(start_timeout_s):
                ready = self._conn.recv()
            else:  # nothing within the limit: the child is stuck
                self.process.kill()
                ready = ("failed", f"the child (pid {self.pid}) did not report ready within "
                                   f"start_timeout_s={start_timeout_s} s and was killed (exit code "
                                   f"{self._reap()}); if its engine needs longer to build, raise "
                                   "ProcessReplica's start_timeout_s")
        except (EOFError, OSError):
            ready = ("failed", f"the child exited with code {self._reap()} before reporting")
        if ready[0] != "ready":
            self._reap()
            self._conn.close()
            raise RuntimeError(f"rollout replica process failed to start:\n{ready[1]}")
        info = ready[1]
        self._capacity = info["capacity"]
        # the last values read, returned once the child is dead (as a dead LocalReplica's are)
        self._last = {"policy_version": info["policy_version"], "suspended": False, "asleep": False,
                      "stats": {}}
        self._limits = types.SimpleNamespace(engine=types.SimpleNamespace(
            max_target_length=info["max_target_length"],
            config=types.SimpleNamespace(vocab_size=info["vocab_size"])))
        self._results: queue.SimpleQueue = queue.SimpleQueue()
        self._dispatcher = threading.Thread(target=self._dispatch_loop, name=f"{name}-dispatch", daemon=True)
        self._reader = threading.Thread(target=self._read_loop, name=f"{name}-reader", daemon=True)
        self._dispatcher.start()
        self._reader.start()

    @property
    def pid(self) -> int:
        return self.process.pid

    # -------------------------------------------------------------- the RPC
    def _send(self, name: str, args=(), kwargs=None, user: bool = False, on_tokens=None):
        """Sends one call; returns the Future of its reply (failed at once when the child is dead)
        and, for "submit", the Future of the child's acknowledgement (else None). `user`: a request
        / sync Future, resolved on the dispatcher thread. `on_tokens`: a streaming submit's."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        ack = concurrent.futures.Future() if name == "submit" else None
        with self._lock:
            if self._error is not None:
                for f in (future, ack):
                    if f is not None:
                        f.set_exception(self._error)
                return future, ack
            call_id = next(self._ids)
            self._pending[call_id] = (future, user)
            if on_tokens is not None:
                self._streams[call_id] = on_tokens
            if ack is not None:
                self._pending[-call_id] = (ack, False)
        try:
            with self._send_lock:  # not under _lock: a weight sync may take a while to write
                self._conn.send((call_id, name, tuple(args), dict(kwargs or {})))
        except Exception as error:  # noqa: BLE001 - a dead pipe (the reader fails the rest) or a bad arg
            with self._lock:
                mine = [self._pending.pop(k, (None,))[0] for k in (call_id, -call_id)]
                self._streams.pop(call_id, None)
            if isinstance(error, (OSError, EOFError)):
                error = self._error or RuntimeError(f"rollout replica process {self.pid}: pipe closed ({error!r})")
            for f in mine:
                if f is not None:
                    _set_future(f, error=error)
        return future, ack

    def _call(self, name: str, *args):
        """A blocking call (not on the reader thread)."""
        return self._send(name, args)[0].result()

    def _read_loop(self) -> None:
        while True:
            try:
                msg = self._conn.recv()
            except (EOFError, OSError):
                break
            if msg[0] == "closed":
                continue
            if msg[0] == "failed_server":
                self._server_failed = self._server_failed or msg[1]
                continue
            if msg[0] == "tokens":  # a streaming request's new tokens: given in pipe order
                with self._lock:
                    on_tokens = self._streams.get(msg[1])
                if on_tokens is not None:
                    self._results.put((None, msg[1], (on_tokens, msg[2])))
                continue
            _, call_id, ok, value = msg
            with self._lock:
                future, user = self._pending.pop(call_id, (None, False))
                self._streams.pop(call_id, None)
                if call_id < 0 and not ok:  # a refused submit: no result will come
                    self._pending.pop(-call_id, None)
                    self._streams.pop(-call_id, None)
                if not ok and self._server_failed and self._error is None:
                    self._error = value  # the child's scheduler thread failed: the replica is dead
            if future is None:
                continue
            if user:
                self._results.put((future, ok, value))
            elif ok:
                future.set_result(value)
            else:
                future.set_exception(value)
        self._died()

    def _died(self) -> None:
        """EOF: the child is gone. Every pending call fails with one error naming it."""
        code = self._reap(timeout=10.0)
        with self._lock:
            if self._error is None:
                how = "closed" if self._closing else "died"
                self._error = RuntimeError(f"rollout replica process {self.pid} {how} (exit code {code})")
            pending, self._pending = self._pending, {}
            self._streams.clear()
            error = self._error
        for future, user in pending.values():
            if user:
                self._results.put((future, False, error))
            else:
                _set_future(future, error=error)
        self._results.put(None)  # the dispatcher's end

    def _dispatch_loop(self) -> None:
        while (item := self._results.get()) is not None:
            future, ok, value = item
            if future is None:  # tokens for call `ok`: value = (on_tokens, ids)
                self._give(ok, *value)
                continue
            _set_future(future, value) if ok else _set_future(future, error=value)

    def _give(self, call_id: int, on_tokens, ids: list[int]) -> None:
        """Calls a request's on_tokens; one that raises is dropped (as on the server)."""
        try:
            on_tokens(ids)
        except Exception:  # noqa: BLE001 - the caller's bug must not stop the dispatcher
            with self._lock:
                if self._streams.get(call_id) is on_tokens:
                    del self._streams[call_id]

    def _reap(self, timeout: float | None = None) -> int | None:
        self.process.join(timeout)
        return self.process.exitcode

    # -------------------------------------------------------------- the Replica protocol
    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def error(self) -> BaseException | None:
        return self._error

    def _read(self, name: str):
        """A property of the child's server; its last value once the child is dead."""
        try:
            self._last[name] = value = self._call(name)
            return value
        except Exception:
            if self._error is None:
                raise
            return self._last[name]

    @property
    def policy_version(self) -> int:
        return self._read("policy_version")

    @property
    def suspended(self) -> bool:
        return self._read("suspended") if self._error is None else False

    @property
    def asleep(self) -> bool:
        return self._read("asleep") if self._error is None else False

    @property
    def stats(self) -> dict:
        return self._read("stats")

    def validate(self, request_id, prompt_ids, *, sampling: SamplingParams, max_new_tokens, session_id,
                 seed, row, step_offset) -> list[int]:
        prompt = RolloutServer._validate(self._limits, request_id, prompt_ids, sampling, max_new_tokens,
                                         session_id, seed, row)
        check_step_offset(step_offset)
        return prompt

    def submit(self, request_id: str, prompt_ids, on_tokens=None, **kwargs) -> concurrent.futures.Future:
        """Sends the request; raises what the child's `submit` raised (a bad request: ValueError
        / TypeError; a dead replica: RuntimeError). Cancelling the Future aborts the request.
        on_tokens: as `RolloutServer.submit`'s, called on this replica's dispatcher thread."""
        prompt = self.validate(request_id, prompt_ids, **kwargs)
        kwargs = {**kwargs, "seed": int(kwargs["seed"]), "row": int(kwargs["row"]),
                  "step_offset": int(kwargs["step_offset"]), "max_new_tokens": int(kwargs["max_new_tokens"])}
        if on_tokens is not None:
            kwargs["stream"] = True
        future, ack = self._send("submit", (request_id, prompt), kwargs, user=True, on_tokens=on_tokens)
        ack.result()  # raises the child's refusal, or the replica's death
        future.add_done_callback(lambda f: self.abort(request_id) if f.cancelled() else None)
        return future

    def abort(self, request_id: str) -> bool:
        return self._call("abort", request_id)

    def release_session(self, session_id: str) -> None:
        self._send("release_session", (session_id,))  # nothing to wait for

    def submit_update(self, params, *, version: int | None, in_flight: str) -> concurrent.futures.Future:
        """Copies `params` to host numpy here (see the module docstring: the cost), sends them;
        the Future resolves with the child's sync stats."""
        host = jax.tree.map(np.asarray, jax.device_get(_pure(params)))
        return self._send("submit_update", (host,), {"version": version, "in_flight": in_flight},
                          user=True)[0]

    def suspend(self) -> None:
        self._call("suspend")

    def resume(self) -> None:
        self._call("resume")

    def sleep(self) -> dict:
        return self._call("sleep")

    def wake(self) -> dict:
        return self._call("wake")

    def run_in_child(self, fn: Callable[[RolloutServer], Any]) -> Any:
        """Calls the picklable `fn(server)` in the child, on its control thread (in order with
        `suspend` / `resume` / `sleep` / `wake`), and returns its picklable result."""
        return self._call("run", fn)

    def close(self) -> None:
        """Closes the child's server (its requests resolve as "abort"), waits for the child to
        exit (killed after a minute) and reaps it. Idempotent; fine on a dead child."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
            dead = self._error is not None
        if not dead:
            try:
                with self._send_lock:
                    self._conn.send((0, "close", (), {}))
            except (OSError, EOFError):
                pass
        self._reader.join(_CLOSE_WAIT_S)  # it reaps the child once the pipe closes
        if self._reader.is_alive():
            log.warning("rollout replica process %d did not exit after close; killing it", self.pid)
            self.process.kill()
            self._reader.join()
        self.process.join()
        if threading.current_thread() is not self._dispatcher:  # close() from a Future's callback
            self._dispatcher.join()
        self._conn.close()
