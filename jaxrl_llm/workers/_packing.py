"""Micro-batches of packed rows (verl's `use_remove_padding`) and token-budget micro-batches
(verl's `use_dynamic_bsz`), apart or together.

A padded batch holds rows `[b, p + t]`: a left-padded prompt and a right-padded response, one
contiguous run of real tokens per row. Here the rows' real runs are concatenated into *packs*
of a bucketed length `L` with `attention_mask` holding segment ids (1, 2, ... per row of the
pack, 0 = padding) and `position_ids` restarting per row, so no compute goes to padding:

1. `balanced_partition`: rows -> data-parallel shards with about equal token sums
   (Karmarkar-Karp largest differencing, deterministic);
2. first-fit decreasing: each shard's rows -> packs of at most `budget` tokens;
3. micro-batch `i` is pack `i` of every shard: `[dp, L]`, shards with fewer packs get empty ones.

`L` (pack length), the number of micro-batches and the rows per pack `R` are rounded up to a few
sizes (`pack_length_bucket`, powers of two) so the compiled steps see few shapes; empty
micro-batches are skipped on device (`_step`). Per-token row fields (response_mask,
advantages, ...) travel as `[n_micro, dp * R, t]` rows with `token_index` (the pack position
whose hidden state predicts each response token), so the losses run on rows exactly as in the
padded path. The plan is a pure function of the lengths: every host computes the same one.

The two switches pick the planner and the layout:
- both (`pack_batch`, `plan_packs`): the packs above, each at most `budget` tokens;
- `use_remove_padding` alone (`pack_batch(rows_per_device=...)`, `plan_rows`): micro-batches keep
  their row count (`ppo_micro_batch_size_per_device` rows per device), each device's rows are one
  pack (rows balanced over the packs by tokens), `L` bucketed up to the padded micro-batch's size;
- `use_dynamic_bsz` alone (`slot_batch`): the token-budget plan, but every row stays a padded
  `[p + t]` row in its slot: micro-batches `[n_micro, dp * R, p + t]`, empty slots hold a one-token
  dummy row (`row_valid` 0), as verl pads without remove_padding.

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


def pack_length_bucket(n: int, budget: int) -> int:
    """The pack length that holds `n` tokens: the smallest of 128 * 2^k (below the budget) and
    the budget itself, so a run compiles at most ~log2(budget / 128) + 1 pack lengths."""
    size = 128
    while size < n and size < budget:
        size *= 2
    return min(size, budget)


def _pow2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


@dataclasses.dataclass(frozen=True)
class PackPlan:
    """Where every row of a batch goes. Per-row arrays are int64[b]."""

    dp: int
    n_micro: int  # micro-batches, a power of two (the last ones may be empty)
    pack_len: int  # L, bucketed
    rows_per_pack: int  # R, a power of two
    micro: np.ndarray  # the row's micro-batch
    shard: np.ndarray  # its data-parallel shard (device slot of the micro-batch)
    slot: np.ndarray  # its place among the pack's R row slots (segment id - 1)
    offset: np.ndarray  # its first token in the pack
    length: np.ndarray  # its real tokens

    @property
    def dest(self) -> np.ndarray:
        """The row's index in the flattened `[n_micro * dp * R]` row slots."""
        return (self.micro * self.dp + self.shard) * self.rows_per_pack + self.slot

    def shapes(self) -> tuple[int, int, int]:
        """(n_micro, L, R): what the compiled steps see."""
        return self.n_micro, self.pack_len, self.rows_per_pack


def plan_packs(lengths, budget: int, dp: int, *, field: str) -> PackPlan:
    """Rows of `lengths` real tokens -> balanced shards -> packs of <= `budget` tokens.
    `field` names the budget's config field in the error a too-long row raises."""
    lengths = np.asarray(lengths, np.int64)
    if budget <= 0:
        raise ValueError(f"{field} must be > 0, got {budget}")
    if lengths.size and lengths.max() > budget:
        i = int(lengths.argmax())
        raise ValueError(f"row {i} has {int(lengths[i])} tokens (prompt + response), more than "
                         f"{field}={budget}: raise {field} to at least {int(lengths.max())}")
    b = len(lengths)
    micro, shard, slot, offset = (np.zeros(b, np.int64) for _ in range(4))
    n_packs, longest, most_rows = 1, 1, 1
    for d, rows in enumerate(balanced_partition(lengths, dp)):
        packs = pack_rows(lengths[rows], budget)
        n_packs = max(n_packs, len(packs))
        for m, pack in enumerate(packs):
            members = [rows[j] for j in pack]
            starts = np.cumsum([0] + [int(lengths[r]) for r in members])
            longest = max(longest, int(starts[-1]))
            most_rows = max(most_rows, len(members))
            for s, r in enumerate(members):
                micro[r], shard[r], slot[r], offset[r] = m, d, s, starts[s]
    return PackPlan(dp=dp, n_micro=_pow2(n_packs), pack_len=pack_length_bucket(longest, budget),
                    rows_per_pack=_pow2(most_rows), micro=micro, shard=shard, slot=slot,
                    offset=offset, length=lengths)


def plan_rows(lengths, rows_per_device: int, dp: int, cap: int) -> PackPlan:
    """Micro-batches of a fixed row count (`use_remove_padding` without a token budget): the
    `len(lengths)` rows into groups of exactly `rows_per_device` rows, `dp` groups (one pack per
    device) per micro-batch, balanced by tokens (longest row first into the lightest group with
    room; deterministic). `cap`: the largest pack length (the padded micro-batch's tokens)."""
    lengths = np.asarray(lengths, np.int64)
    b, per = len(lengths), int(rows_per_device)
    if per <= 0 or b % (per * dp):
        raise ValueError(f"{b} rows do not split into micro-batches of {per} rows on each of {dp} devices")
    heap = [(0, g, 0) for g in range(b // per)]  # (tokens, group, rows)
    group, slot, offset = (np.zeros(b, np.int64) for _ in range(3))
    for r in sorted(range(b), key=lambda j: (-int(lengths[j]), j)):
        tokens, g, rows = heapq.heappop(heap)
        group[r], slot[r], offset[r] = g, rows, tokens
        if rows + 1 < per:
            heapq.heappush(heap, (tokens + int(lengths[r]), g, rows + 1))
    longest = int((offset + lengths).max(initial=1))
    return PackPlan(dp=dp, n_micro=b // (per * dp), pack_len=pack_length_bucket(longest, cap),
                    rows_per_pack=per, micro=group // dp, shard=group % dp, slot=slot,
                    offset=offset, length=lengths)


def row_runs(attention_mask: np.ndarray, response_len: int):
    """Per row: start of its real run, prompt tokens, response tokens (int64[b] each)."""
    m = np.asarray(attention_mask) != 0
    start = m.argmax(axis=1)
    prompt = m[:, :m.shape[1] - response_len].sum(axis=1)
    response = m[:, m.shape[1] - response_len:].sum(axis=1)
    return start.astype(np.int64), prompt.astype(np.int64), response.astype(np.int64)


def _scatter(plan: PackPlan, v: np.ndarray) -> np.ndarray:
    """[b, ...] per row -> [n_micro, dp * R, ...] per row slot (zeros in empty slots)."""
    n, _, R = plan.shapes()
    slots = np.zeros((n * plan.dp * R, *v.shape[1:]), v.dtype)
    slots[plan.dest] = v
    return slots.reshape(n, plan.dp * R, *v.shape[1:])


def pack_batch(arrays: dict[str, np.ndarray], response_len: int, budget: int, dp: int, *,
               field: str, row_keys=(), rows_per_device: int = 0,
               token_keys=()) -> tuple[PackPlan, dict[str, np.ndarray]]:
    """Padded rows -> (plan, packed micro-batches).

    `rows_per_device` 0: packs of at most `budget` tokens (`plan_packs`, the error names `field`);
    > 0: micro-batches of that many rows per device, one pack each of at most `budget` tokens
    (`plan_rows`; pass the padded micro-batch's tokens).

    `arrays` holds `input_ids`, `attention_mask`, `position_ids` [b, p + t] (one contiguous run
    per row) and the row fields `row_keys` ([b, ...]). Returns `input_ids`, `attention_mask`
    (segment ids), `position_ids` [n_micro, dp, L]; `token_index` (pack position predicting each
    response token), `token_valid` [n_micro, dp * R, t]; `row_valid` [n_micro, dp * R]; and every
    row field as [n_micro, dp * R, ...] (zeros in empty slots). `token_keys`: more per-token fields
    [b, p + t, ...] (router replay's `routed_experts`), packed like `input_ids` into
    [n_micro, dp, L, ...] (-1 at pack padding)."""
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
    n, L, R = plan.shapes()
    seq = {k: np.zeros((n, dp, L), np.int32) for k in ("input_ids", "attention_mask", "position_ids")}
    tokens = {k: np.asarray(arrays[k]) for k in token_keys}
    seq.update({k: np.full((n, dp, L, *v.shape[2:]), -1, v.dtype) for k, v in tokens.items()})
    for r in range(len(start)):
        s, ln = int(start[r]), int(plan.length[r])
        at = (plan.micro[r], plan.shard[r], slice(plan.offset[r], plan.offset[r] + ln))
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
    plan = plan_packs(prompt + response, budget, dp, field=field)
    out = {k: _scatter(plan, np.asarray(v)) for k, v in arrays.items()}
    out["row_valid"] = _scatter(plan, np.ones(len(mask), np.int32))
    empty = out["row_valid"] == 0
    out["attention_mask"][..., max(mask.shape[1] - response_len - 1, 0)] |= empty.astype(mask.dtype)
    return plan, out


def unpack_rows(plan: PackPlan, x: np.ndarray) -> np.ndarray:
    """[n_micro, dp * R, ...] per-slot outputs -> [b, ...] in the batch's row order."""
    flat = np.asarray(x).reshape(plan.n_micro * plan.dp * plan.rows_per_pack, *x.shape[2:])
    return flat[plan.dest]
