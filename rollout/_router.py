"""`ReplicaRouter`: one load balancer over N rollout replicas, used wherever a `RolloutServer` is.

A replica is one engine behind one `RolloutServer` (`LocalReplica`, in this process;
`ProcessReplica`, in a child process) or anything else that implements the `Replica` protocol (a
Ray actor or RPC handle on another host: later work). The router has the server's public API
(`submit`, `generate`, `agenerate`, `abort`, `release_session`, `submit_update` /
`update_params`, `suspend` / `submit_suspend` / `resume` / `sleep` / `wake`, `suspended`,
`asleep`, `policy_version`, `stats`, `close`, context manager), so agent loops, the Rollouter and
HostWorker run unchanged over several replicas.

Routing (all decisions under one lock, in submit order):
- a request whose `session_id` the router has seen goes to that session's replica (it holds the
  session's parked KV), waiting if that replica is at its bound (or, once the replica evicted
  that KV, while it cannot take a new request: below);
- any other request (a new session, or none) goes to a live replica below its bound that can take
  it without evicting a reserved parked session (below), preferring one with a free slot, then
  the fewest requests in flight (ties: the lowest index), so a replica held up by long requests
  gets fewer new ones;
- a request no replica can take now waits in the router's queue; whenever a request ends (or a
  session is released) the queue is walked, turns of parked sessions first, then other turns of
  known sessions, then new requests, each in submit order, and every
  request that can go somewhere is sent (one waiting for a busy session replica does not hold up
  the others). `submit` returns the Future at once. `max_inflight_per_replica` (default: each
  replica's `capacity`, its decode slots) bounds the requests in flight on a replica: a
  dispatched request gets a slot at once, so the only queue is the router's, where a request can
  still go to whichever replica frees first.

Eviction-aware placement (the prefix cache behind the router): a replica's slots are running,
*parked* (a session's turn ended; the slot keeps its KV for the next turn until the session is
released) or free, and a new request that finds no free slot evicts the least recently parked
session there, whose next turn is then prefilled in full. Counting only requests in flight, the
router would send a new session the moment a turn ends, before the agent loop sends that
session's next turn, and the new session would take the slot just parked: with more sessions
than slots no KV would ever be reused. So the router tracks the sessions parked on each replica
(their turn ended, no turn in flight, not released; least recently parked first, dropping the
oldest as the replica would when a placement overflows its slots) and keeps `parked_reserve`
slots per replica (default: half its `capacity`) for them: a new request goes to replica i only
while in_flight + min(parked, reserve) < capacity, so the `reserve` most recently parked
sessions keep their KV until their next turn (which needs only the bound) or their release.
The reserve is below the capacity, so a replica with nothing in flight always takes a new
request: a caller that waits for every first turn before sending second turns still progresses
(then up to `reserve` slots sit parked while it waits: the price of the reuse). With a reserve,
requests that need a new slot are not sent past the replica's capacity even when
`max_inflight_per_replica` is larger (in the replica's own queue they would evict the next
session to park); parked_reserve=0 turns the reserve off and the bound alone applies.

Sampling is keyed by (seed, row) and the step, so a request gives the same tokens on any replica
with the same weights: where a request runs never changes what it samples.

Fan-out (weight syncs, suspend / resume / sleep / wake to every replica): rollout/_router_fanout.py.
Replica death: a replica fails when its scheduler thread dies (a `RolloutServer` then fails every
future with the error and refuses submits), when its process dies (`ProcessReplica`: EOF on its
pipe fails every pending future), when a request future or a submit of it raises, or when the
caller says so (`mark_dead`). The router logs a warning, counts it, drops the replica and re-queues
every request it had in flight, ahead of the newer ones; they run again from the start on the live
replicas with the same seed, row and step_offset, so they give the tokens the dead replica would
have given (under the same weights). A session whose replica died is prefilled in full on its new
replica. Tokens the dead replica had already generated are not kept: a request is retried from
scratch, not resumed from a partial result, since their log-probs and policy versions died with the
replica and the retry samples the same tokens anyway (a request that had crossed a weight sync
regenerates them with the current weights); a streaming caller is not given them twice (below). An
agent loop's completed turns are kept: they are the prompt of its next request. An aborted request
whose replica dies resolves as "abort" with no tokens (one that had streamed tokens: below). With
no live replica left (and none restarting) every waiting future fails with one error naming each
replica's failure, and later calls raise it. Request errors (validation: empty prompt, too long,
bad sampling, a duplicate live request id, ...) raise in the caller at `submit`, as on the server,
and are never retried.

Streaming (`submit(on_tokens=...)`, as `RolloutServer.submit`'s): the request's new tokens after
each decode loop of the replica it runs on (those of the loop it ends in come only in the
output), on that replica's scheduler thread (a `ProcessReplica`'s dispatcher thread: its child
sends them over the pipe). The router hands a callback only to replicas whose class sets
`streams = True` (`LocalReplica`, `ProcessReplica`); on any other `Replica` the request's tokens
all come with its output. The caller sees each token once, in order, also across a retry: the
router keeps the tokens it has given; the retry samples them again, the router checks them
against those and passes on only the later ones, so the output (the retry's) starts with every
token given. A retry that samples other tokens (a weight sync between the two runs, or numerics
that differ between replicas) cannot continue the stream: it is aborted once its tokens show it,
and the request fails with an error that says so rather than return tokens that contradict what
was streamed. An abort that ends a retry
before it sampled the given tokens again (or finds it waiting in the router's queue) lands once
it has: the router runs it (again) with max_new_tokens = the tokens given, so the abort's output
(finish_reason "abort") still holds all of them. A weight sync re-submits nothing: held requests
stay on their replica, which streams on from where it was. (Requests still queued when the
router closes end as "abort" with no tokens, streamed or not.)

Restart (`restart=`, off by default): a dead replica is rebuilt and put back under its index;
see rollout/_router_restart.py.

Left to others: starting replicas (HostWorker, from the config: in-process replicas without
`restart`, or `ProcessReplica`s with it), and replicas on other hosts (an RPC or Ray-actor
`Replica`).
"""
from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import functools
import itertools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ._engine import Engine
from ._replica import LocalReplica, Replica
from ._router_fanout import FanOutMixin
from ._router_restart import RestartMixin
from ._sampling import SamplingParams
from ._server import GenerateOutput, RolloutServer, _set_future

log = logging.getLogger(__name__)


@dataclasses.dataclass(eq=False)
class _Routed:
    """A request as the router sees it (under the router's lock)."""

    seq: int  # submit order: retried requests go back in the queue in this order
    request_id: str
    prompt: list[int]
    kwargs: dict  # sampling, max_new_tokens, session_id, seed, row, step_offset
    future: concurrent.futures.Future  # the caller's
    replica: int = -1  # -1: in the router's queue
    attempt: int = 0  # bumped at each dispatch and re-queue: a stale replica result is ignored
    aborted: bool = False
    waited: bool = False  # had to wait in the router's queue (counted once)
    on_tokens: Any = None  # submit's on_tokens (streaming), or None (none, or dropped: it raised)
    sent: list = dataclasses.field(default_factory=list)  # the tokens on_tokens has been given
    diverged: bool = False  # a retry's tokens differ from `sent` (see "Streaming")
    rerun: bool = False  # aborted with `sent` ahead of its output: runs again up to len(sent) tokens
    stream_lock: threading.RLock = dataclasses.field(default_factory=threading.RLock)

    @property
    def session(self) -> str | None:
        return self.kwargs["session_id"]


def _short_abort(out: GenerateOutput, sent: list[int]) -> bool:
    """Whether `out` is an abort that ended before the tokens already streamed (a retry aborted
    before it regenerated them): it cannot end the stream, so the request runs again up to them."""
    return out.finish_reason == "abort" and len(out.token_ids) < len(sent) and \
        list(out.token_ids) == sent[:len(out.token_ids)]


def _rate(num: float, den: float, empty: float) -> float:
    return float(num) / float(den) if den else empty


class ReplicaRouter(FanOutMixin, RestartMixin):
    """Serves requests over `replicas` (see the module docstring): same API as `RolloutServer`.

    replicas: `Replica`s or `RolloutServer`s (wrapped in `LocalReplica`), all at the same
    policy_version; the router owns them (`close` closes them). max_inflight_per_replica: the
    most requests in flight on one replica (None: each replica's `capacity`, its decode slots).
    restart: `index -> a new Replica or RolloutServer` for a replica that died (None: a dead
    replica is dropped), at most `max_restarts` times per index; the new one is brought to the
    router's weights with `restart_params(index)` (None: the tree that replica index got at the
    last sync, which the router then keeps a reference to; see "Restart" in the module docstring).
    restart_backoff_s: the wait before retrying a failed restart, doubled with each failure in a
    row (at most 60 s; 0: retry at once).
    parked_reserve: slots per replica kept for parked sessions' next turns (None: half each
    replica's `capacity`; 0: none; must be below every replica's capacity; see "Eviction-aware
    placement" in the module docstring).
    """

    def __init__(self, replicas: Sequence[Replica | RolloutServer], *,
                 max_inflight_per_replica: int | None = None,
                 restart: Callable[[int], Replica | RolloutServer] | None = None, max_restarts: int = 1,
                 restart_params: Callable[[int], Any] | None = None, parked_reserve: int | None = None,
                 restart_backoff_s: float = 1.0):
        if not replicas:
            raise ValueError("ReplicaRouter needs at least one replica")
        self.replicas: list[Replica] = [LocalReplica(r) if isinstance(r, RolloutServer) else r
                                        for r in replicas]
        for i, r in enumerate(self.replicas):
            if not isinstance(r, Replica):
                raise TypeError(f"replica {i} ({type(r).__name__}) is neither a RolloutServer nor "
                                f"a rollout.Replica")
        bound = max_inflight_per_replica
        if bound is not None and (isinstance(bound, bool) or not isinstance(bound, int) or bound < 1):
            raise ValueError(f"max_inflight_per_replica must be an int >= 1 or None (each "
                             f"replica's decode slots), got {bound!r}")
        self.bounds = [int(bound) if bound is not None else r.capacity for r in self.replicas]
        self.slots = [int(r.capacity) for r in self.replicas]
        reserve = parked_reserve
        if reserve is not None and (isinstance(reserve, bool) or not isinstance(reserve, int) or reserve < 0):
            raise ValueError(f"parked_reserve must be an int >= 0 or None (half each replica's decode "
                             f"slots), got {reserve!r}")
        if reserve is not None and reserve >= min(self.slots):
            raise ValueError(f"parked_reserve={reserve} must be below every replica's decode slots "
                             f"(capacity {min(self.slots)}), or new sessions could never start: lower it")
        self.reserves = [reserve if reserve is not None else s // 2 for s in self.slots]
        if restart is not None and not callable(restart):
            raise TypeError(f"restart must be a callable index -> replica or None, got {restart!r}")
        if isinstance(max_restarts, bool) or not isinstance(max_restarts, int) or max_restarts < 0:
            raise ValueError(f"max_restarts must be an int >= 0, got {max_restarts!r}")
        if isinstance(restart_backoff_s, bool) or not isinstance(restart_backoff_s, (int, float)) \
                or not 0 <= restart_backoff_s < float("inf"):
            raise ValueError(f"restart_backoff_s must be a number of seconds >= 0, got {restart_backoff_s!r}")
        versions = [r.policy_version for r in self.replicas]
        if len(set(versions)) != 1:
            raise ValueError(f"the replicas are at different policy versions {versions}; sync "
                             f"them to one version before building the router")
        n = len(self.replicas)
        self._lock = threading.Lock()
        self._queue: collections.deque[_Routed] = collections.deque()
        self._live: dict[str, _Routed] = {}
        self._inflight: list[set[_Routed]] = [set() for _ in range(n)]
        self._sessions: dict[str, int] = {}
        # per replica: sessions parked there (turn ended, none in flight), least recently parked first
        self._parked: list[collections.OrderedDict[str, None]] = [collections.OrderedDict() for _ in range(n)]
        self._dead: dict[int, BaseException] = {}  # replica -> why it was dropped
        self._dead_stats: dict[int, dict] = {}  # a dead replica's last counters
        self._error: BaseException | None = None  # no live replica left
        self._closing = False
        self._seq = itertools.count()
        self._version = self._target_version = versions[0]
        self._sync_seq, self._applied_seq = itertools.count(1), 0
        self._counts = collections.Counter()  # router counters, cumulative
        self._interval = collections.Counter()  # since the last metrics() call
        self._last_stats = [dict() for _ in range(n)]
        self._last_metrics_t = time.perf_counter()
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=n, thread_name_prefix="ReplicaRouter")
        # restarts (see the module docstring)
        self._restart, self._max_restarts, self._restart_params = restart, max_restarts, restart_params
        self._restarts = collections.Counter()  # per replica index
        self._restart_backoff_s = float(restart_backoff_s)
        self._failures_in_a_row = collections.Counter()  # per replica index, reset by a restart that works
        self._restarting: set[int] = set()
        self._restart_threads: list[threading.Thread] = []
        self._synced_trees: dict[int, Any] = {}  # index -> its tree of the last applied sync (restart only)
        self._syncs_running = 0
        self._sync_gen = 0  # syncs started
        self._idle = threading.Condition(self._lock)  # notified when a sync ends
        self._retired = collections.Counter()  # counters of replicas replaced by a restart

    @classmethod
    def from_engines(cls, engines: Sequence[Engine], *, max_inflight_per_replica: int | None = None,
                     **server_kwargs) -> "ReplicaRouter":
        """A router over one new `RolloutServer(engine, **server_kwargs)` per engine."""
        return cls([RolloutServer(e, **server_kwargs) for e in engines],
                   max_inflight_per_replica=max_inflight_per_replica)

    # ------------------------------------------------------------------ requests
    def submit(self, request_id: str, prompt_ids, *, sampling: SamplingParams, max_new_tokens: int,
               session_id: str | None = None, seed: int = 0, row: int = 0,
               step_offset: int = 0, on_tokens=None) -> concurrent.futures.Future:
        """As `RolloutServer.submit`: queues a request, returns a Future[GenerateOutput]; errors in
        the request raise here. Cancelling the future aborts the request.

        on_tokens (streaming), as the server's: `on_tokens(token_ids)` is called on a replica's
        scheduler thread (a `ProcessReplica`'s dispatcher thread) with the tokens generated since
        its last call, each token once and in order, also across a retry on another replica (see
        "Streaming" in the module docstring); the tokens of the loop the request ends in come only
        in the output, which starts with every token given. Quick and non-blocking; dropped if it
        raises. Not called while the request runs on a replica without `streams = True`."""
        if on_tokens is not None and not callable(on_tokens):
            raise TypeError(f"on_tokens must be a callable or None, got {on_tokens!r}")
        kwargs = dict(sampling=sampling, max_new_tokens=max_new_tokens, session_id=session_id,
                      seed=seed, row=row, step_offset=step_offset)
        prompt = self._validator().validate(request_id, prompt_ids, **kwargs)
        req = _Routed(next(self._seq), request_id, prompt, kwargs, concurrent.futures.Future(),
                      on_tokens=on_tokens)
        with self._lock:
            self._check_running()
            if request_id in self._live:
                raise ValueError(f"request_id {request_id!r} is already pending or running; "
                                 f"request ids must be unique among live requests")
            self._live[request_id] = req
            self._queue.append(req)
            self._counts["routed_requests"] += 1
        req.future.add_done_callback(lambda f: self._abort(req) if f.cancelled() else None)
        self._pump()
        return req.future

    def generate(self, request_id: str, prompt_ids, **kwargs) -> GenerateOutput:
        """`submit(...)` and wait for the result (not from a replica's scheduler thread)."""
        return self.submit(request_id, prompt_ids, **kwargs).result()

    async def agenerate(self, request_id: str, prompt_ids, **kwargs) -> GenerateOutput:
        """`submit(...)` awaited from asyncio (cancelling the awaiting task aborts the request)."""
        return await asyncio.wrap_future(self.submit(request_id, prompt_ids, **kwargs))

    def abort(self, request_id: str) -> bool:
        """Ends a queued or dispatched request: its future resolves with finish_reason "abort"
        (a dispatched one with its tokens so far). False when no such request is live."""
        with self._lock:
            req = self._live.get(request_id)
        return req is not None and self._abort(req)

    def release_session(self, session_id: str) -> None:
        """Forgets the session: its replica drops the parked KV; a later turn is a new session."""
        with self._lock:
            i = self._sessions.pop(session_id, None)
            if i is not None:
                self._parked[i].pop(session_id, None)
        if i is not None and i not in self._dead:
            self._call(i, lambda r: r.release_session(session_id))
            self._pump()  # a new request may have waited for that parked slot

    def _abort(self, req: _Routed) -> bool:
        with self._lock:
            if self._live.get(req.request_id) is not req:
                return False
            if req.rerun:  # already running again up to its streamed tokens, then ending
                return True
            req.aborted = True
            i = req.replica
            if i < 0 and req.sent:  # queued for a retry after streaming: run up to what was sent
                req.rerun = True
                return True
            if i < 0:  # still queued here
                self._queue.remove(req)
                del self._live[req.request_id]
        if i < 0:
            _set_future(req.future, self._abort_output(req))
        else:  # the replica's "abort" result comes back through _on_done
            self._call(i, lambda r: r.abort(req.request_id))
        return True

    def _abort_output(self, req: _Routed) -> GenerateOutput:
        return GenerateOutput(request_id=req.request_id, token_ids=[], log_probs=[],
                              finish_reason="abort", num_prompt_tokens=len(req.prompt),
                              num_cached_tokens=0, num_computed_prompt_tokens=0,
                              policy_version=self._version, policy_versions=[])

    # ------------------------------------------------------------------ routing
    def _home(self, req: _Routed) -> int | None:
        """The live replica holding `req`'s session, or None (a new request). Under the lock."""
        home = self._sessions.get(req.session)
        return home if home is not None and home not in self._dead else None

    def _takes_new(self, i: int) -> bool:
        """Whether replica i can take a request that needs a slot of its own without going past
        its bound or evicting a session within its parked reserve (with a reserve, not past its
        slots either: a request waiting in the replica's own queue would evict the next session
        that parks). Under the lock."""
        n, reserve = len(self._inflight[i]), self.reserves[i]
        return n < self.bounds[i] and (not reserve or n + min(len(self._parked[i]), reserve) < self.slots[i])

    def _target(self, req: _Routed) -> int | None:
        """The replica `req` goes to now, or None (it waits). Under the lock."""
        home = self._home(req)
        if home is not None and req.session in self._parked[home]:  # its parked slot: only the bound
            return home if len(self._inflight[home]) < self.bounds[home] else None
        if home is not None:  # its KV was evicted: it needs a slot, on its replica still
            return home if self._takes_new(home) else None
        ok = [i for i in range(len(self.replicas)) if i not in self._dead and self._takes_new(i)]
        # a free slot first (no parked session evicted), then the fewest in flight, the lowest index
        return min(ok, key=lambda i: (len(self._inflight[i]) + len(self._parked[i]) >= self.slots[i],
                                      len(self._inflight[i]), i)) if ok else None

    def _rank(self, req: _Routed) -> int:
        """Queue walk order (under the lock): 0, a session turn whose parked KV waits for it; 1,
        another turn of a known session; 2, a new request."""
        home = self._home(req)
        return 2 if home is None else 0 if req.session in self._parked[home] else 1

    def _assign(self) -> list[tuple[_Routed, int, int]]:
        """Takes every queued request that a replica can take now: turns of parked sessions first,
        then other turns of known sessions, then new requests, each in queue order. Under the lock."""
        if self._closing or self._error is not None:
            return []
        sent, kept = [], []
        for req in sorted(self._queue, key=lambda r: (self._rank(r), r.seq)):
            i = self._target(req)
            if i is None:
                self._counts["waited_requests"] += not req.waited
                req.waited = True
                kept.append(req)
                continue
            self._place(req, i)
            sent.append((req, i, req.attempt))
        self._queue = collections.deque(sorted(kept, key=lambda r: r.seq))
        return sent

    def _place(self, req: _Routed, i: int) -> None:
        """Books `req` on replica `i` (under the lock): in-flight, session map, counters."""
        req.replica, req.attempt = i, req.attempt + 1
        self._inflight[i].add(req)
        self._interval[f"requests/{i}"] += 1
        session = req.session
        if session is not None:
            if session in self._sessions:  # a later turn (or a retry) of a known session
                self._counts["session_requests"] += 1
                self._interval["session_requests"] += 1
                sticky = self._sessions[session] == i
                self._counts["sticky_requests"] += sticky
                self._interval["sticky_requests"] += sticky
                self._parked[self._sessions[session]].pop(session, None)  # running again (or moved)
            self._sessions[session] = i
        if self._parked[i] and len(self._inflight[i]) + len(self._parked[i]) > self.slots[i]:
            self._parked[i].popitem(last=False)  # the replica evicts its least recently parked

    def _pump(self) -> None:
        """Sends what the replicas can take now (outside the lock: a submit may be an RPC)."""
        with self._lock:
            sent = self._assign()
        for req, i, attempt in sent:
            self._dispatch(req, i, attempt)

    def _dispatch(self, req: _Routed, i: int, attempt: int) -> None:
        replica = self.replicas[i]
        kwargs = dict(req.kwargs)
        if req.rerun:  # read after this attempt began: an older attempt can no longer add to it
            with req.stream_lock:
                kwargs["max_new_tokens"] = len(req.sent)
        if req.on_tokens is not None and getattr(replica, "streams", False):
            kwargs["on_tokens"] = functools.partial(self._on_tokens, req, attempt, [0])
        try:
            inner = replica.submit(req.request_id, req.prompt, **kwargs)
        except (ValueError, TypeError) as error:  # the request, not the replica (no retry)
            with self._lock:
                stale = req.attempt != attempt
                if not stale:
                    self._inflight[i].discard(req)
                    self._live.pop(req.request_id, None)
            if not stale:
                _set_future(req.future, error=error)
                self._pump()
            return
        except Exception as error:  # noqa: BLE001 - the replica failed: retried elsewhere
            if self._closing:  # close() is closing the replicas
                self._resolve_closed([req], attempt)
            else:
                self._fail_replica(i, error, replica=replica)
            return
        with self._lock:
            current = req.attempt == attempt and i not in self._dead
            aborted = req.aborted
        if not current:  # its replica was dropped meanwhile: the request was re-queued
            self._call(i, lambda r: r.abort(req.request_id))
            return
        inner.add_done_callback(functools.partial(self._on_done, req, i, attempt, replica))
        if aborted and not req.rerun:
            self._call(i, lambda r: r.abort(req.request_id))

    def _on_tokens(self, req: _Routed, attempt: int, count: list[int], ids: list[int]) -> None:
        """A replica's on_tokens for one attempt of `req` (on its scheduler thread): `ids` are that
        attempt's tokens count[0]: on; those the caller was already given (a retry regenerating
        them) are checked against them, the rest passed on."""
        start, count[0] = count[0], count[0] + len(ids)
        with req.stream_lock:
            if req.attempt != attempt or req.diverged or req.on_tokens is None:
                return  # a re-queued request's old attempt, or nothing more to give
            seen = req.sent[start:start + len(ids)]
            if list(ids[:len(seen)]) != seen:
                req.diverged = True  # the output cannot start with what was sent: fails at the end,
                self._call(req.replica, lambda r: r.abort(req.request_id))  # which comes sooner
                return
            new = list(ids[len(seen):])
            if not new:
                return
            req.sent.extend(new)
            try:
                req.on_tokens(new)
            except Exception:  # noqa: BLE001 - the caller's bug: no more calls, as on the server
                req.on_tokens = None

    def _on_done(self, req: _Routed, i: int, attempt: int, replica: Replica,
                 inner: concurrent.futures.Future) -> None:
        """A replica's result (on its scheduler thread): resolve, or fail over the replica."""
        error = inner.exception() if not inner.cancelled() else None
        out = inner.result() if error is None and not inner.cancelled() else None
        with req.stream_lock:
            sent = list(req.sent)
        with self._lock:
            if req.attempt != attempt or req.replica != i:
                return  # a re-queued request's old attempt
            rerun = out is not None and _short_abort(out, sent) and not req.diverged and not self._closing
            if rerun:  # aborted before regenerating what was streamed: run again up to it
                self._inflight[i].discard(req)
                req.replica, req.attempt, req.rerun = -1, req.attempt + 1, True
                self._queue = collections.deque(sorted([req, *self._queue], key=lambda r: r.seq))
            elif error is None:
                self._inflight[i].discard(req)
                self._live.pop(req.request_id, None)
                if req.session is not None and self._sessions.get(req.session) == i and i not in self._dead:
                    self._parked[i][req.session] = None  # its slot keeps the KV for the next turn
                    self._parked[i].move_to_end(req.session)
        if error is not None:
            self._fail_replica(i, error, replica=replica)
            return
        if inner.cancelled():
            req.future.cancel()
        elif not rerun:
            self._resolve(req, out, sent)
        self._pump()

    def _resolve(self, req: _Routed, out: GenerateOutput, sent: list[int]) -> None:
        """Resolves `req` with its replica's output, which must start with the `sent` tokens its
        on_tokens was given (see "Streaming" in the module docstring)."""
        if (req.diverged or list(out.token_ids[:len(sent)]) != sent) and not self._closing:
            _set_future(req.future, error=RuntimeError(
                f"request {req.request_id!r}: its output does not start with the {len(sent)} tokens "
                f"given to on_tokens (its replica failed and the retry on another one sampled other "
                f"tokens: a weight sync in between, or numerics that differ); submit it again"))
            return
        if req.rerun:  # the run again after an abort ends as the abort did
            out = dataclasses.replace(out, finish_reason="abort")
        _set_future(req.future, out)

    def _call(self, i: int, fn: Callable[[Replica], Any]) -> Any:
        """A best-effort call on replica i (abort, release): a failure there is logged, not raised."""
        return self._call_on(self.replicas[i], fn)

    def _validator(self) -> Replica:
        with self._lock:
            self._check_running()  # every replica dead but one restarting: a dead one validates
            return next((r for i, r in enumerate(self.replicas) if i not in self._dead), self.replicas[0])

    def _check_running(self) -> None:
        if self._error is not None:
            raise RuntimeError(str(self._error)) from self._error
        if self._closing:
            raise RuntimeError("the ReplicaRouter is closed")

    # ------------------------------------------------------------------ replica death
    def mark_dead(self, index: int, reason: str = "marked dead by the caller") -> None:
        """Drops replica `index` (e.g. its host stopped answering): its requests are retried on
        the live replicas and aborted on it (best effort). No-op when it is already dead."""
        if not 0 <= index < len(self.replicas):
            raise IndexError(f"replica index {index} out of range [0, {len(self.replicas)})")
        self._fail_replica(index, RuntimeError(f"rollout replica {index}: {reason}"), abort_there=True)

    def _fail_replica(self, i: int, error: BaseException, abort_there: bool = False,
                      replica: Replica | None = None) -> None:
        """Drops replica i (`replica`: only if it is still that one, not its restarted successor),
        re-queues its in-flight requests and restarts it when the router restarts replicas (see
        the module doc)."""
        last = self._call(i, lambda r: r.stats)
        with self._lock:
            if i in self._dead or (replica is not None and self.replicas[i] is not replica):
                return
            self._dead[i] = error
            self._dead_stats[i] = last if last is not None else self._last_stats[i]
            self._parked[i].clear()
            moved = sorted(self._inflight[i], key=lambda r: r.seq)
            self._inflight[i] = set()
            for req in moved:
                req.replica, req.attempt = -1, req.attempt + 1
                req.rerun = req.rerun or (req.aborted and bool(req.sent))  # up to what was streamed
            aborted = [r for r in moved if r.aborted and not r.rerun]
            retried = [r for r in moved if not r.aborted or r.rerun]
            for req in aborted:
                self._live.pop(req.request_id, None)
            self._queue = collections.deque(sorted([*retried, *self._queue], key=lambda r: r.seq))
            self._counts["dead_replicas"] += 1
            self._counts["retried_requests"] += len(retried)
            restart = self._start_restart(i)
            left = self._fail_if_none_left()
        log.warning("rollout replica %d failed (%r): %d in-flight requests retried on the %d live "
                    "replicas; %s", i, error, len(retried), len(self.replicas) - len(self._dead),
                    f"restarting it (restart {self._restarts[i]} of {self._max_restarts})" if restart
                    else "dropped for good" + (" (max_restarts reached)" if self._restart else ""))
        for req in aborted:
            _set_future(req.future, self._abort_output(req))
        if abort_there:
            for req in moved:
                self._call(i, lambda r, rid=req.request_id: r.abort(rid))
        if left:
            for req in left:
                _set_future(req.future, error=self._error)
            return
        if self._closing:
            self._resolve_closed(retried)
        self._pump()

    def _fail_if_none_left(self) -> list[_Routed]:
        """Under the lock: with every replica dead and none restarting, the router fails; returns
        the requests whose futures must then fail (none otherwise)."""
        if len(self._dead) < len(self.replicas) or self._restarting or self._error is not None:
            return []
        self._error = self._no_replica_error()
        left = list(self._live.values())
        self._queue.clear()
        self._live.clear()
        return left

    def _resolve_closed(self, reqs: list[_Routed], attempt: int | None = None) -> None:
        """Requests that can no longer run because the router is closing end as "abort"."""
        with self._lock:
            reqs = [r for r in reqs if (attempt is None or r.attempt == attempt)
                    and self._live.get(r.request_id) is r]
            for req in reqs:
                self._live.pop(req.request_id)
                if req.replica >= 0:
                    self._inflight[req.replica].discard(req)
                if req in self._queue:
                    self._queue.remove(req)
        for req in reqs:
            _set_future(req.future, self._abort_output(req))

    @staticmethod
    def _call_on(replica: Replica, fn: Callable[[Replica], Any]) -> Any:
        try:
            return fn(replica)
        except Exception as error:  # noqa: BLE001 - best effort on a replica that may be gone
            log.debug("rollout replica %r: %r", replica, error)
            return None

    def _no_replica_error(self) -> RuntimeError:
        why = "; ".join(f"replica {i}: {e!r}" for i, e in sorted(self._dead.items()))
        return RuntimeError(f"no live rollout replica is left (all {len(self.replicas)} failed: "
                            f"{why}); the requests cannot be served: restart the rollout replicas")

    # ------------------------------------------------------------------ state and metrics
    def _live_replicas(self) -> list[Replica]:
        with self._lock:
            return [r for i, r in enumerate(self.replicas) if i not in self._dead]

    @property
    def suspended(self) -> bool:
        """Whether any live replica is suspended (so `resume()` is due)."""
        return any(r.suspended for r in self._live_replicas())

    @property
    def asleep(self) -> bool:
        """Whether any live replica is asleep (so `wake()` is due)."""
        return any(r.asleep for r in self._live_replicas())

    @property
    def policy_version(self) -> int:
        """The version every live replica has: that of the last sync all of them applied."""
        return self._version

    @property
    def live_replicas(self) -> list[int]:
        with self._lock:
            return [i for i in range(len(self.replicas)) if i not in self._dead]

    def in_flight(self) -> list[int]:
        """Requests in flight per replica (dispatched, not yet resolved)."""
        with self._lock:
            return [len(s) for s in self._inflight]

    @property
    def stats(self) -> dict:
        """The replicas' counters summed (`RolloutServer.stats` keys; a dead replica's as last
        read; a retried request counts on each replica it ran on) plus the router's: routed_requests
        (submitted to the router), waited_requests (had to wait in its queue), session_requests /
        sticky_requests (later turns of a known session / those sent to the session's replica),
        dead_replicas (deaths), retried_requests, restarted_replicas, failed_restarts; a replica
        replaced by a restart keeps counting, its successor's counters added."""
        total = collections.Counter()
        with self._lock:
            total.update(self._retired)
        for i, r in enumerate(self.replicas):
            with self._lock:
                dead = self._dead_stats.get(i)
            total.update(dead if dead is not None else (self._call(i, lambda x: x.stats) or {}))
        with self._lock:
            total.update(self._counts)
        return dict(total)

    def metrics(self) -> dict[str, float]:
        """Gauges now and rates over the interval since the last call (call once per step):

        rollout/replica/{i}/in_flight: requests dispatched to replica i and not yet resolved;
        rollout/replica/{i}/queue: requests waiting in the router for replica i (their session is
        there); rollout/replica/{i}/parked: sessions parked there as the router counts them (turn
        ended, not released; see "Eviction-aware placement"); rollout/replica/{i}/requests:
        requests sent to it in the interval;
        rollout/replica/{i}/tokens_per_s: tokens of the requests it finished in the interval /
        the interval; rollout/replica/{i}/prefix_hit_rate: reused_tokens / (reused_tokens +
        prefill_tokens) in the interval (0 when it computed no prompt); rollout/replica/{i}/alive
        (1 or 0); rollout/replica/{i}/policy_version.
        rollout/router/queue: every request waiting in the router; rollout/router/stickiness:
        the share of later session turns sent to their session's replica in the interval (1 when
        none came); rollout/router/imbalance_requests, /imbalance_tokens: max / mean over the live
        replicas of requests sent / tokens generated in the interval (1 = even; 1 when none);
        rollout/router/live_replicas, /restarting_replicas (now); /dead_replicas (deaths),
        /retried_requests, /restarted_replicas (restarts back in the balancer): cumulative.
        """
        now = time.perf_counter()
        stats = {i: self._call(i, lambda r: r.stats) or {} for i in self.live_replicas}
        with self._lock:
            dt, self._last_metrics_t = max(now - self._last_metrics_t, 1e-9), now
            interval, self._interval = self._interval, collections.Counter()
            pinned = collections.Counter(self._sessions.get(r.session) for r in self._queue)
            out = {"rollout/router/queue": float(len(self._queue)),
                   "rollout/router/live_replicas": float(len(self.replicas) - len(self._dead)),
                   "rollout/router/dead_replicas": float(self._counts["dead_replicas"]),
                   "rollout/router/retried_requests": float(self._counts["retried_requests"]),
                   "rollout/router/restarted_replicas": float(self._counts["restarted_replicas"]),
                   "rollout/router/restarting_replicas": float(len(self._restarting)),
                   "rollout/router/stickiness": _rate(interval["sticky_requests"],
                                                      interval["session_requests"], 1.0)}
            tokens, requests = [], []
            for i, r in enumerate(self.replicas):
                p = f"rollout/replica/{i}/"
                new, old = stats.get(i, {}), self._last_stats[i]
                delta = {k: new.get(k, 0) - old.get(k, 0) for k in
                         ("generated_tokens", "reused_tokens", "prefill_tokens")}
                if i in stats:
                    self._last_stats[i] = new
                    tokens.append(delta["generated_tokens"])
                    requests.append(interval[f"requests/{i}"])
                out.update({
                    p + "alive": float(i not in self._dead),
                    p + "in_flight": float(len(self._inflight[i])),
                    p + "queue": float(pinned[i]),
                    p + "parked": float(len(self._parked[i])),
                    p + "requests": float(interval[f"requests/{i}"]),
                    p + "tokens_per_s": delta["generated_tokens"] / dt if i in stats else 0.0,
                    p + "prefix_hit_rate": _rate(delta["reused_tokens"],
                                                 delta["reused_tokens"] + delta["prefill_tokens"], 0.0),
                    p + "policy_version": -1.0,  # a dead replica's: set below for the live ones
                })
        for name, xs in (("requests", requests), ("tokens", tokens)):
            out[f"rollout/router/imbalance_{name}"] = _rate(max(xs, default=0), np.mean(xs) if xs else 0, 1.0)
        for i in stats:
            version = self._call(i, lambda r: r.policy_version)
            out[f"rollout/replica/{i}/policy_version"] = float(-1 if version is None else version)
        return out

    # ------------------------------------------------------------------ shutdown
    def close(self) -> None:
        """Aborts the queued requests, closes every replica (their requests end as "abort")."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
            queued, self._queue = list(self._queue), collections.deque()
            for req in queued:
                self._live.pop(req.request_id, None)
            self._idle.notify_all()  # a restart waiting for a sync gives up
            restarts = list(self._restart_threads)
        for req in queued:
            _set_future(req.future, self._abort_output(req))
        for thread in restarts:  # each closes the replica it built
            thread.join()
        for f in [self._pool.submit(self._call, i, lambda r: r.close()) for i in range(len(self.replicas))]:
            f.result()
        self._pool.shutdown(wait=True)

    def __enter__(self) -> "ReplicaRouter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
