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
        out = self._buffers(rows, t)
        run = _Run(self, prompts, np.repeat(np.arange(len(prompts)), n), np.full(rows, t), sampling, key,
                   params, int(row_offset))
        out = self._loop(run, out)
        batch = self._collect(out, n, len(prompts), t, run.stats)
        if e.record_experts:
            width = max(len(p) for p in prompts) if prompt_width is None else int(prompt_width)
            batch.routed_experts = _routed_experts(run.prompt_experts, to_host(out["experts"]), prompts,
                                                   batch.response_lengths, n, width, t)
        return batch

    def teacher_force(self, prompts, responses, response_lengths, *, max_new_tokens: int,
                      sampling: SamplingParams | None = None) -> np.ndarray:
        """The engine's log-prob of each given response token: row r's prompt `prompts[r]`
        (unpadded) is prefilled and its decode steps are fed `responses[r, :response_lengths[r]]`
        instead of sampling, in the programs `generate` runs (the same decode loop over buffers of
        the same shapes for the same `max_new_tokens` and row count), so on a `batch_invariant`
        engine each log-prob is bit for bit the one the rollout reported for that token under the
        same weights, wherever and beside whatever it ran. Identical prompts are prefilled once.
        Log-probs are log_softmax(logits / T)[token] with `sampling`'s temperature (T = 1 when
        greedy). Returns f32[rows, responses.shape[1]], 0 past each row's length.

        Single-turn rows only: a stop token before a row's last token (a multi-turn trajectory)
        is an error, as is a row that would run past the KV cache."""
        e = self.engine
        if not e.batch_invariant:
            raise ValueError("teacher_force needs a batch_invariant engine (rollout.batch_invariant=True): "
                             "otherwise its log-probs depend on what shares its calls and would not be "
                             "the rollout's")
        responses = np.asarray(responses)
        lengths = np.asarray(response_lengths, np.int64).reshape(-1)
        if responses.ndim != 2 or len(responses) != len(prompts) or len(lengths) != len(prompts):
            raise ValueError(f"teacher_force: {len(prompts)} prompts, responses of shape {responses.shape} and "
                             f"{len(lengths)} lengths must describe the same rows")
        t = int(max_new_tokens)
        if lengths.min(initial=0) < 0 or lengths.max(initial=0) > min(t, responses.shape[1]):
            raise ValueError(f"teacher_force: response lengths must be in [0, {min(t, responses.shape[1])}] "
                             f"(max_new_tokens={t}, {responses.shape[1]} response columns)")
        real = np.flatnonzero(lengths > 0)
        logp = np.zeros(responses.shape, np.float32)
        if real.size == 0:
            return logp
        vocab = e.config.vocab_size
        for r in real:
            toks = responses[r, :lengths[r]]
            if toks.min() < 0 or toks.max() >= vocab:
                raise ValueError(f"teacher_force: response {r} has token ids outside [0, {vocab})")
            early = np.flatnonzero(np.isin(toks[:-1], np.asarray(e.stop_token_ids)))
            if early.size:
                raise ValueError(f"teacher_force: response {r} has a stop token at position {early[0]}, before "
                                 f"its last token ({lengths[r] - 1}): only single-turn responses can be "
                                 "replayed through the decode loop")
        # identical prompts prefilled once: rows grouped by prompt (the run keeps a prefix until
        # its last row), results put back in the caller's order
        unique: dict[tuple, int] = {}
        prompt_of = np.asarray([unique.setdefault(tuple(int(x) for x in prompts[r]), len(unique)) for r in real])
        by_prompt = np.argsort(prompt_of, kind="stable")
        order = real[by_prompt]
        uniq = self._validate([list(p) for p in unique], 1, t)
        sampling = e.sampling if sampling is None else sampling
        forced = np.full((len(order), t), -1, np.int32)
        for i, r in enumerate(order):
            forced[i, :lengths[r]] = responses[r, :lengths[r]]
        out = self._buffers(len(order), t, forced)
        run = _Run(self, uniq, prompt_of[by_prompt], lengths[order], sampling,
                   jax.random.key(0), e.params, 0)
        e.check_params(run.params)
        out = self._loop(run, out)
        got = to_host(out["lengths"])[:len(order)]
        if np.any(got != lengths[order]):
            i = int(np.flatnonzero(got != lengths[order])[0])
            raise RuntimeError(f"teacher_force: response {order[i]} stopped after {got[i]} of its "
                               f"{lengths[order][i]} tokens")
        scored = to_host(out["log_probs"])[:len(order)]
        for i, r in enumerate(order):
            logp[r, :lengths[r]] = scored[i, :lengths[r]]
        return logp

    def _buffers(self, rows: int, t: int, forced: np.ndarray | None = None) -> dict:
        """The decode loop's output buffers for `rows` rows of up to `t` tokens, in power-of-two
        shapes (>= 16) so the loop compiles once for many batch sizes and lengths (rows and steps
        beyond the request are never written). A batch_invariant engine's carry `forced` (the
        teacher-forced tokens, -1 = sample) always, so generating and teacher forcing run one
        program."""
        e = self.engine
        rcap, tcap = _next_pow2(max(rows, 16)), _next_pow2(max(t, 16))
        out = {"tokens": jnp.zeros((rcap, tcap), jnp.int32),
               "log_probs": jnp.zeros((rcap, tcap), jnp.float32),
               "lengths": jnp.zeros((rcap,), jnp.int32)}
        if e.record_experts:
            (layers, k), dtype = e.expert_ids
            out["experts"] = jnp.full((rcap, tcap, layers, k), -1, dtype)
        if e.batch_invariant:
            buf = np.full((rcap, tcap), -1, np.int32)
            if forced is not None:
                buf[:forced.shape[0], :forced.shape[1]] = forced
            out["forced"] = jnp.asarray(buf)
        elif forced is not None:
            raise ValueError("forced tokens need a batch_invariant engine")
        return out

    def _loop(self, run: "_Run", out: dict) -> dict:
        """Runs `run` to completion on the kept decode state; returns the filled buffers."""
        state = self._state if self._state is not None else self.engine.init_decode_state()
        self._state = None  # donated below; restored only when the call finishes cleanly
        state, out = run.loop(state, out)
        self._state = state
        return out

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

    def __init__(self, driver: RolloutDriver, prompts, prompt_of, max_new, sampling, key, params, row_offset=0):
        """prompt_of int[rows]: each row's prompt (a prompt's rows consecutive); max_new int[rows]."""
        self.d, self.e = driver, driver.engine
        self.row_offset = row_offset
        self.prompts, self.prompt_of, self.max_new = prompts, np.asarray(prompt_of), np.asarray(max_new)
        self.sampling, self.key, self.params = sampling, key, params
        self.rows = len(self.prompt_of)
        self.n = int(np.bincount(self.prompt_of).max())  # the most rows of one prompt
        self.last_row = {int(p): r for r, p in enumerate(self.prompt_of)}  # a prompt's prefix dies with it
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
        prompt_of = self.prompt_of[rows]
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
                max_new=self.max_new[np.asarray(rws)], sampling=self.sampling, **keys)
            self.stats["insert_calls"] += 1
        for row, p in zip(rows, prompt_of):  # a prompt's prefix dies with its last row
            if self.last_row[int(p)] == row:
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
