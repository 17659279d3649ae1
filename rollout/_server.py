"""`RolloutServer`: request-level, in-process generation over an `Engine` (one scheduler thread).

Many producers (plain threads, asyncio coroutines, the batch path, agent loops) submit token-level
requests; each gets a `concurrent.futures.Future[GenerateOutput]`. JetStream's orchestrator
(prefill, generate and detokenize stages on their own threads) is the model; since our decode is
an on-device multi-step loop, one scheduler thread runs all stages in turn:

1. commands: aborts, session releases and weight syncs, applied between decode loops;
2. admission: pending requests (FIFO) take free slots. A request whose session has a *parked*
   slot and whose prompt extends the tokens known for it is appended to that slot
   (`Engine.append_rows`: only the tokens not in the KV cache are computed); the others are
   prefilled in batches (grouped by length bucket, batch padded to a power of two, at most
   `max_prefill_batch` prompts a call) and inserted (`Engine.insert_rows`, with per-request
   sampling parameters, token budgets and PRNG keys, so one batch mixes them freely). Tokens
   past the engine's `max_prefill_length` (a long conversation) are appended in chunks of at
   most that many (chunked prefill), so a prompt may fill the KV cache up to
   `max_target_length - max_new_tokens`;
3. decode: `Engine.decode_loop` runs up to `steps_per_sync` steps on device (continuous batching;
   it exits early once enough slots are free for the waiting requests);
4. results: one small transfer of every slot's active flag and token count; finished slots'
   tokens and log-probs are gathered and their futures resolved (detokenizing is the caller's).
   Requests submitted with `on_tokens` (streaming) are given their new tokens after each loop.

Slots are free, running, or parked: when a request with a `session_id` ends, its slot keeps the
KV cache of prompt + completion (all but the last token, which is pending) and the server
remembers those tokens. Parked slots are evicted least recently parked first when a new request
needs a slot, or by `release_session`. A prompt that does not start with the known tokens is
prefilled in full. A weight sync under partial_rollout_kv="recompute" drops parked KV (the next
turn prefills in full); under "keep" it survives, like held requests' KV.

Randomness: a request with (seed, row) samples its step t with
`fold_in(fold_in(key(seed), row), t)`, exactly as `RolloutDriver` samples its row `row`, so the
server reproduces the driver's rows whatever the batch, slot or arrival order.

A `batch_invariant` engine (docs/rollout.md): every prompt is prefilled in full (no parked-KV
reuse), calls take a multiple of `BATCH_INVARIANT_ROWS` rows, and a sync's re-prefill pads each
prefix to its own bucket, so a request's numbers depend on none of the requests beside it.

Weight sync (`update_params`): in_flight="hold" applies the new weights at the next sync point;
running requests stay in their slots with their tokens and log-probs and continue with the new
weights (`policy_versions` records the version of every token). Their KV cache: partial_rollout_kv
"recompute" (default, verl V1) re-prefills each one's kept prefix (prompt + tokens so far, the
last one pending) with the new weights before it decodes again, re-armed with the same key and
step count, so it continues exactly as a fresh prefill of that prefix would. That re-prefill
computes each prefix whole, whatever max_prefill_length is (a bucket up to the KV cache length,
in half-octave steps), longest first, `recompute_tokens` padded tokens a call (`refill_plan`).
"keep" decodes on the KV the old weights computed (a token is sampled by the new weights but
conditioned on old-weight keys and values). in_flight="finish" stops admitting, waits for the
running requests to end, then syncs. Either way `policy_version` goes up.

Colocated training: `suspend()` stops admission and decoding between decode loops (held requests
keep everything; syncs apply at once, as "hold"); `resume()` continues. `sleep()` also frees the
KV cache and the engine's own weight copy; `wake()` reallocates and re-prefills the held requests.

Failure: validation errors (empty prompt, prompt + max_new_tokens over the KV cache length, ids
outside the vocabulary, a duplicate live request id, bad sampling or budget) raise in the caller at submit time. An exception in the scheduler
thread fails every waiting future with it, and later submits raise; nothing hangs. `close()`
aborts what is left (finish_reason "abort") and stops the thread.

Left to others: tokenization and chat templates, tool calls and stop strings (only the engine's
stop token ids end a request), scoring, and trajectory bookkeeping (`jaxrl_llm/agent`).
"""
from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import functools
import threading
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ._engine import PREFILL_BUCKETS, Engine, _next_pow2
from ._sampling import SamplingParams

PARTIAL_ROLLOUT_KV = ("recompute", "keep")
# a held request's whole-prefix re-prefill pads to one of these (half-octave steps: at most a
# third of a row is padding, against a half with the power-of-two prefill buckets alone)
REFILL_BUCKETS = tuple(sorted(set(PREFILL_BUCKETS) | {3 * b // 2 for b in PREFILL_BUCKETS}))


@dataclasses.dataclass
class GenerateOutput:
    """What a request produced.

    token_ids / log_probs / policy_versions: one entry per generated token (log-probs as the
    engine defines them: log-softmax of logits / temperature before top-k/top-p; the policy
    version whose weights sampled the token). finish_reason: "stop" (an engine stop token, which
    is included), "length" (max_new_tokens or the KV cache) or "abort". num_cached_tokens: prompt
    tokens whose KV came from the session's parked slot; num_computed_prompt_tokens: the rest
    (they sum to num_prompt_tokens). policy_version: the server's version when the request ended.
    routed_experts (an engine with `record_experts`, router replay; else None): int8/int16
    [num_prompt_tokens + len(token_ids), layers, k], the experts every layer chose for each token
    the engine fed, prompt then completion; -1 where none was fed (the last generated token). A
    prompt token whose KV came from the session's parked slot has the experts recorded when that
    KV was computed; after a sync's re-prefill (partial_rollout_kv="recompute") or a wake, the
    re-prefilled tokens (prompt and completion so far) have the re-prefill's.
    """

    request_id: str
    token_ids: list[int]
    log_probs: list[float]
    finish_reason: str
    num_prompt_tokens: int
    num_cached_tokens: int
    num_computed_prompt_tokens: int
    policy_version: int
    policy_versions: list[int]
    routed_experts: np.ndarray | None = None


@dataclasses.dataclass(eq=False)
class _Request:
    request_id: str
    prompt: list[int]
    sampling: SamplingParams
    max_new: int
    session_id: str | None
    key_data: np.ndarray
    future: concurrent.futures.Future
    slot: int = -1
    num_cached: int = 0  # prompt tokens whose KV came from the session's parked slot
    cached: int = 0  # prompt tokens in the slot's KV so far (admission)
    aborted: bool = False
    versions: list = dataclasses.field(default_factory=list)  # [(first token index, version)]
    offset: int = 0  # step_offset: the key step of the first token (a resumed request's)
    fill: list = dataclasses.field(default_factory=list)  # the tokens whose KV the slot is getting
    on_tokens: Any = None  # submit's on_tokens callback (streaming), or None
    streamed: int = 0  # tokens generated (from step 0) that on_tokens has been given
    # record_experts: host [len(prompt) + max_new, L, k] by sequence position (-1: none yet), and
    # the first position the decode loop's record is taken for (earlier ones: a prefill's)
    experts: np.ndarray | None = None
    decoded_from: int = 0


@dataclasses.dataclass(eq=False)
class _Control:
    kind: str  # suspend | resume | sleep | wake
    future: concurrent.futures.Future


@dataclasses.dataclass(eq=False)
class _Sync:
    params: Any
    version: int | None
    in_flight: str
    future: concurrent.futures.Future


def refill_bucket(n: int, max_target_length: int) -> int:
    """The padding bucket of a whole-prefix re-prefill of n tokens: one of REFILL_BUCKETS, or the
    KV cache length itself past the last one under it (a kept prefix is always shorter)."""
    return next((b for b in REFILL_BUCKETS if n <= b <= max_target_length), max_target_length)


def refill_plan(lengths: list[int], max_target_length: int, tokens: int) -> list[tuple]:
    """The prefill calls that re-prefill prefixes of `lengths` whole: [(bucket, indices into
    lengths, rows)], longest first. A call's bucket is its longest prefix's; its rows are
    tokens // bucket (one at least), or the power of two covering the prefixes left when fewer:
    one row count per bucket, so few programs to compile. The rows take the longest prefixes left,
    shorter ones padded to the call's bucket (rows the call computes anyway)."""
    todo = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    plan = []
    while todo:
        bucket = refill_bucket(lengths[todo[0]], max_target_length)
        size = min(max(1, tokens // bucket), _next_pow2(len(todo)))
        plan.append((bucket, todo[:size], size))
        todo = todo[size:]
    return plan


@functools.lru_cache(maxsize=4096)
def _row_key_data(seed: int, row: int) -> np.ndarray:
    """Raw data of fold_in(key(seed), row): the driver's key for its row `row`."""
    key = jax.random.fold_in(jax.random.key(seed), row)
    return np.asarray(jax.random.key_data(key), np.uint32)


@jax.jit
def _gather_rows(tokens, log_probs, idx):
    return jnp.take(tokens, idx, axis=0, mode="clip"), jnp.take(log_probs, idx, axis=0, mode="clip")


@jax.jit
def _gather_experts(experts, idx):
    return jnp.take(experts, idx, axis=0, mode="clip")


def _set_future(future, result=None, error=None) -> None:
    """Resolves a future unless the caller already cancelled it."""
    try:
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)
    except concurrent.futures.InvalidStateError:
        pass


class RolloutServer:
    """Serves token-level generation requests with `engine` (see the module docstring).

    steps_per_sync: decode steps per host check (new requests wait at most this long for a free
    slot to be noticed). max_prefill_batch: prompts per prefill call. reuse_prefix: append a
    session's new tokens to its parked KV instead of prefilling the whole prompt (off when the
    engine is `batch_invariant`: see docs/rollout.md).
    partial_rollout_kv: what a weight sync does to the KV of held (running) requests:
    "recompute" (default, as verl) re-prefills each one's kept prefix with the new weights before
    it decodes again, and drops parked sessions' KV; "keep" leaves the KV of the old weights.
    recompute_tokens: padded tokens (rows x bucket) per prefill call of that re-prefill (and of
    `wake`), at least one row a call: it bounds the call's activation memory (the prefill's
    attention scores grow as tokens x bucket); a kept prefix longer than it (and than
    max_prefill_length) is prefilled up to it and the rest appended in max_prefill_length
    chunks, as admission does. Use as a context manager or call `close()`.
    """

    def __init__(self, engine: Engine, *, steps_per_sync: int = 8, max_prefill_batch: int = 64,
                 reuse_prefix: bool = True, partial_rollout_kv: str = "recompute",
                 recompute_tokens: int = 16384):
        if int(steps_per_sync) < 1:
            raise ValueError(f"steps_per_sync must be >= 1, got {steps_per_sync}")
        if int(max_prefill_batch) < 1:
            raise ValueError(f"max_prefill_batch must be >= 1, got {max_prefill_batch}")
        if isinstance(recompute_tokens, bool) or not isinstance(recompute_tokens, (int, np.integer)) \
                or recompute_tokens < 1:
            raise ValueError(f"recompute_tokens must be an int >= 1, got {recompute_tokens!r}")
        self.recompute_tokens = int(recompute_tokens)
        if partial_rollout_kv not in PARTIAL_ROLLOUT_KV:
            raise ValueError(f"partial_rollout_kv must be one of {PARTIAL_ROLLOUT_KV}, got "
                             f"{partial_rollout_kv!r}")
        self.partial_rollout_kv = partial_rollout_kv
        self.engine = engine
        self.steps_per_sync = int(steps_per_sync)
        self.max_prefill_batch = int(max_prefill_batch)
        # batch_invariant: a turn's KV must not depend on whether its session's parked slot
        # survived (an eviction depends on arrival timing; decode-computed KV differs in the last
        # bits from a prefill's), so every prompt is prefilled in full
        self.reuse_prefix = bool(reuse_prefix) and not engine.batch_invariant
        self._slots = engine.max_concurrent_decodes
        self._stop = set(engine.stop_token_ids)
        self._cv = threading.Condition()
        # shared with callers (under self._cv)
        self._pending: collections.deque[_Request] = collections.deque()
        self._live: dict[str, _Request] = {}
        self._aborts: list[_Request] = []
        self._releases: list[str] = []
        self._syncs: collections.deque[_Sync] = collections.deque()
        self._controls: list[_Control] = []
        self._closing = False
        self._error: BaseException | None = None
        self._version = 0
        self._stats = collections.Counter()
        # the scheduler thread's own
        self._running: dict[int, _Request] = {}
        # session -> (slot, the tokens it knows, record_experts: the experts of its cached ones)
        self._parked: collections.OrderedDict[str, tuple] = collections.OrderedDict()
        self._generated = np.zeros(self._slots, np.int64)
        self._stale: set[int] = set()  # running slots whose KV is rebuilt before they decode again
        self._suspended = self._asleep = False
        self._state = self._out = None
        self._thread = threading.Thread(target=self._main, name="RolloutServer", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ public API
    def submit(self, request_id: str, prompt_ids, *, sampling: SamplingParams, max_new_tokens: int,
               session_id: str | None = None, seed: int = 0, row: int = 0,
               step_offset: int = 0, on_tokens=None) -> concurrent.futures.Future:
        """Queues a request; returns a Future[GenerateOutput]. Errors in the request raise here.

        prompt_ids: token ids (the whole conversation so far for a session turn). seed, row: the
        request's PRNG stream (as RolloutDriver's row `row` with that seed). step_offset: the
        stream step of the first new token (a request resumed with its first k tokens appended to
        the prompt passes k, so it samples as the uninterrupted request would). session_id: park
        the slot afterwards so the session's next turn reuses its KV. Cancelling the future aborts.
        on_tokens (streaming): `on_tokens(token_ids)` is called on the scheduler thread after each
        decode loop that leaves the request running, with the tokens generated since its last call
        (one gather of the streaming slots' rows a loop); the tokens of the loop the request ends
        in come only in the future's output, which holds them all. It must be quick and must not
        block (e.g. put on a queue); if it raises it is dropped. It changes no token or log-prob.
        """
        prompt = self._validate(request_id, prompt_ids, sampling, max_new_tokens, session_id, seed, row)
        if isinstance(step_offset, bool) or not isinstance(step_offset, (int, np.integer)) or step_offset < 0:
            raise ValueError(f"step_offset must be an int >= 0, got {step_offset!r}")
        req = _Request(request_id, prompt, sampling, int(max_new_tokens), session_id,
                       _row_key_data(int(seed), int(row)), concurrent.futures.Future(),
                       offset=int(step_offset), on_tokens=on_tokens, streamed=int(step_offset))
        with self._cv:
            self._check_running()
            if request_id in self._live:
                raise ValueError(f"request_id {request_id!r} is already pending or running; "
                                 f"request ids must be unique among live requests")
            self._live[request_id] = req
            self._pending.append(req)
            self._stats["requests_submitted"] += 1
            self._cv.notify_all()
        req.future.add_done_callback(lambda f: self._abort(req) if f.cancelled() else None)
        return req.future

    def generate(self, request_id: str, prompt_ids, **kwargs) -> GenerateOutput:
        """`submit(...)` and wait for the result (from any thread but the scheduler's)."""
        return self.submit(request_id, prompt_ids, **kwargs).result()

    async def agenerate(self, request_id: str, prompt_ids, **kwargs) -> GenerateOutput:
        """`submit(...)` awaited from asyncio (cancelling the awaiting task aborts the request)."""
        return await asyncio.wrap_future(self.submit(request_id, prompt_ids, **kwargs))

    def abort(self, request_id: str) -> bool:
        """Ends a pending or running request; its future resolves with finish_reason "abort" and
        the tokens generated so far. Returns False when no such request is live."""
        with self._cv:
            req = self._live.get(request_id)
        return req is not None and self._abort(req)

    def _abort(self, req: _Request) -> bool:
        with self._cv:
            if self._live.get(req.request_id) is not req:
                return False
            if req in self._pending:
                self._pending.remove(req)
                del self._live[req.request_id]
                self._stats["requests_aborted"] += 1
            else:
                self._aborts.append(req)
                self._cv.notify_all()
                return True
        _set_future(req.future, self._output(req, [], [], "abort"))
        return True

    def release_session(self, session_id: str) -> None:
        """Forgets a session's parked KV (its slot becomes free at the next scheduler step)."""
        with self._cv:
            self._releases.append(session_id)
            self._cv.notify_all()

    def submit_update(self, params, *, version: int | None = None,
                      in_flight: str = "hold") -> concurrent.futures.Future:
        """Queues a weight sync; returns a Future of the sync's stats (see `update_params`).
        Safe to call from the scheduler thread (e.g. inside an engine hook)."""
        if in_flight not in ("hold", "finish"):
            raise ValueError(f"in_flight must be 'hold' or 'finish', got {in_flight!r}")
        if version is not None and (isinstance(version, bool) or not isinstance(version, int)):
            raise TypeError(f"version must be an int or None, got {version!r}")
        sync = _Sync(params, version, in_flight, concurrent.futures.Future())
        with self._cv:
            self._check_running()
            self._syncs.append(sync)
            self._cv.notify_all()
        return sync.future

    def update_params(self, params, *, version: int | None = None, in_flight: str = "hold") -> dict:
        """Syncs new weights into the engine between decode loops and bumps `policy_version` (to
        `version` when given, else by one). in_flight "hold": running requests keep their slots,
        KV, tokens and log-probs and continue with the new weights; "finish": admission pauses
        until the running requests end, then the sync happens. Blocks until done; returns the
        engine's sync stats plus policy_version, held_requests and wait_s."""
        if threading.current_thread() is self._thread:
            raise RuntimeError("update_params would wait for the scheduler thread it runs on; "
                               "use submit_update there")
        return self.submit_update(params, version=version, in_flight=in_flight).result()

    def suspend(self) -> None:
        """Stops admission and decoding (e.g. while a colocated actor trains on these devices);
        returns once the scheduler has stopped using the device (after its current decode loop).
        Running requests keep their slots, tokens, log-probs and KV; `submit` still queues; an
        `update_params` applies at once (as in_flight="hold", whichever was asked); aborts,
        session releases and `close` still work. Idempotent. `resume()` continues."""
        self._control("suspend")

    def submit_suspend(self) -> concurrent.futures.Future:
        """Queues a `suspend()`; returns a Future resolved once it holds. Safe to call from the
        scheduler thread (e.g. inside an engine hook)."""
        return self._control("suspend", wait=False)

    def resume(self) -> None:
        """Ends `suspend()`: held requests whose KV a sync made stale are re-prefilled (under
        partial_rollout_kv="recompute"), then admission and decoding go on. An error while asleep
        (call `wake()`)."""
        self._control("resume")

    def sleep(self) -> dict:
        """`suspend()` and release device memory for the trainer: the KV cache (every slot's;
        parked sessions are forgotten) and the engine's weights when it holds its own copy (the
        last sync copied them; shared trainer buffers are left alone). Running requests keep their
        tokens and log-probs (host side and the small token buffer). `update_params` works while
        asleep (needed before `wake` when the weights were released). Returns {"kv_bytes",
        "weights_released", "weight_bytes"}."""
        return self._control("sleep")

    def wake(self) -> dict:
        """Ends `sleep()`: reallocates the KV cache, re-prefills every held request's kept
        prefix with the engine's current weights (whatever partial_rollout_kv says: the old KV is
        gone) and resumes. Raises, staying asleep, when the weights were released and no
        `update_params` came since. Returns {"recomputed_requests", "recomputed_tokens"}."""
        return self._control("wake")

    def _control(self, kind: str, wait: bool = True):
        if wait and threading.current_thread() is self._thread:
            raise RuntimeError(f"{kind}() would wait for the scheduler thread it runs on")
        ctl = _Control(kind, concurrent.futures.Future())
        with self._cv:
            self._check_running()
            self._controls.append(ctl)
            self._cv.notify_all()
        return ctl.future.result() if wait else ctl.future

    @property
    def suspended(self) -> bool:
        """Whether admission and decoding are stopped (`suspend` or `sleep`)."""
        return self._suspended

    @property
    def asleep(self) -> bool:
        return self._asleep

    @property
    def policy_version(self) -> int:
        return self._version

    @property
    def stats(self) -> dict:
        """Counters: requests_submitted/finished/aborted, prefill_tokens (prompt tokens computed),
        reused_tokens (prompt tokens whose parked KV was reused), prefill_calls, append_calls,
        decode_loops, decode_steps, generated_tokens, evictions (parked slots taken for other
        requests), reuse_misses (a session's prompt did not extend its parked tokens), syncs,
        recomputed_requests / recomputed_tokens (held requests' KV rebuilt after a sync or a
        sleep; their tokens are not in prefill_tokens), parked_dropped (parked sessions whose KV
        a recompute sync or a sleep dropped), sleeps."""
        with self._cv:
            return dict(self._stats)

    def close(self) -> None:
        """Aborts what is pending or running and stops the scheduler thread."""
        with self._cv:
            self._closing = True
            self._cv.notify_all()
        if threading.current_thread() is not self._thread:
            self._thread.join()

    def __enter__(self) -> "RolloutServer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ validation
    def _check_running(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"the RolloutServer's scheduler thread failed: {self._error!r}") \
                from self._error
        if self._closing:
            raise RuntimeError("the RolloutServer is closed")

    def _validate(self, request_id, prompt_ids, sampling, max_new_tokens, session_id, seed, row):
        e = self.engine
        if not isinstance(request_id, str) or not request_id:
            raise TypeError(f"request_id must be a non-empty str, got {request_id!r}")
        if not isinstance(sampling, SamplingParams):
            raise TypeError(f"sampling must be a rollout.SamplingParams, got {type(sampling).__name__}")
        for name, v, lo in (("max_new_tokens", max_new_tokens, 1), ("seed", seed, None), ("row", row, 0)):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or (lo is not None and v < lo):
                raise ValueError(f"{name} must be an int{'' if lo is None else f' >= {lo}'}, got {v!r}")
        if session_id is not None and not isinstance(session_id, str):
            raise TypeError(f"session_id must be a str or None, got {session_id!r}")
        prompt = np.asarray(prompt_ids)
        if prompt.ndim != 1 or (prompt.size and not np.issubdtype(prompt.dtype, np.integer)):
            raise ValueError(f"request {request_id!r}: prompt_ids must be a flat list of int token ids")
        n = prompt.size
        if n == 0:
            raise ValueError(f"request {request_id!r}: prompt_ids is empty; a prompt needs at least one token")
        if n + max_new_tokens > e.max_target_length:
            raise ValueError(f"request {request_id!r}: prompt ({n} tokens) + max_new_tokens="
                             f"{max_new_tokens} exceeds max_target_length={e.max_target_length} (the "
                             f"KV cache length); lower max_new_tokens or raise max_target_length")
        vocab = e.config.vocab_size
        if prompt.min() < 0 or prompt.max() >= vocab:
            raise ValueError(f"request {request_id!r}: prompt_ids has token ids outside [0, {vocab})")
        return [int(t) for t in prompt]

    # ------------------------------------------------------------------ scheduler thread
    def _main(self) -> None:
        try:
            self._state = self.engine.init_decode_state()
            t = self.engine.max_target_length
            self._out = {"tokens": jnp.zeros((self._slots, t), jnp.int32),
                         "log_probs": jnp.zeros((self._slots, t), jnp.float32),
                         "lengths": jnp.zeros((self._slots,), jnp.int32)}
            if self.engine.record_experts:  # the experts of the token each decode step fed
                (layers, k), dtype = self.engine.expert_ids
                self._out["experts"] = jnp.full((self._slots, t, layers, k), -1, dtype)
            while self._step():
                pass
        except BaseException as error:  # noqa: BLE001 - every waiter must hear about it
            self._fail(error)

    def _step(self) -> bool:
        """One scheduler round; False once closed."""
        with self._cv:
            while not (self._closing or self._aborts or self._releases or self._syncs
                       or self._controls or (not self._suspended and (self._running or self._pending))):
                self._cv.wait()
            aborts, self._aborts = self._aborts, []
            releases, self._releases = self._releases, []
            controls, self._controls = self._controls, []
            closing = self._closing
        self._abort_running(aborts)
        for session in releases:
            self._parked.pop(session, None)
        if closing:
            self._shutdown(controls)
            return False
        for ctl in controls:
            self._apply_control(ctl)
        draining = self._apply_syncs()
        if self._suspended:
            return True
        self._recompute()
        if not draining:
            self._admit()
        if self._running:
            self._decode(draining)
        return True

    def _apply_control(self, ctl: _Control) -> None:
        """suspend / resume / sleep / wake, on the scheduler thread between decode loops."""
        try:
            result = None
            if ctl.kind == "suspend":
                self._suspended = True
                jax.block_until_ready(self._state)  # nothing of ours left running on the device
            elif ctl.kind == "resume":
                if self._asleep:
                    raise RuntimeError("the RolloutServer is asleep: call wake(), not resume()")
                self._suspended = False
                self._recompute()
            elif ctl.kind == "sleep":
                result = self._sleep()
            elif not self._asleep:  # wake while awake: as resume
                self._suspended = False
                result = self._recompute()
            else:
                result = self._wake()
        except Exception as error:  # noqa: BLE001 - the caller's mistake, the server goes on
            _set_future(ctl.future, error=error)
            return
        _set_future(ctl.future, result)

    def _sleep(self) -> dict:
        """Frees the KV cache (and the engine's own weight copy); running requests become stale."""
        self._suspended = True
        if self._asleep:
            return {"kv_bytes": 0, "weights_released": False, "weight_bytes": 0}
        self._drop_parked()
        kv = 0
        for x in jax.tree.leaves(self._state.cache):
            kv += x.nbytes
            x.delete()
        self._state = None
        self._asleep = True
        self._stale = set(self._running)
        weight_bytes = self.engine.release_params()
        self._stats["sleeps"] += 1
        return {"kv_bytes": kv, "weights_released": weight_bytes > 0, "weight_bytes": weight_bytes}

    def _wake(self) -> dict:
        """Reallocates the decode state and rebuilds the held requests' KV."""
        self.engine.check_params()
        if self.engine.params is None:
            raise RuntimeError("sleep() released the engine's weights: call update_params(new_params) "
                               "before wake()")
        self._state = self.engine.init_decode_state()
        self._asleep = self._suspended = False
        return self._recompute()

    def _drop_parked(self) -> None:
        self._stats["parked_dropped"] += len(self._parked)
        self._parked.clear()

    def _apply_syncs(self) -> bool:
        """Applies queued syncs in order; True while a "finish" sync waits for running requests."""
        while True:
            with self._cv:
                if not self._syncs:
                    return False
                sync = self._syncs[0]
                if sync.in_flight == "finish" and self._running and not self._suspended:
                    return True
                self._syncs.popleft()
            t0 = time.perf_counter()
            try:
                stats = self.engine.update_params(sync.params)
            except Exception as error:  # noqa: BLE001 - a bad param tree fails its caller only
                _set_future(sync.future, error=error)
                if self.engine.params is None and not self._asleep:  # weightless: nothing to run
                    raise
                continue
            self._version = sync.version if sync.version is not None else self._version + 1
            for slot, req in self._running.items():
                req.versions.append((int(self._generated[slot]) - req.offset, self._version))
            if self.partial_rollout_kv == "recompute":  # rebuilt before the next decode loop
                self._stale |= set(self._running)
                self._drop_parked()
            self._stats["syncs"] += 1
            _set_future(sync.future, {**stats, "policy_version": self._version,
                                      "held_requests": len(self._running),
                                      "wait_s": time.perf_counter() - t0})

    def _recompute(self) -> dict:
        """Re-prefills the stale running slots: each request's kept prefix (prompt + tokens so
        far, the last one pending) with the engine's current weights, its slot re-armed with the
        same key, budget and step count, so it continues as a fresh prefill of that prefix would.
        Each prefix is prefilled whole (not in admission's max_prefill_length chunks), in the
        calls `refill_plan` lays out; one longer than max(recompute_tokens, max_prefill_length)
        is prefilled up to the largest refill bucket within that, the rest appended in chunks."""
        slots, self._stale = sorted(self._stale & set(self._running)), set()
        if not slots:
            return {"recomputed_requests": 0, "recomputed_tokens": 0}
        idx = np.full(_next_pow2(max(len(slots), 4)), self._slots, np.int32)
        idx[:len(slots)] = slots
        tokens, _ = jax.device_get(_gather_rows(self._out["tokens"], self._out["log_probs"],
                                                jnp.asarray(idx)))
        reqs = []
        for j, slot in enumerate(slots):
            req = self._running[slot]
            req.fill = req.prompt + [int(t) for t in tokens[j, req.offset:self._generated[slot]]]
            req.decoded_from = len(req.fill) - 1  # the re-prefill records the tokens before
            reqs.append(req)
        n = sum(len(r.fill) for r in reqs)
        # one row holds at most `limit` tokens (the call's memory); a longer prefix is prefilled
        # up to the largest refill bucket under it, the rest appended as admission does
        limit = max(self.recompute_tokens, self.engine.max_prefill_length)
        head = max(b for b in REFILL_BUCKETS if b <= limit)
        heads = [r.fill if refill_bucket(len(r.fill), self.engine.max_target_length) <= limit
                 else r.fill[:head] for r in reqs]
        if self.engine.batch_invariant:
            plan = self._own_bucket_plan([len(h) for h in heads])
        else:
            plan = refill_plan([len(h) for h in heads], self.engine.max_target_length, self.recompute_tokens)
        for bucket, rows, size in plan:
            self._insert_prefill([reqs[i] for i in rows], bucket, size, [heads[i] for i in rows])
        todo = [r for r in reqs if r.cached < len(r.fill) - 1]
        while todo:
            self._append(todo, stat=None)
            todo = [r for r in todo if r.cached < len(r.fill) - 1]
        self._stats["recomputed_tokens"] += n
        self._state = self.engine.set_generated(self._state, np.asarray(slots),
                                                self._generated[slots])
        self._stats["recomputed_requests"] += len(reqs)
        return {"recomputed_requests": len(reqs), "recomputed_tokens": n}

    def _own_bucket_plan(self, lengths: list[int]) -> list[tuple]:
        """`refill_plan` for a batch_invariant engine: each prefix padded to its own refill bucket
        (in `refill_plan` a call's longest prefix sets every row's bucket, and a row's numbers
        depend on its bucket), one call per bucket, longest first; the engine computes it in
        calls of BATCH_INVARIANT_ROWS rows (each holds at most that many rows x the bucket)."""
        by_bucket: dict[int, list[int]] = {}
        for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
            by_bucket.setdefault(refill_bucket(lengths[i], self.engine.max_target_length), []).append(i)
        return [(bucket, rows, self.engine.call_rows(len(rows))) for bucket, rows in by_bucket.items()]

    def _free_slots(self) -> list[int]:
        parked = {slot for slot, *_ in self._parked.values()}
        return [s for s in range(self._slots) if s not in self._running and s not in parked]

    def _claim(self) -> list[tuple[_Request, list[int] | None]]:
        """Pops the pending requests that get a slot now: (request, known tokens to extend or None;
        with record_experts the known tokens' experts are put into the request's record)."""
        free = self._free_slots()
        claimed = []
        with self._cv:
            while self._pending:
                req = self._pending[0]
                parked = self._parked.pop(req.session_id, None) if req.session_id is not None else None
                if parked is not None:
                    req.slot, known, experts = parked
                    if not (self.reuse_prefix and len(req.prompt) >= len(known)
                            and req.prompt[:len(known)] == known):
                        known = None
                        self._stats["reuse_misses"] += 1
                    elif experts is not None:
                        self._new_record(req)[:len(experts)] = experts
                elif free:
                    req.slot, known = free.pop(0), None
                elif self._parked:
                    _, (req.slot, *_) = self._parked.popitem(last=False)
                    known = None
                    self._stats["evictions"] += 1
                else:
                    break
                self._pending.popleft()
                claimed.append((req, known))
        return claimed

    def _admit(self) -> None:
        """Claims slots for pending requests and fills their KV: a full prefill of the first
        max_prefill_length tokens, or the session's parked KV; then the remaining prompt tokens
        in chunks of at most max_prefill_length (`Engine.append_rows`)."""
        claimed = self._claim()
        for req, known in claimed:
            self._running[req.slot] = req
            self._generated[req.slot] = req.offset
            req.decoded_from = len(req.prompt) - 1
            if req.experts is None and self.engine.record_experts:
                self._new_record(req)
            req.versions = [(0, self._version)]
            req.fill = req.prompt
            req.num_cached = req.cached = 0 if known is None else len(known) - 1
            self._stats["reused_tokens"] += req.num_cached
        self._fill([r for r, known in claimed if known is None],
                   [r for r, known in claimed if known is not None])
        resumed = [r for r, _ in claimed if r.offset]
        if resumed:
            self._state = self.engine.set_generated(
                self._state, np.asarray([r.slot for r in resumed]), [r.offset for r in resumed])

    def _fill(self, full: list[_Request], extend: list[_Request]) -> None:
        """Puts each request's `fill` tokens (all but the last, which is pending) into its slot's
        KV: `full` from scratch, `extend` after the `cached` tokens its slot holds; re-arms them."""
        for r in full:
            r.cached = 0
        self._prefill(full)
        todo = list(extend)  # re-armed even with 1 new token
        todo += [r for r in full if r.cached < len(r.fill) - 1]
        while todo:
            self._append(todo)
            todo = [r for r in todo if r.cached < len(r.fill) - 1]

    def _row_args(self, reqs, size) -> dict:
        """insert_rows / append_rows per-row arguments, padded to `size` rows (dst = slots: ignored)."""
        pad = size - len(reqs)
        return dict(dst=np.asarray([r.slot for r in reqs] + [self._slots] * pad),
                    rows=np.asarray([r.slot for r in reqs] + [0] * pad),
                    max_new=np.asarray([r.offset + r.max_new for r in reqs] + [0] * pad),
                    sampling=[r.sampling for r in reqs] + [reqs[0].sampling] * pad,
                    row_keys=np.stack([r.key_data for r in reqs] + [reqs[0].key_data] * pad))

    def _chunks(self, items, length_of):
        """Items grouped by the prefill bucket of length_of(item), at most max_prefill_batch each."""
        by_bucket: dict[int, list] = {}
        for item in items:
            by_bucket.setdefault(self.engine.bucket_for(length_of(item)), []).append(item)
        for bucket, group in by_bucket.items():
            for lo in range(0, len(group), self.max_prefill_batch):
                yield bucket, group[lo:lo + self.max_prefill_batch]

    def _prefill(self, reqs: list[_Request]) -> None:
        """Full prefill of each request's first max_prefill_length tokens, inserted into its slot."""
        first = {id(r): r.fill[:self.engine.max_prefill_length] for r in reqs}
        for bucket, chunk in self._chunks(reqs, lambda r: len(first[id(r)])):
            size = self.engine.call_rows(len(chunk))
            self._insert_prefill(chunk, bucket, size, [first[id(r)] for r in chunk])
            self._stats["prefill_tokens"] += sum(len(first[id(r)]) for r in chunk)

    def _insert_prefill(self, chunk: list[_Request], bucket: int, size: int, seqs: list) -> None:
        """One prefill call of `seqs` (chunk[j]'s tokens from index 0, at most `bucket`), `size`
        rows, inserted into the requests' slots and re-armed (each caches all but its last)."""
        e = self.engine
        tokens = np.full((size, bucket), e.pad_token_id, np.int32)
        lengths = np.ones(size, np.int32)
        for j, (r, seq) in enumerate(zip(chunk, seqs)):
            tokens[j, :len(seq)] = seq
            lengths[j] = len(seq)
            r.cached = len(seq) - 1
        prefix = e.prefill_batch(e.params, tokens, lengths)
        if prefix.experts is not None:  # record_experts: [size, bucket, L, k], the cached tokens'
            experts = np.asarray(jax.device_get(prefix.experts))
            for j, r in enumerate(chunk):
                r.experts[:r.cached] = experts[j, :r.cached]
        self._state = e.insert_rows(self._state, prefix, src=np.arange(size),
                                    **self._row_args(chunk, size))
        self._stats["prefill_calls"] += 1

    def _append(self, reqs: list[_Request], stat: str | None = "prefill_tokens") -> None:
        """Appends each request's next tokens (from its pending one, at most max_prefill_length)
        to the KV its slot holds, and re-arms the slot; counts them in stats[stat] (None: not)."""
        e = self.engine
        nxt = {id(r): r.fill[r.cached:r.cached + e.max_prefill_length] for r in reqs}
        for bucket, chunk in self._chunks(reqs, lambda r: len(nxt[id(r)])):
            size = self.engine.call_rows(len(chunk))
            tokens = np.full((size, bucket), e.pad_token_id, np.int32)
            lengths = np.ones(size, np.int32)
            start = [r.cached for r in chunk]
            for j, r in enumerate(chunk):
                tokens[j, :len(nxt[id(r)])] = nxt[id(r)]
                lengths[j] = len(nxt[id(r)])
                r.cached += int(lengths[j]) - 1
                if stat is not None:
                    self._stats[stat] += int(lengths[j])
            self._state, experts = e.append_rows(self._state, tokens=tokens, true_lengths=lengths,
                                                 with_experts=True, **self._row_args(chunk, size))
            if experts is not None:  # record_experts: the tokens each row cached
                experts = np.asarray(jax.device_get(experts))
                for j, r in enumerate(chunk):
                    r.experts[start[j]:r.cached] = experts[j, :r.cached - start[j]]
            self._stats["append_calls"] += 1

    def _decode(self, draining: bool) -> None:
        """One on-device decode loop, then resolves the requests that finished in it."""
        e = self.engine
        with self._cv:
            waiting = 0 if draining else len(self._pending)
        # exit early once enough slots are free for the waiting requests; else run all steps
        min_free = self._slots + 1 if waiting == 0 else min(waiting, max(1, -(-self._slots // 8)))
        self._state, self._out, steps = e.decode_loop(e.params, self._state, self._out,
                                                      self.steps_per_sync, min_free)
        active, generated, steps = jax.device_get((self._state.active, self._state.generated, steps))
        self._stats["decode_loops"] += 1
        self._stats["decode_steps"] += int(steps)
        for slot in self._running:
            self._generated[slot] = generated[slot]
        self._stream([s for s, r in self._running.items() if r.on_tokens is not None
                      and active[s] and self._generated[s] > r.streamed])
        self._finish([slot for slot in self._running if not active[slot]])

    def _stream(self, slots: list[int]) -> None:
        """Gives running streaming requests (submit's on_tokens) their tokens generated so far."""
        if not slots:
            return
        idx = np.full(_next_pow2(max(len(slots), 4)), self._slots, np.int32)
        idx[:len(slots)] = slots
        tokens, _ = jax.device_get(_gather_rows(self._out["tokens"], self._out["log_probs"],
                                                jnp.asarray(idx)))
        for j, slot in enumerate(slots):
            req, n = self._running[slot], int(self._generated[slot])
            new, req.streamed = [int(t) for t in tokens[j, req.streamed:n]], n
            try:
                req.on_tokens(new)
            except Exception:  # the caller's bug must not stop the scheduler: no more calls
                req.on_tokens = None

    def _abort_running(self, reqs: list[_Request]) -> None:
        slots = [r.slot for r in reqs if self._running.get(r.slot) is r]
        for slot in slots:
            self._running[slot].aborted = True
            if self._state is not None:  # asleep: wake() rebuilds the state without it
                self._state = self.engine.free_resource(self._state, slot)
        self._finish(slots)

    def _finish(self, slots: list[int]) -> None:
        """Reads the tokens of `slots` (inactive now), parks session slots, resolves futures."""
        if not slots:
            return
        idx = np.full(_next_pow2(max(len(slots), 4)), self._slots, np.int32)
        idx[:len(slots)] = slots
        tokens, log_probs = jax.device_get(_gather_rows(self._out["tokens"], self._out["log_probs"],
                                                        jnp.asarray(idx)))
        decoded = (np.asarray(jax.device_get(_gather_experts(self._out["experts"], jnp.asarray(idx))))
                   if "experts" in self._out else None)
        for j, slot in enumerate(slots):
            req = self._running.pop(slot)
            stale = slot in self._stale  # its KV is the old weights' (or gone): not parked
            self._stale.discard(slot)
            n = int(self._generated[slot])
            toks = [int(t) for t in tokens[j, req.offset:n]]
            reason = "abort" if req.aborted else ("stop" if toks and toks[-1] in self._stop else "length")
            experts = None
            if decoded is not None:  # decode step g fed the token at position len(prompt) - 1 + g
                experts = req.experts[:len(req.prompt) + len(toks)]
                first = len(req.prompt) - 1
                lo = max(req.decoded_from, first)
                experts[lo:first + len(toks)] = decoded[j, req.offset + lo - first:n]
            if req.session_id is not None and not stale:
                self._parked.pop(req.session_id, None)  # an older slot of the session becomes free
                kept = None if experts is None else experts[:len(req.prompt) + len(toks) - 1].copy()
                self._parked[req.session_id] = (slot, req.prompt + toks, kept)
            self._stats["requests_aborted" if req.aborted else "requests_finished"] += 1
            self._stats["generated_tokens"] += len(toks)
            out = self._output(req, toks, [float(x) for x in log_probs[j, req.offset:n]], reason, experts)
            with self._cv:
                self._live.pop(req.request_id, None)
            _set_future(req.future, out)

    def _new_record(self, req: _Request) -> np.ndarray:
        """record_experts: the request's host record of experts by position, all -1."""
        (layers, k), dtype = self.engine.expert_ids
        req.experts = np.full((len(req.prompt) + req.max_new, layers, k), -1, dtype)
        return req.experts

    def _output(self, req: _Request, toks, log_probs, reason, experts=None) -> GenerateOutput:
        versions = []
        for k, (start, version) in enumerate(req.versions):
            end = req.versions[k + 1][0] if k + 1 < len(req.versions) else len(toks)
            versions += [version] * max(0, min(end, len(toks)) - len(versions))
        return GenerateOutput(
            request_id=req.request_id, token_ids=toks, log_probs=log_probs, finish_reason=reason,
            num_prompt_tokens=len(req.prompt), num_cached_tokens=req.num_cached,
            num_computed_prompt_tokens=len(req.prompt) - req.num_cached if req.slot >= 0 else 0,
            policy_version=self._version, policy_versions=versions, routed_experts=experts)

    def _shutdown(self, controls=()) -> None:
        """close(): aborts running and pending requests, fails queued syncs and controls."""
        for ctl in controls:
            _set_future(ctl.future, error=RuntimeError("the RolloutServer closed"))
        self._abort_running(list(self._running.values()))
        with self._cv:
            pending, self._pending = list(self._pending), collections.deque()
            syncs, self._syncs = list(self._syncs), collections.deque()
            self._live.clear()
        for req in pending:
            _set_future(req.future, self._output(req, [], [], "abort"))
        for sync in syncs:
            _set_future(sync.future, error=RuntimeError("the RolloutServer closed before this sync"))

    def _fail(self, error: BaseException) -> None:
        """The scheduler thread died: every waiter gets `error`; later calls raise."""
        with self._cv:
            self._error = error
            waiters = [r.future for r in self._pending] + [s.future for s in self._syncs]
            waiters += [c.future for c in self._controls]
            self._controls.clear()
            waiters += [r.future for r in self._running.values()]
            self._pending.clear()
            self._syncs.clear()
            self._live.clear()
        for future in waiters:
            _set_future(future, error=error)
