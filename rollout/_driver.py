"""`RolloutDriver`: the RL batch generator over an `Engine` (continuous batching, on-device loop).

Given unpadded prompts and `n` samples per prompt it returns verl's rollout fields. Each prompt is
prefilled once (prompts of one length bucket together) and its prefix inserted into `n` slots;
the decode runs up to `steps_per_sync` steps inside one `lax.while_loop` and writes tokens and
log-probs straight into on-device output buffers, so the host only reads the slots' `active`
flags between loops (one tiny transfer per K steps) and refills freed slots with the next rows.

Randomness: row r (prompt r // n, sample r % n) samples step t with
`fold_in(fold_in(key(seed), r), t)`, so outputs do not depend on the slot count, the insertion
order or what else is in the batch. Sampling parameters are traced values: changing them does
not recompile.
"""
from __future__ import annotations

import dataclasses
from collections import OrderedDict

import jax
import jax.numpy as jnp
import numpy as np

from sharding import to_host

from ._engine import Engine, _next_pow2
from ._sampling import SamplingParams


@dataclasses.dataclass
class RolloutBatch:
    """Generated responses, rows in verl's interleaved order (prompt i's samples at i*n ... i*n+n-1).

    responses int32[b*n, t] right-padded with pad_token_id; response_mask int32[b*n, t] 1 up to and
    including the stop token; rollout_log_probs f32[b*n, t] (0 where masked); response_lengths
    int32[b*n]; finish_reasons "stop" | "length"; prompt_index int32[b*n]; routed_experts (the
    engine's `record_experts`, router replay, else None) int8/int16[b*n, P + t, layers, k]: the
    experts every layer chose for each token the engine fed, in the columns of the row's
    left-padded prompt (P = `prompt_width`) followed by its response; -1 where no token was fed
    (padding, and each response's last token, which no step reads).
    """

    responses: np.ndarray
    response_mask: np.ndarray
    rollout_log_probs: np.ndarray
    response_lengths: np.ndarray
    finish_reasons: list[str]
    prompt_index: np.ndarray
    stats: dict = dataclasses.field(default_factory=dict)
    routed_experts: np.ndarray | None = None


def _as_key(seed):
    if isinstance(seed, (int, np.integer)):
        return jax.random.key(int(seed))
    seed = jnp.asarray(seed)
    if jnp.issubdtype(seed.dtype, jax.dtypes.prng_key):
        return seed
    if seed.ndim == 0:
        return jax.random.key(seed)
    return jax.random.wrap_key_data(seed.astype(jnp.uint32))


class RolloutDriver:
    """Generates RL batches with `engine`. `steps_per_sync`: decode steps per host check.

    `max_prefill_batch` caps how many prompts one prefill call takes (activation memory).
    The decode state (KV cache) is allocated on first use and kept across calls and weight syncs;
    `release()` frees it (e.g. to give the memory to the trainer between rollouts).
    """

    def __init__(self, engine: Engine, *, steps_per_sync: int = 16, max_prefill_batch: int = 64):
        if steps_per_sync < 1:
            raise ValueError(f"steps_per_sync must be >= 1, got {steps_per_sync}")
        self.engine = engine
        self.steps_per_sync = int(steps_per_sync)
        self.max_prefill_batch = int(max_prefill_batch)
        self._state = None

    def release(self) -> None:
        """Drops the decode state (KV cache); the next `generate` allocates it again."""
        self._state = None

    # ------------------------------------------------------------------ validation
    def _validate(self, prompts, n, max_new_tokens):
        e = self.engine
        if not isinstance(n, (int, np.integer)) or n < 1:
            raise ValueError(f"n (samples per prompt) must be a positive int, got {n!r}")
        if n > e.max_concurrent_decodes:
            raise ValueError(f"n={n} samples per prompt exceeds the engine's "
                             f"max_concurrent_decodes={e.max_concurrent_decodes} slots; build the "
                             f"engine with more slots or lower n")
        if not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
        if len(prompts) == 0:
            raise ValueError("prompts is empty")
        out = []
        for i, p in enumerate(prompts):
            p = np.asarray(p, dtype=np.int64).reshape(-1)
            if p.size == 0:
                raise ValueError(f"prompt {i} is empty; every prompt needs at least one token")
            if p.size > e.max_prefill_length:
                raise ValueError(f"prompt {i} has {p.size} tokens, more than max_prefill_length="
                                 f"{e.max_prefill_length}; truncate it or raise max_prefill_length")
            if p.size + max_new_tokens > e.max_target_length:
                raise ValueError(f"prompt {i} ({p.size} tokens) + max_new_tokens={max_new_tokens} "
                                 f"exceeds max_target_length={e.max_target_length} (the KV cache "
                                 f"length); lower max_new_tokens or raise max_target_length")
            vocab = e.config.vocab_size
            if p.min() < 0 or p.max() >= vocab:
                raise ValueError(f"prompt {i} has token ids outside [0, {vocab})")
            out.append(p.astype(np.int32))
        return out

    # ------------------------------------------------------------------ main entry
    def generate(self, prompts, *, n: int = 1, max_new_tokens: int,
                 sampling: SamplingParams | None = None, seed=0, row_offset: int = 0,
                 prompt_width: int | None = None) -> RolloutBatch:
        """Generates `n` samples for each prompt (lists of token ids, unpadded). `row_offset`:
        row r samples as row `row_offset + r` of a larger batch would (one engine replica per
        host, each generating its share of the prompts). `prompt_width`: the prompt columns of
        `routed_experts` (None: the longest prompt; hosts sharing one batch pass the same)."""
        e = self.engine
        prompts = self._validate(prompts, n, max_new_tokens)
        sampling = e.sampling if sampling is None else sampling
        if not isinstance(sampling, SamplingParams):
            raise TypeError(f"sampling must be a rollout.SamplingParams, got {type(sampling).__name__}")
        params = e.params
        e.check_params(params)
        key = _as_key(seed)
        rows = len(prompts) * n
        t = int(max_new_tokens)
        # Output buffers in power-of-two shapes (>= 16) so the decode loop compiles once for many
        # batch sizes and lengths; rows and steps beyond the request are never written.
        rcap, tcap = _next_pow2(max(rows, 16)), _next_pow2(max(t, 16))
        out = {"tokens": jnp.zeros((rcap, tcap), jnp.int32),
               "log_probs": jnp.zeros((rcap, tcap), jnp.float32),
               "lengths": jnp.zeros((rcap,), jnp.int32)}
        if e.record_experts:
            (layers, k), dtype = e.expert_ids
            out["experts"] = jnp.full((rcap, tcap, layers, k), -1, dtype)
        state = self._state if self._state is not None else e.init_decode_state()
        self._state = None  # donated below; restored only when the call finishes cleanly
        run = _Run(self, prompts, n, t, sampling, key, params, int(row_offset))
        state, out = run.loop(state, out)
        self._state = state
        batch = self._collect(out, n, len(prompts), t, run.stats)
        if e.record_experts:
            width = max(len(p) for p in prompts) if prompt_width is None else int(prompt_width)
            batch.routed_experts = _routed_experts(run.prompt_experts, to_host(out["experts"]), prompts,
                                                   batch.response_lengths, n, width, t)
        return batch

    def _collect(self, out, n, num_prompts, t, stats) -> RolloutBatch:
        e = self.engine
        rows = n * num_prompts
        tokens, logp = to_host(out["tokens"])[:rows, :t], to_host(out["log_probs"])[:rows, :t]
        lengths = to_host(out["lengths"])[:rows]
        mask = (np.arange(t)[None, :] < lengths[:, None]).astype(np.int32)
        tokens = np.where(mask > 0, tokens, e.pad_token_id).astype(np.int32)
        logp = np.where(mask > 0, logp, 0.0).astype(np.float32)
        last = tokens[np.arange(len(lengths)), np.maximum(lengths - 1, 0)]
        stop = np.isin(last, np.asarray(e.stop_token_ids, np.int32)) & (lengths > 0)
        return RolloutBatch(
            responses=tokens, response_mask=mask, rollout_log_probs=logp,
            response_lengths=lengths.astype(np.int32),
            finish_reasons=["stop" if s else "length" for s in stop],
            prompt_index=np.repeat(np.arange(num_prompts, dtype=np.int32), n), stats=stats)


def _routed_experts(prompt_experts: dict, decoded: np.ndarray, prompts, lengths, n: int, width: int, t: int):
    """The rows' recorded experts in their `[P + t]` columns (`RolloutBatch.routed_experts`).
    prompt_experts: prompt -> [len - 1, L, k] (prefill: all but its last token); decoded
    [rows cap, steps cap, L, k]: step g fed column P - 1 + g (the prompt's last token, then the
    response tokens)."""
    rows = len(lengths)
    out = np.full((rows, width + t, *decoded.shape[2:]), -1, decoded.dtype)
    for r in range(rows):
        p = prompts[r // n]
        if len(p) > width:
            raise ValueError(f"prompt {r // n} has {len(p)} tokens, more than prompt_width={width}")
        out[r, width - len(p):width - 1] = prompt_experts[r // n]
        out[r, width - 1:width - 1 + lengths[r]] = decoded[r, :lengths[r]]
    return out


class _Run:
    """One `generate` call's host-side bookkeeping: which rows are pending, which prefixes live."""

    def __init__(self, driver: RolloutDriver, prompts, n, max_new, sampling, key, params, row_offset=0):
        self.d, self.e = driver, driver.engine
        self.row_offset = row_offset
        self.prompts, self.n, self.max_new = prompts, n, max_new
        self.sampling, self.key, self.params = sampling, key, params
        self.rows = len(prompts) * n
        self.next_row = 0
        self.live: OrderedDict[int, tuple] = OrderedDict()  # prompt -> (Prefix, row in it)
        self.prompt_experts: dict[int, np.ndarray] = {}  # record_experts: prompt -> [len - 1, L, k]
        self.stats = {"prefill_calls": 0, "prompts_prefilled": 0, "insert_calls": 0,
                      "decode_loops": 0, "decode_steps": 0}

    def loop(self, state, out):
        slots = self.e.max_concurrent_decodes
        free = np.arange(slots)
        active = np.zeros(slots, bool)
        while True:
            if self.next_row < self.rows and len(free):
                state, filled = self._refill(state, free)
                active[filled] = True
            if not active.any() and self.next_row >= self.rows:
                return state, out
            pending = self.rows - self.next_row
            # refill once enough slots are free for a useful batch (not on every finished sequence)
            min_free = slots + 1 if pending == 0 else min(pending, max(self.n, -(-slots // 8)))
            state, out, steps = self.e.decode_loop(self.params, state, out, self.d.steps_per_sync, min_free)
            active = to_host(state.active).copy()  # the one host sync per loop
            free = np.flatnonzero(~active)
            self.stats["decode_loops"] += 1
            self.stats["decode_steps"] += int(to_host(steps))

    def _refill(self, state, free):
        """Fills free slots with the next rows; prefills prompts that have no live prefix."""
        take = min(len(free), self.rows - self.next_row)
        rows = np.arange(self.next_row, self.next_row + take)
        self.next_row += take
        prompt_of = rows // self.n
        self._prefill_missing([int(p) for p in dict.fromkeys(prompt_of) if int(p) not in self.live])
        groups: dict[int, list] = {}
        for slot, row, p in zip(free[:take], rows, prompt_of):
            prefix, src = self.live[int(p)]
            groups.setdefault(id(prefix), [prefix, [], [], []])
            g = groups[id(prefix)]
            g[1].append(src), g[2].append(slot), g[3].append(row)
        for prefix, src, dst, rws in groups.values():
            keys = dict(key=self.key)
            if self.row_offset:  # each row's own stream: fold_in(key, row_offset + row)
                keys = dict(row_keys=np.asarray(jax.random.key_data(jax.vmap(jax.random.fold_in, (None, 0))(
                    self.key, jnp.asarray(rws, jnp.int32) + self.row_offset))))
            state = self.e.insert_rows(
                state, prefix, src=np.asarray(src), dst=np.asarray(dst), rows=np.asarray(rws),
                max_new=np.full(len(dst), self.max_new), sampling=self.sampling, **keys)
            self.stats["insert_calls"] += 1
        for row, p in zip(rows, prompt_of):  # a prompt's prefix dies with its last sample
            if row % self.n == self.n - 1:
                self.live.pop(int(p), None)
        return state, free[:take]

    def _prefill_missing(self, prompt_ids):
        by_bucket: dict[int, list[int]] = {}
        for p in prompt_ids:
            by_bucket.setdefault(self.e.bucket_for(len(self.prompts[p])), []).append(p)
        for bucket, ids in by_bucket.items():
            for lo in range(0, len(ids), self.d.max_prefill_batch):
                chunk = ids[lo:lo + self.d.max_prefill_batch]
                batch = self.e.call_rows(len(chunk))
                tokens = np.full((batch, bucket), self.e.pad_token_id, np.int32)
                lengths = np.ones(batch, np.int32)
                for j, p in enumerate(chunk):
                    tokens[j, :len(self.prompts[p])] = self.prompts[p]
                    lengths[j] = len(self.prompts[p])
                prefix = self.e.prefill_batch(self.params, tokens, lengths)
                experts = None if prefix.experts is None else to_host(prefix.experts)
                for j, p in enumerate(chunk):
                    self.live[p] = (prefix, j)
                    if experts is not None:
                        self.prompt_experts[p] = experts[j, :len(self.prompts[p]) - 1]
                self.stats["prefill_calls"] += 1
                self.stats["prompts_prefilled"] += len(chunk)
