"""Host-side batch assembly: prompts + rollouts -> a `data.Batch` of verl's fields, rewards
placement, advantages. Pure numpy / jitted `algos` calls; no worker state.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
import jax
import jax.numpy as jnp

from jaxrl_llm import algos
from jaxrl_llm.data import Batch, RolloutResult, collate_prompts


def rollout_batch(examples, gen: RolloutResult, *, n: int, pad_token_id: int, max_prompt_length: int) -> Batch:
    """verl's fields for b*n sequences: prompts left-padded [b*n, p], responses [b*n, t].

    Agent rollouts (`gen.prompt_ids` and `gen.response_attention_mask` set): each row keeps its
    own prompt (e.g. rendered with tool schemas); `response_mask` has holes where tool or user
    tokens sit, while the attention mask covers the whole response (one contiguous run)."""
    if gen.prompt_ids is not None:
        rows = [_Prompt(list(ids), i) for i, ids in enumerate(gen.prompt_ids)]
        prompts = collate_prompts(rows, pad_token_id, max_prompt_length)
        prompt_ids, prompt_mask = prompts["input_ids"], prompts["attention_mask"]
    else:
        prompts = collate_prompts(examples, pad_token_id, max_prompt_length)
        rep = lambda x: np.repeat(x, n, axis=0)  # noqa: E731 - prompt i's samples are rows i*n..i*n+n-1
        prompt_ids, prompt_mask = rep(prompts["input_ids"]), rep(prompts["attention_mask"])
    responses = gen.responses.astype(np.int32)
    response_mask = gen.response_mask.astype(np.int32)
    attention = gen.response_attention_mask if gen.response_attention_mask is not None else response_mask
    response_attention = np.asarray(attention, np.int32)
    attention_mask = np.concatenate([prompt_mask, response_attention], axis=1).astype(np.int32)
    position_ids = np.maximum(np.cumsum(attention_mask, axis=1) - 1, 0).astype(np.int32)
    batch = Batch(
        prompts=prompt_ids.astype(np.int32), responses=responses, response_mask=response_mask,
        input_ids=np.concatenate([prompt_ids, responses], axis=1).astype(np.int32),
        attention_mask=attention_mask, position_ids=position_ids,
        rollout_log_probs=gen.rollout_log_probs.astype(np.float32),
        group_ids=np.repeat(np.arange(len(examples), dtype=np.int32), n),
    )
    if gen.routed_experts is not None:  # actor.router_replay: the engine's experts, column for column
        batch.routed_experts = align_prompt_columns(gen.routed_experts, responses.shape[1], prompt_ids.shape[1])
    return batch


def align_prompt_columns(x: np.ndarray, t: int, p: int, fill: int = -1) -> np.ndarray:
    """A per-token array [b, P + t, ...] whose first P columns are left-padded prompts -> [b, p + t, ...]
    (prompts left-padded to p instead: `fill` columns added on the left, or padding ones dropped)."""
    width = x.shape[1] - t
    if width < p:
        pad = np.full((x.shape[0], p - width, *x.shape[2:]), fill, x.dtype)
        return np.concatenate([pad, x], axis=1)
    return x[:, width - p:]


class _Prompt(NamedTuple):
    prompt_ids: list
    index: int


def token_level_scores(scores: np.ndarray, response_mask: np.ndarray) -> np.ndarray:
    """The sequence score on each response's last valid (model) token (verl's placement), as
    host float32 [b, t]: `algos.sequence_scores_to_token_level` (right with holes in the mask)."""
    return np.asarray(algos.sequence_scores_to_token_level(
        np.asarray(scores, np.float32), np.asarray(response_mask)), np.float32)


FILTER_METRICS = ("acc", "score", "seq_reward", "seq_final_reward")


def filter_metric(name: str, batch: Batch, fields: dict[str, np.ndarray]) -> np.ndarray:
    """float[b]: the value DAPO's group filter (`algorithm.filter_groups.metric`) compares.

    `acc`: the reward function's `acc` extra, else its score (as verl's DAPO reward manager);
    `score`: the sequence score before the overlong penalty; `seq_reward`: the sum of
    `token_level_scores` (penalty included); `seq_final_reward`: the sum of the rewards the
    advantages see, which equals `seq_reward` because the filter runs before any KL penalty
    (the config refuses it with `algorithm.use_kl_in_reward`)."""
    if name == "acc":
        return np.asarray(fields.get("acc", fields["score"]), np.float32)
    if name == "score":
        return np.asarray(fields["score"], np.float32)
    if name in ("seq_reward", "seq_final_reward"):
        return batch.token_level_scores.sum(-1).astype(np.float32)
    raise ValueError(f"unknown filter_groups.metric {name!r}; use one of {FILTER_METRICS}")


def concat_batches(batches: list[Batch]) -> Batch:
    """Rows of several batches (same fields and widths) in order; `group_ids` are offset so
    that groups from different batches stay apart."""
    out, offset = [], 0
    for b in batches:
        b = b.select(np.arange(b.rows))  # a copy: the offset must not change the caller's batch
        b.group_ids = b.group_ids + offset
        offset = int(b.group_ids.max()) + 1 if len(b.group_ids) else offset
        out.append(b)
    return Batch.concat(out)


def compute_advantages(batch: Batch, *, estimator: str, gamma: float, lam: float,
                       norm_adv_by_std_in_grpo: bool) -> tuple[np.ndarray, np.ndarray]:
    """`algos.compute_advantage(estimator, ...)` on the batch's verl fields -> (advantages, returns).

    Every estimator gets the same inputs (the batch fields it may need, numpy: `grpo_passk`
    checks group sizes eagerly); a field the estimator needs and the batch lacks is an error."""
    fields = ("token_level_rewards", "response_mask", "group_ids", "values", "reward_baselines")
    adv, ret = algos.compute_advantage(
        estimator, **{k: np.asarray(batch[k]) for k in fields if k in batch}, gamma=gamma, lam=lam,
        norm_adv_by_std_in_grpo=norm_adv_by_std_in_grpo)
    adv, ret = jax.device_get((adv, ret))
    return np.asarray(adv, np.float32), np.asarray(ret, np.float32)


def kl_in_reward(batch: Batch, kl_coef: float, kl_penalty: str) -> tuple[np.ndarray, float]:
    rewards, current_kl = algos.apply_kl_penalty(
        jnp.asarray(batch["token_level_scores"]), jnp.asarray(batch["old_log_probs"]),
        jnp.asarray(batch["ref_log_prob"]), jnp.asarray(batch["response_mask"]), kl_coef, kl_penalty)
    return np.asarray(rewards, np.float32), float(current_kl)


def rollout_correction(batch: Batch, rc) -> dict[str, float]:
    """verl's rollout correction (`algorithm.rollout_correction`, a `RolloutCorrectionConfig`)
    between `old_log_probs` and `rollout_log_probs`, in place: truncated IS weights go to
    `rollout_is_weights` (the actor's policy loss multiplies by them) and rejected tokens / rows
    leave `response_mask`. Returns the `rollout_corr/*` metrics."""
    weights, mask, metrics = algos.rollout_correction(
        jnp.asarray(batch["old_log_probs"]), jnp.asarray(batch["rollout_log_probs"]),
        jnp.asarray(batch["response_mask"]),
        rollout_is=rc.rollout_is or None, rollout_is_threshold=rc.rollout_is_threshold,
        rollout_is_batch_normalize=rc.rollout_is_batch_normalize,
        rollout_rs=rc.rollout_rs or None, rollout_rs_threshold=rc.rollout_rs_threshold,
        rollout_rs_threshold_lower=rc.rollout_rs_threshold_lower or None,
        rollout_token_veto_threshold=rc.rollout_token_veto_threshold or None)
    weights, mask, metrics = jax.device_get((weights, mask, metrics))
    if weights is not None:
        batch.rollout_is_weights = np.asarray(weights, np.float32)
    batch.response_mask = np.asarray(mask, batch.response_mask.dtype)
    return {k: float(v) for k, v in metrics.items()}
