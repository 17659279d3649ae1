"""Token sampling: greedy, temperature, top-k, top-p, with explicit PRNG keys and log-probs.

Every argument that a user may change between calls (temperature, top-k, top-p) is a traced
per-row array, so changing them never recompiles. The log-prob of a sampled token is the
trainer's definition: log-softmax of `logits / temperature` *before* top-k/top-p filtering, and of
the unscaled logits when `temperature == 0` (greedy).
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

_NEG_INF = -jnp.inf


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to pick the next token.

    temperature: 0 means greedy (argmax); otherwise logits are divided by it.
    top_k: keep the k most likely tokens; -1 (or 0) keeps all.
    top_p: keep the smallest set of most likely tokens whose probability reaches top_p (after
      top-k); 1.0 keeps all.
    """

    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0

    def __post_init__(self):
        t, k, p = self.temperature, self.top_k, self.top_p
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise ValueError(f"SamplingParams.temperature must be a finite number >= 0 (0 = greedy), "
                             f"got {t!r}")
        if isinstance(k, bool) or not isinstance(k, int) or k < -1:
            raise ValueError(f"SamplingParams.top_k must be an int >= 1, or -1/0 to disable, got {k!r}")
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not (0.0 < p <= 1.0):
            raise ValueError(f"SamplingParams.top_p must be a number in (0, 1], got {p!r}")
        object.__setattr__(self, "temperature", float(t))
        object.__setattr__(self, "top_p", float(p))

    @classmethod
    def from_config(cls, section) -> "SamplingParams":
        """From any settings object with `temperature, top_k, top_p` (a run config's `rollout`
        or `rollout.val` section)."""
        return cls(temperature=section.temperature, top_k=section.top_k, top_p=section.top_p)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _filter_mask(scaled, top_k, top_p):
    """bool[b, v]: tokens that survive top-k then top-p. scaled f32[b, v]; top_k int32[b]; top_p f32[b]."""
    v = scaled.shape[-1]
    sorted_desc = -jnp.sort(-scaled, axis=-1)  # [b, v]
    rank = jnp.arange(v, dtype=jnp.int32)[None, :]
    k = jnp.where(top_k > 0, jnp.minimum(top_k, v), v)[:, None]
    in_k = rank < k
    kept_logits = jnp.where(in_k, sorted_desc, _NEG_INF)
    probs = jax.nn.softmax(kept_logits, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # probability mass of strictly better tokens
    keep_sorted = in_k & ((before < top_p[:, None]) | (rank == 0))
    n_keep = jnp.sum(keep_sorted, axis=-1)  # >= 1
    threshold = jnp.take_along_axis(sorted_desc, (n_keep - 1)[:, None], axis=-1)
    return scaled >= threshold


def sample(logits, keys, temperature, top_k, top_p):
    """Samples one token per row.

    Args:
      logits: f32[b, v].
      keys: typed PRNG keys [b] (one per row; rows never share randomness).
      temperature: f32[b] (0 = greedy); top_k: int32[b] (<= 0 = off); top_p: f32[b] (1 = off).
    Returns:
      (tokens int32[b], log_probs f32[b]) with log_probs as the module docstring defines.
    """
    logits = logits.astype(jnp.float32)
    greedy = temperature <= 0.0
    scaled = logits / jnp.where(greedy, 1.0, temperature)[:, None]
    log_probs_all = jax.nn.log_softmax(scaled, axis=-1)
    needs_filter = jnp.any(((top_k > 0) & (top_k < logits.shape[-1])) | (top_p < 1.0))
    keep = jax.lax.cond(needs_filter, _filter_mask, lambda s, k, p: jnp.ones(s.shape, jnp.bool_),
                        scaled, top_k, top_p)
    filtered = jnp.where(keep, scaled, _NEG_INF)
    sampled = jax.vmap(lambda key, row: jax.random.categorical(key, row))(keys, filtered)
    tokens = jnp.where(greedy, jnp.argmax(logits, axis=-1), sampled).astype(jnp.int32)
    log_probs = jnp.take_along_axis(log_probs_all, tokens[:, None], axis=-1)[:, 0]
    return tokens, log_probs
