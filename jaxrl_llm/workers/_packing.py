"""Micro-batches of packed rows (verl's `use_remove_padding`) and token-budget micro-batches
(verl's `use_dynamic_bsz`), apart or together.

A padded batch holds rows `[b, p + t]`: a left-padded prompt and a right-padded response, one
contiguous run of real tokens per row. Here the rows' real runs are concatenated into *packs*
(sequences the model sees) of a bucketed length `C` with `attention_mask` holding segment ids
(1, 2, ... per row of the pack, 0 = padding) and `position_ids` restarting per row, so no compute
goes to padding:

1. `balanced_partition`: rows -> data-parallel shards with about equal token sums
   (Karmarkar-Karp largest differencing, deterministic);
2. first-fit decreasing: each shard's rows -> packs of at most `C` tokens;
3. micro-batch `i` holds `P` packs per shard: `[dp * P, C]` sequences (device `d` holds
   sequences `d * P ... d * P + P - 1`), with `P * C` at most the token budget; shards with fewer
   packs get empty ones. The rows of a device's micro-batch are then spread evenly over its `P`
   packs (`spread_rows`: fewer rows per pack, shorter packs).

The pack length `C` is capped (`pack_cap`): the smallest power of two that holds the longest row
and at least `PACK_LENGTH_FLOOR` tokens (at most the budget). One long pack of many short rows is
slow under cuDNN's packed attention (its cost grows with the pack length, not with the real
tokens: on one H200, SmolLM2-135M, 256 rows of 68 tokens, forward + backward: one pack of 32,768
tokens 0.313 s, 3 packs of 8,192 0.127 s, 9 packs of 2,048 0.081 s, padded `[256, 192]` 0.132 s),
so short rows go into several short packs per device, not one long one.

`C`, `P` (packs per device per micro-batch), the number of micro-batches and the rows per pack
`R` are rounded up to a few sizes (powers of two, `P` also 3 * 2^k; `C` and `P` may also be
their cap) so the compiled steps see few shapes; empty micro-batches are skipped on device
(`_step`). Per-token row fields (response_mask, advantages, ...) travel as
`[n_micro, dp * P * R, t]` rows with
`token_index` (the position in its pack of the hidden state that predicts each response token),
so the losses run on rows exactly as in the padded path. The plan is a pure function of the
lengths: every host computes the same one.

The two switches pick the planner and the layout:
- both (`pack_batch`, `plan_packs`): the packs above, `P * C` at most `budget` tokens;
- `use_remove_padding` alone (`pack_batch(rows_per_device=...)`, `plan_rows`): micro-batches keep
  their row count (`ppo_micro_batch_size_per_device` rows per device, balanced over the
  micro-batches by tokens), each device's rows in `P` packs of `C`, `P * C` at most the padded
  micro-batch's tokens;
- `use_dynamic_bsz` alone (`slot_batch`): the token-budget plan, but every row stays a padded
  `[p + t]` row in its slot: micro-batches `[n_micro, dp * R, p + t]`, empty slots hold a one-token
  dummy row (`row_valid` 0), as verl pads without remove_padding (one "pack" per device: `P` 1,
  `C` the budget).

This module is numpy only; the jitted gathers are in `_roles` / `_step`.
"""
from __future__ import annotations

import dataclasses
import heapq

import numpy as np


def balanced_partition(weights, k: int) -> list[list[int]]:
    """Indices of `weights` split into `k` lists with about equal sums: Karmarkar-Karp's largest
    differencing method for k-way partitions. Deterministic (ties by index); lists sorted."""
    w = [int(x) for x in weights]
    if k <= 1:
        return [list(range(len(w)))]
    heap, counter = [], 0
    for i in sorted(range(len(w)), key=lambda j: (-w[j], j)):
        parts = [(w[i], [i])] + [(0, []) for _ in range(k - 1)]
        heapq.heappush(heap, (-w[i], counter, parts))
        counter += 1
    while len(heap) > 1:
        _, _, a = heapq.heappop(heap)
        _, _, b = heapq.heappop(heap)
        # the largest subset of one with the smallest of the other: the spreads cancel
        merged = [(sa + sb, ia + ib) for (sa, ia), (sb, ib) in zip(a, reversed(b))]
        merged.sort(key=lambda s: (-s[0], min(s[1], default=len(w))))
        heapq.heappush(heap, (-(merged[0][0] - merged[-1][0]), counter, merged))
        counter += 1
    parts = heap[0][2] if heap else [(0, [])] * k
    return [sorted(ix) for _, ix in parts]


def pack_rows(lengths, budget: int) -> list[list[int]]:
    """First-fit decreasing: rows (indices into `lengths`) into packs of at most `budget` tokens.
    Deterministic; the first pack is the fullest."""
    packs, room = [], []
    for i in sorted(range(len(lengths)), key=lambda j: (-int(lengths[j]), j)):
        n = int(lengths[i])
        for p, r in enumerate(room):
            if n <= r:
                packs[p].append(i)
                room[p] -= n
                break
        else:
            packs.append([i])
            room.append(budget - n)
    return packs


# The shortest pack cap (`pack_cap`): short rows go into packs of this many tokens, not longer
# (the module docstring gives the H200 measurement behind it).
PACK_LENGTH_FLOOR = 2048


def pack_length_bucket(n: int, budget: int) -> int:
    """The pack length that holds `n` tokens: the smallest of 128 * 2^k (below the budget) and
    the budget itself, so a run compiles at most ~log2(budget / 128) + 1 pack lengths."""
    size = 128
    while size < n and size < budget:
        size *= 2
    return min(size, budget)


def pack_cap(longest_row: int, budget: int) -> int:
    """The most tokens a pack holds: the smallest power of two >= the longest row and >=
    `PACK_LENGTH_FLOOR`, at most `budget`."""
    return min(_pow2(max(int(longest_row), PACK_LENGTH_FLOOR, 1)), int(budget))


def _pow2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


def packs_bucket(n: int, most: int) -> int:
    """`n` packs rounded up to the next of 1, 2, 3, 4, 6, 8, 12, 16, 24, ... (2^k and 3 * 2^k),
    or `most` when that is smaller (`n` <= `most`). Every pack slot costs its full length in
    the matmuls, empty or not, so the steps are finer than powers of two (which waste up to
    half the packs: 9 -> 16); a run still sees few values (~2 log2(most))."""
    up = _pow2(n)
    return min(up * 3 // 4 if up >= 4 and up * 3 // 4 >= n else up, most)


@dataclasses.dataclass(frozen=True)
class PackPlan:
    """Where every row of a batch goes. Per-row arrays are int64[b]."""

    dp: int
    n_micro: int  # micro-batches, a power of two with a token budget (the last ones may be empty)
    packs_per_device: int  # P, packs per device per micro-batch: `packs_bucket`ed
    pack_len: int  # C, tokens per pack: bucketed
    rows_per_pack: int  # R, row slots per pack: a power of two
    micro: np.ndarray  # the row's micro-batch
    shard: np.ndarray  # its data-parallel shard (device slot of the micro-batch)
    pack: np.ndarray  # its pack among the shard's P packs of the micro-batch
    slot: np.ndarray  # its place among the pack's R row slots (segment id - 1)
    offset: np.ndarray  # its first token in the pack
    length: np.ndarray  # its real tokens

    @property
    def sequence(self) -> np.ndarray:
        """The row's pack among the micro-batch's `dp * P` sequences."""
        return self.shard * self.packs_per_device + self.pack

    @property
    def dest(self) -> np.ndarray:
        """The row's index in the flattened `[n_micro * dp * P * R]` row slots."""
        return (self.micro * self.dp * self.packs_per_device + self.sequence) * self.rows_per_pack + self.slot

    def shapes(self) -> tuple[int, int, int, int]:
        """(n_micro, P, C, R): what the compiled steps see (sequences `[dp * P, C]`)."""
        return self.n_micro, self.packs_per_device, self.pack_len, self.rows_per_pack


def spread_rows(lengths, packs: list[list[int]], P: int, cap: int) -> list[list[int]]:
    """The rows of `packs` (one device's micro-batch, at most `P` packs of at most `cap` tokens)
    spread over exactly `P` packs: longest row first into the pack with the fewest tokens (then
    rows) that has room, so the packs' row counts and lengths even out and the most rows in one
    pack (`R`, the cuDNN bound) is as small as the batch allows. Deterministic; when a row finds
    no room (packs near full), the given packs are kept."""
    rows = sorted((r for pk in packs for r in pk), key=lambda r: (-int(lengths[r]), r))
    heap = [(0, 0, i) for i in range(P)]  # (tokens, rows, pack)
    out = [[] for _ in range(P)]
    for r in rows:
        n = int(lengths[r])
        skipped = []
        while heap and heap[0][0] + n > cap:
            skipped.append(heapq.heappop(heap))
        if not heap:
            return [list(pk) for pk in packs] + [[] for _ in range(P - len(packs))]
        tokens, count, i = heapq.heappop(heap)
        out[i].append(r)
        heapq.heappush(heap, (tokens + n, count + 1, i))
        for x in skipped:
            heapq.heappush(heap, x)
    return out


def _spread_all(lengths, packs_of_shard, P: int, cap: int):
    """Each shard's packs, `P` per micro-batch (pack `j` in micro-batch `j // P`), spread over
    the micro-batch's `P` packs (`spread_rows`)."""
    return [[pk for i in range(0, len(packs), P) for pk in spread_rows(lengths, packs[i:i + P], P, cap)]
            for packs in packs_of_shard]


def _place(lengths, packs_of_shard, P: int):
    """Rows' (micro, pack, slot, offset) from each shard's packs (lists of row indices): pack `j`
    of a shard is pack `j % P` of micro-batch `j // P`. Also the longest pack and most rows."""
    b = len(lengths)
    micro, shard, pack, slot, offset = (np.zeros(b, np.int64) for _ in range(5))
    longest, most_rows = 1, 1
    for d, packs in enumerate(packs_of_shard):
        for j, members in enumerate(packs):
            starts = np.cumsum([0] + [int(lengths[r]) for r in members])
            longest, most_rows = max(longest, int(starts[-1])), max(most_rows, len(members))
            for s, r in enumerate(members):
                micro[r], shard[r], pack[r], slot[r], offset[r] = j // P, d, j % P, s, starts[s]
    return micro, shard, pack, slot, offset, longest, most_rows


def plan_packs(lengths, budget: int, dp: int, *, field: str, capped: bool = True) -> PackPlan:
    """Rows of `lengths` real tokens -> balanced shards -> packs of at most `pack_cap` tokens ->
    micro-batches of `P` packs per device, `P * C` <= `budget`. `capped` False: packs of up to
    `budget` tokens, one per device per micro-batch (`slot_batch`). `field` names the budget's
    config field in the error a too-long row raises."""
    lengths = np.asarray(lengths, np.int64)
    if budget <= 0:
        raise ValueError(f"{field} must be > 0, got {budget}")
    if lengths.size and lengths.max() > budget:
        i = int(lengths.argmax())
        raise ValueError(f"row {i} has {int(lengths[i])} tokens (prompt + response), more than "
                         f"{field}={budget}: raise {field} to at least {int(lengths.max())}")
    cap = pack_cap(lengths.max(initial=1), budget) if capped else budget
    shards = balanced_partition(lengths, dp)
    packs = [[[rows[j] for j in pk] for pk in pack_rows(lengths[rows], cap)] for rows in shards]
    k = max([len(p) for p in packs] + [1])  # packs on the busiest shard
    most = max(budget // cap, 1)  # packs per device per micro-batch within the budget
    n = -(-k // most)
    P = packs_bucket(-(-k // n), most)
    if capped:
        packs = _spread_all(lengths, packs, P, cap)
    micro, shard, pack, slot, offset, longest, most_rows = _place(lengths, packs, P)
    return PackPlan(dp=dp, n_micro=_pow2(n), packs_per_device=P, pack_len=pack_length_bucket(longest, cap),
                    rows_per_pack=_pow2(most_rows), micro=micro, shard=shard, pack=pack, slot=slot,
                    offset=offset, length=lengths)


def _row_groups(lengths, per: int) -> list[list[int]]:
    """Rows into groups of exactly `per` rows balanced by tokens: longest row first into the
    lightest group with room (deterministic)."""
    heap = [(0, g, 0) for g in range(len(lengths) // per)]  # (tokens, group, rows)
    groups = [[] for _ in heap]
    for r in sorted(range(len(lengths)), key=lambda j: (-int(lengths[j]), j)):
        tokens, g, rows = heapq.heappop(heap)
        groups[g].append(r)
        if rows + 1 < per:
            heapq.heappush(heap, (tokens + int(lengths[r]), g, rows + 1))
    return groups


def plan_rows(lengths, rows_per_device: int, dp: int, cap: int) -> PackPlan:
    """Micro-batches of a fixed row count (`use_remove_padding` without a token budget): the
    `len(lengths)` rows into groups of exactly `rows_per_device` rows, `dp` groups per
    micro-batch, balanced by tokens; each group into `P` packs of `C` tokens (first-fit
    decreasing; `C` from `pack_cap`, raised while the packs would exceed `cap`). `cap`: the most
    tokens per device per micro-batch (`P * C`; the padded micro-batch's tokens)."""
    lengths = np.asarray(lengths, np.int64)
    b, per = len(lengths), int(rows_per_device)
    if per <= 0 or b % (per * dp):
        raise ValueError(f"{b} rows do not split into micro-batches of {per} rows on each of {dp} devices")
    groups = _row_groups(lengths, per)
    size = pack_cap(lengths.max(initial=1), cap)
    while True:
        packs = [[[g[j] for j in pk] for pk in pack_rows(lengths[g], size)] for g in groups]
        k = max([len(p) for p in packs] + [1])
        if k <= cap // size or size >= cap:
            break
        size = min(size * 2, cap)
    P = packs_bucket(k, max(cap // size, k))  # (k > cap // size only if `cap` is under a group's tokens)
    # micro-batch i holds groups i*dp .. i*dp + dp - 1: list each shard's packs in micro order
    by_shard = [[pk for i in range(d, len(groups), dp) for pk in spread_rows(lengths, packs[i], P, size)]
                for d in range(dp)]
    micro, shard, pack, slot, offset, longest, most_rows = _place(lengths, by_shard, P)
    return PackPlan(dp=dp, n_micro=b // (per * dp), packs_per_device=P,
                    pack_len=pack_length_bucket(longest, size), rows_per_pack=_pow2(most_rows),
                    micro=micro, shard=shard, pack=pack, slot=slot, offset=offset, length=lengths)


def row_runs(attention_mask: np.ndarray, response_len: int):
    """Per row: start of its real run, prompt tokens, response tokens (int64[b] each)."""
    m = np.asarray(attention_mask) != 0
    start = m.argmax(axis=1)
    prompt = m[:, :m.shape[1] - response_len].sum(axis=1)
    response = m[:, m.shape[1] - response_len:].sum(axis=1)
    return start.astype(np.int64), prompt.astype(np.int64), response.astype(np.int64)


def _scatter(plan: PackPlan, v: np.ndarray) -> np.ndarray:
    """[b, ...] per row -> [n_micro, dp * P * R, ...] per row slot (zeros in empty slots)."""
    n, P, _, R = plan.shapes()
    slots = np.zeros((n * plan.dp * P * R, *v.shape[1:]), v.dtype)
    slots[plan.dest] = v
    return slots.reshape(n, plan.dp * P * R, *v.shape[1:])


def pack_batch(arrays: dict[str, np.ndarray], response_len: int, budget: int, dp: int, *,
               field: str, row_keys=(), rows_per_device: int = 0,
               token_keys=()) -> tuple[PackPlan, dict[str, np.ndarray]]:
    """Padded rows -> (plan, packed micro-batches).

    `rows_per_device` 0: at most `budget` tokens per device per micro-batch (`plan_packs`, the
    error names `field`); > 0: micro-batches of that many rows per device, in packs of at most
    `budget` tokens per device (`plan_rows`; pass the padded micro-batch's tokens).

    `arrays` holds `input_ids`, `attention_mask`, `position_ids` [b, p + t] (one contiguous run
    per row) and the row fields `row_keys` ([b, ...]). Returns `input_ids`, `attention_mask`
    (segment ids), `position_ids` [n_micro, dp * P, C]; `token_index` (the position in its pack
    predicting each response token), `token_valid` [n_micro, dp * P * R, t]; `row_valid`
    [n_micro, dp * P * R]; and every row field as [n_micro, dp * P * R, ...] (zeros in empty
    slots). `token_keys`: more per-token fields [b, p + t, ...] (router replay's
    `routed_experts`), packed like `input_ids` into [n_micro, dp * P, C, ...] (-1 at pack
    padding)."""
    ids, mask, pos = (np.asarray(arrays[k]) for k in ("input_ids", "attention_mask", "position_ids"))
    start, prompt, response = row_runs(mask, response_len)
    bad = np.nonzero((prompt == 0) & (response > 0))[0]
    if bad.size:
        raise ValueError(f"row {int(bad[0])} has response tokens but no prompt token: packing needs "
                         "a real token before the first response token (the one that predicts it)")
    if rows_per_device:
        plan = plan_rows(prompt + response, rows_per_device, dp, budget)
    else:
        plan = plan_packs(prompt + response, budget, dp, field=field)
    n, P, C, _ = plan.shapes()
    seq = {k: np.zeros((n, dp * P, C), np.int32) for k in ("input_ids", "attention_mask", "position_ids")}
    tokens = {k: np.asarray(arrays[k]) for k in token_keys}
    seq.update({k: np.full((n, dp * P, C, *v.shape[2:]), -1, v.dtype) for k, v in tokens.items()})
    sequence = plan.sequence
    for r in range(len(start)):
        s, ln = int(start[r]), int(plan.length[r])
        at = (plan.micro[r], sequence[r], slice(plan.offset[r], plan.offset[r] + ln))
        seq["input_ids"][at] = ids[r, s:s + ln]
        seq["position_ids"][at] = pos[r, s:s + ln]
        seq["attention_mask"][at] = plan.slot[r] + 1
        for k, v in tokens.items():
            seq[k][at] = v[r, s:s + ln]
    j = np.arange(response_len)[None, :]
    valid = j < response[:, None]
    index = np.where(valid, (plan.offset + prompt - 1)[:, None] + j, 0)
    fields = {"token_index": index.astype(np.int32), "token_valid": valid.astype(np.int32),
              "row_valid": np.ones(len(start), np.int32)}
    fields.update({k: np.asarray(arrays[k]) for k in row_keys})
    out = dict(seq)
    out.update({k: _scatter(plan, v) for k, v in fields.items()})
    return plan, out


def slot_batch(arrays: dict[str, np.ndarray], response_len: int, budget: int, dp: int, *,
               field: str) -> tuple[PackPlan, dict[str, np.ndarray]]:
    """Padded rows -> (plan, token-budget micro-batches of padded rows): `use_dynamic_bsz`
    without `use_remove_padding`. Rows go where `plan_packs` puts them (at most `budget` real
    tokens per device per micro-batch) but keep their padded `[p + t]` layout: every key of
    `arrays` as [n_micro, dp * R, ...] plus `row_valid`. An empty slot holds a dummy row with one
    real token (the last prompt column), so every attention path sees an ordinary row; its
    response_mask is 0 and `row_valid` 0, so no loss or denominator counts it."""
    mask = np.asarray(arrays["attention_mask"])
    _, prompt, response = row_runs(mask, response_len)
    plan = plan_packs(prompt + response, budget, dp, field=field, capped=False)
    out = {k: _scatter(plan, np.asarray(v)) for k, v in arrays.items()}
    out["row_valid"] = _scatter(plan, np.ones(len(mask), np.int32))
    empty = out["row_valid"] == 0
    out["attention_mask"][..., max(mask.shape[1] - response_len - 1, 0)] |= empty.astype(mask.dtype)
    return plan, out


def unpack_rows(plan: PackPlan, x: np.ndarray) -> np.ndarray:
    """[n_micro, dp * P * R, ...] per-slot outputs -> [b, ...] in the batch's row order."""
    n, P, _, R = plan.shapes()
    flat = np.asarray(x).reshape(n * plan.dp * P * R, *x.shape[2:])
    return flat[plan.dest]
