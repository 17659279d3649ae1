"""DAPO extras: overlong-reward shaping and the dynamic-sampling group filter.

Both are pure array functions; the trainer decides when to call them (the filter returns a
row mask, and gathering the kept rows into a new batch is host-side data plumbing).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxrl_llm.algos import _masked as M


@functools.partial(jax.jit, static_argnames=(
    "max_response_length", "overlong_buffer_len", "overlong_penalty_factor"))
def overlong_penalty(response_length, max_response_length, overlong_buffer_len,
                     overlong_penalty_factor=1.0):
    """DAPO soft overlong punishment, added to each sequence's score. response_length: [b].

    expected = max_response_length - overlong_buffer_len;
    penalty = min(-(length - expected) / overlong_buffer_len * factor, 0)
    (0 up to ``expected`` tokens, falling linearly to ``-factor`` at ``max_response_length``).
    Config: ``reward.overlong_buffer.{enable, len, penalty_factor}`` (verl: ``reward_model.``).
    """
    if overlong_buffer_len <= 0:
        raise ValueError(f"overlong_buffer.len must be > 0, got {overlong_buffer_len}.")
    length = jnp.asarray(response_length, jnp.float32)
    exceed = length - (max_response_length - overlong_buffer_len)
    return jnp.minimum(-exceed / overlong_buffer_len * overlong_penalty_factor, 0.0)


@jax.jit
def sequence_scores_to_token_level(scores, response_mask):
    """Puts each row's scalar score on its last response token (verl's reward layout).

    scores [b], response_mask [b, t] -> token_level_scores [b, t]; empty rows get zeros.
    """
    mask = response_mask != 0
    t = mask.shape[-1]
    last = t - 1 - jnp.argmax(jnp.flip(mask, -1), axis=-1)
    on_last = (jnp.arange(t) == last[:, None]) & mask.any(-1, keepdims=True)
    scores = jnp.asarray(scores)
    return jnp.where(on_last, scores[:, None], jnp.zeros((), scores.dtype))  # +0.0 elsewhere


@jax.jit
def dynamic_sampling_keep_mask(metric, group_ids):
    """DAPO dynamic sampling: keep groups whose metric is not constant (std > 0), and groups
    of one (verl keeps those too). metric [b] (e.g. ``seq_final_reward``, ``acc``),
    group_ids int[b] -> bool[b] row mask.

    "std > 0" is tested exactly as max != min, so float rounding in a mean cannot make a
    constant group look varied.
    """
    idx = M.group_index(group_ids)
    varied = M.group_max(metric, idx) != M.group_min(metric, idx)
    return varied | (M.group_count(idx) == 1)
