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


def _filter_threshold(scaled, top_k, top_p):
    """f32[b]: the smallest scaled logit that survives top-k then top-p (a token survives when its
    scaled logit is >= the threshold). scaled f32[b, v]; top_k int32[b]; top_p f32[b]."""
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
    return jnp.take_along_axis(sorted_desc, (n_keep - 1)[:, None], axis=-1)[:, 0]


# Vocabulary chunk of the two-level inverse-CDF draw (see `sample`).
_CHUNK = 1024


def _first_over(cdf, target, weights):
    """Per row: the first index i with cdf[i] > target, never one of zero weight (rounding can put
    target at or past the last cumulative sum: then the last index of non-zero weight)."""
    n = cdf.shape[-1]
    idx = jnp.sum((cdf <= target[:, None]).astype(jnp.int32), axis=-1)
    last = jnp.max(jnp.where(weights > 0, jnp.arange(n, dtype=jnp.int32)[None, :], 0), axis=-1)
    return jnp.minimum(idx, last)


def sample(logits, keys, temperature, top_k, top_p):
    """Samples one token per row.

    Args:
      logits: f32[b, v].
      keys: typed PRNG keys [b] (one per row; rows never share randomness).
      temperature: f32[b] (0 = greedy); top_k: int32[b] (<= 0 = off); top_p: f32[b] (1 = off).
    Returns:
      (tokens int32[b], log_probs f32[b]) with log_probs as the module docstring defines.

    The draw is inverse-CDF sampling with one uniform number per row, in two levels so that no
    [b, v] cumulative sum or per-token random number is made: the vocabulary is cut into chunks
    of `_CHUNK`; one pass over the logits gives each chunk's maximum and exp-sum (of the kept
    tokens and of all); the cumulative chunk sums pick the chunk; a cumulative sum over that one
    chunk picks the token. Greedy is the first maximum (`argmax`), found the same way. The
    log-prob is `scaled[token] - logsumexp(scaled)` from the same sums: no [b, v] log-softmax.
    """
    logits = logits.astype(jnp.float32)
    b, v = logits.shape
    greedy = temperature <= 0.0
    scaled = logits / jnp.where(greedy, 1.0, temperature)[:, None]
    needs_filter = jnp.any(((top_k > 0) & (top_k < v)) | (top_p < 1.0))
    threshold = jax.lax.cond(needs_filter, _filter_threshold,
                             lambda s, k, p: jnp.full((s.shape[0],), _NEG_INF, jnp.float32),
                             scaled, top_k, top_p)
    c = min(_CHUNK, v)
    n = -(-v // c)
    x = jnp.pad(scaled, [(0, 0), (0, n * c - v)], constant_values=_NEG_INF).reshape(b, n, c)
    chunk_max = jnp.max(x, axis=-1)  # [b, n]
    m = jnp.max(chunk_max, axis=-1)  # [b]
    e = jnp.exp(x - m[:, None, None])
    sums_all = jnp.sum(e, axis=-1)  # [b, n]
    sums_kept = jnp.sum(jnp.where(x >= threshold[:, None, None], e, 0.0), axis=-1)
    # the chunk: first whose cumulative kept mass exceeds u * total
    cdf = jnp.cumsum(sums_kept, axis=-1)
    u = jax.vmap(lambda key: jax.random.uniform(key, (), jnp.float32))(keys)
    target = u * cdf[:, -1]
    chunk = _first_over(cdf, target, sums_kept)
    below = jnp.where(chunk > 0, jnp.take_along_axis(cdf, jnp.maximum(chunk - 1, 0)[:, None], -1)[:, 0], 0.0)
    xs = jnp.take_along_axis(x, chunk[:, None, None], axis=1)[:, 0]  # [b, c]
    es = jnp.where(xs >= threshold[:, None], jnp.exp(xs - m[:, None]), 0.0)
    sampled = chunk * c + _first_over(below[:, None] + jnp.cumsum(es, axis=-1), target, es)
    # greedy: the first chunk holding the maximum, then the first maximum in it (= argmax)
    best = jnp.argmax(chunk_max, axis=-1).astype(jnp.int32)
    best_x = jnp.take_along_axis(x, best[:, None, None], axis=1)[:, 0]
    argmax = best * c + jnp.argmax(best_x, axis=-1).astype(jnp.int32)
    tokens = jnp.where(greedy, argmax, sampled).astype(jnp.int32)
    picked = jnp.take_along_axis(scaled, tokens[:, None], axis=-1)[:, 0]
    log_probs = (picked - m) - jnp.log(jnp.sum(sums_all, axis=-1))
    return tokens, log_probs
