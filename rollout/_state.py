"""The pytrees the engine passes around: prefixes, the decode state and per-step results.

Kept apart from the engine so the JetStream adapter and the RL driver can name them without the
engine's machinery. Layouts mirror JetStream's (`ResultTokens.data` is [slots, 3 * samples] with
token, validity and length columns) so the adapter converts without copying.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from jaxrl_llm.models import KVCache


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Prefix:
    """Prefilled prompts, ready to insert into decode slots.

    cache: KVCache holding the first `lengths[i]` tokens of prompt i (all but its last token), in
      the engine's layer layout: [layers, p, bucket, kv_heads, head_dim] (stacked) or a tuple of
      `layers` arrays [p, bucket, kv_heads, head_dim] (per layer);
    lengths: int32[p] tokens in the cache (prompt length - 1);
    tokens: int32[p] each prompt's last token, fed by the first `generate` after `insert` (which
      therefore returns the first generated token, as JetStream 0.2.2 expects);
    experts: None, or with the engine's `record_experts` (router replay) the experts every layer
      chose for the cached tokens, int8/int16 [p, bucket, layers, k] (-1 past `lengths`).
    """

    cache: KVCache
    lengths: jax.Array
    tokens: jax.Array
    experts: Any = None


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DecodeState:
    """Everything a generate step transforms. Per-slot fields are [slots].

    cache: KVCache [layers, slots, max_target_length, kv_heads, head_dim] (stacked layout) or a
    tuple of `layers` arrays [slots, max_target_length, kv_heads, head_dim] each for K and V (per
    layer: every layer's buffer is donated and updated in place by a decode step);
    tokens: int32 the token each slot feeds next; lengths: int32 tokens already in the cache (the
    next write index and position); generated: int32 tokens sampled so far; max_new: int32 the
    slot's generation budget; active: bool; row: int32 the driver's output row (JetStream: a
    request counter); keys: typed PRNG key per slot (step t uses fold_in(key, t));
    temperature f32 / top_k int32 / top_p f32: the slot's sampling parameters.
    """

    cache: KVCache
    tokens: jax.Array
    lengths: jax.Array
    generated: jax.Array
    max_new: jax.Array
    active: jax.Array
    row: jax.Array
    keys: jax.Array
    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array


@dataclasses.dataclass
class SlotData:
    """One slot's view of a `ResultTokens`: tokens/valid [samples, 1], lengths [samples]."""

    tokens: Any
    valid: Any
    lengths: Any
    log_prob: Any = None


@dataclasses.dataclass
class ResultTokens:
    """The tokens of one generate step for every slot, in JetStream's layout.

    data: int32[slots * samples_per_slot, 3]: column 0 the sampled token, 1 whether it is valid
    (the slot was active), 2 the number of tokens the slot has generated including this one.
    log_prob: f32[slots * samples_per_slot, 1], log-prob of each sampled token (newer JetStream).
    """

    data: Any
    log_prob: Any = None
    tokens_idx: tuple[int, int] = (0, 1)
    valid_idx: tuple[int, int] = (1, 2)
    length_idx: tuple[int, int] = (2, 3)
    samples_per_slot: int = 1

    def copy_to_host_async(self) -> None:
        for x in (self.data, self.log_prob):
            if isinstance(x, jax.Array):
                x.copy_to_host_async()

    def convert_to_numpy(self) -> "ResultTokens":
        return dataclasses.replace(
            self, data=np.asarray(self.data),
            log_prob=None if self.log_prob is None else np.asarray(self.log_prob))

    def get_result_at_slot(self, slot: int) -> SlotData:
        lo, hi = slot * self.samples_per_slot, (slot + 1) * self.samples_per_slot
        d = self.data[lo:hi]
        return SlotData(
            tokens=d[:, self.tokens_idx[0]:self.tokens_idx[1]],
            valid=d[:, self.valid_idx[0]:self.valid_idx[1]],
            lengths=d[:, self.length_idx[0]:self.length_idx[1]][:, 0],
            log_prob=None if self.log_prob is None else self.log_prob[lo:hi])
