"""Where a step's old log-probs (pi_old, the batch's `old_log_probs`) come from: one policy.

Four sources, chosen per step by `old_log_prob_source`:

- `"rollout"`: bypass mode (`rollout.use_rollout_log_probs`, verl's
  `algorithm.rollout_correction.bypass_mode`): the engine's log-probs of the sampled tokens are
  pi_old; no pass runs. Any engine/trainer mismatch (bf16 serving, stale weights in the async
  modes) enters the PPO ratio of every mini-batch.
- `"pass"`: `HostWorker.compute_old_log_prob`, an actor forward over the batch with the weights
  the update starts from, plus the engine/trainer mismatch metrics.
- `"engine"`: the pass with `actor.old_log_prob_pass='engine'`,
  `HostWorker.compute_engine_log_prob`: the rollout engine's own programs replaying each
  response with those weights (what the engine computes, bit for bit), plus the same metrics.
  pi_old is then the engine's, so the update reads it in every mini-batch.
- `"update"`: no pass, because nothing would read its result. The actor update is told its data
  is on-policy (`update_actor(on_policy=True)`), so its first mini-batch takes pi_old from its own
  forward under stop_gradient and never reads `old_log_probs`. When that first mini-batch is the
  only optimizer step (ppo_epochs 1, one mini-batch) and nothing before the update reads
  `old_log_probs` (KL in the reward, rollout correction), the pass's result is never used: the
  weights and the update's metrics are the same without it. The batch then carries NaN as
  `old_log_probs`, so a reader this policy forgot would fail loudly instead of training on a
  stand-in. What is lost: the pass's own diagnostics (`rollout/logprob_abs_diff/*`,
  `rollout/probs_diff/*`, `actor/entropy_rollout`); `actor.skip_redundant_old_log_prob=False`
  keeps the pass for them.

The rollout's age does not enter the choice: the pass uses the trainer's current weights in every
trainer mode (pi_old is the policy the update starts from), and the rollout's log-probs are read
only by rollout correction, which is a reader above.
"""
from __future__ import annotations

import numpy as np

from jaxrl_llm.config import RunConfig
from jaxrl_llm.data import Batch


def old_log_prob_readers(c: RunConfig, *, rows: int, mini_rows: int) -> tuple[str, ...]:
    """What would read the old-log-prob pass's result in a step of `rows` sequences updated in
    mini-batches of `mini_rows` (empty: the pass is redundant). Bypass mode aside."""
    readers = []
    if c.algorithm.use_kl_in_reward:
        readers.append("algorithm.use_kl_in_reward (the KL penalty against the reference)")
    if c.algorithm.rollout_correction.enabled:
        readers.append("algorithm.rollout_correction (IS weights / rejection vs the engine's log-probs)")
    if c.actor.ppo_epochs > 1:
        readers.append("actor.ppo_epochs > 1 (the ratios of the later epochs)")
    if rows > mini_rows:
        readers.append("several mini-batches (the ratios of the mini-batches after the first)")
    if not c.actor.skip_redundant_old_log_prob:
        readers.append("actor.skip_redundant_old_log_prob=False (the engine/trainer mismatch metrics)")
    return tuple(readers)


def old_log_prob_source(c: RunConfig, *, rows: int, mini_rows: int) -> str:
    """`"rollout"` (bypass mode), `"pass"` / `"engine"` (compute them with the trainer's forward /
    the engine, `actor.old_log_prob_pass`) or `"update"` (redundant: the update's own forward
    gives them); see the module docstring."""
    if c.rollout.use_rollout_log_probs:
        return "rollout"
    if not old_log_prob_readers(c, rows=rows, mini_rows=mini_rows):
        return "update"
    return "engine" if c.actor.old_log_prob_pass == "engine" else "pass"


COMPUTED = ("pass", "engine")  # the sources that run a pass (its output goes to set_old_log_probs)


def set_old_log_probs(batch: Batch, source: str, computed: dict[str, np.ndarray] | None = None) -> dict[str, float]:
    """Puts `batch.old_log_probs` from `source` (`computed`: the pass's output when it is one of
    `COMPUTED`); returns the step's metrics: `training/old_log_prob_skipped` (1 when no pass ran)
    and, after a pass, the engine/trainer mismatch metrics."""
    metrics = {"training/old_log_prob_skipped": float(source not in COMPUTED)}
    if source == "rollout":
        batch.old_log_probs = batch.rollout_log_probs
    elif source == "update":  # never read: the update takes pi_old from its own forward
        batch.old_log_probs = np.full(batch.response_mask.shape, np.nan, np.float32)
    elif source in COMPUTED:
        batch.old_log_probs = computed["old_log_probs"]
        metrics.update(mismatch_metrics(computed, batch))
    else:
        raise ValueError(f"unknown old-log-prob source {source!r}; use 'rollout', 'pass', 'engine' or 'update'")
    return metrics


def mismatch_metrics(computed: dict[str, np.ndarray], batch: Batch) -> dict[str, float]:
    """The engine's log-probs (`rollout_log_probs`) against the trainer's (`computed`, the pass's
    output), over the generated tokens; and the trainer's entropy on them."""
    mask = batch.response_mask
    old = computed["old_log_probs"]
    out = {}
    if "entropys" in computed:  # the trainer's pass (the engine's computes no entropy)
        out["actor/entropy_rollout"] = float((computed["entropys"] * mask).sum() / max(mask.sum(), 1))
    diff = np.abs(old - batch.rollout_log_probs) * mask
    out["rollout/logprob_abs_diff/mean"] = float(diff.sum() / max(mask.sum(), 1))
    real = diff[mask > 0]  # engine vs trainer log-prob of each generated token
    if real.size:
        out["rollout/logprob_abs_diff/p99"] = float(np.percentile(real, 99))
        out["rollout/logprob_abs_diff/max"] = float(real.max())
        out["rollout/logprob_abs_diff/frac_gt_0.1"] = float((real > 0.1).mean())
        out["rollout/logprob_abs_diff/rms"] = float(np.sqrt(np.mean(real ** 2)))
        # verl's training/rollout_probs_diff_*: |p_engine - p_trainer| per token
        probs = np.abs(np.exp(old) - np.exp(batch.rollout_log_probs))[mask > 0]
        out["rollout/probs_diff/mean"] = float(probs.mean())
        out["rollout/probs_diff/max"] = float(probs.max())
    out.update(router_replay_metrics(computed, batch))
    return out


def router_replay_metrics(computed: dict[str, np.ndarray], batch: Batch) -> dict[str, float]:
    """actor.router_replay (record / replay), from the pass's extra outputs: the share of
    (token, layer) routings whose top-k set in this pass differs from the engine's recorded one
    (`rollout/router_replay/mismatch_frac`), and when replaying, the engine/trainer log-prob
    difference of the same weights without replay (`.../logprob_abs_diff_without_replay/*`, to set
    beside `rollout/logprob_abs_diff/*`, which is with replay then)."""
    out = {}
    if "router_compared" in computed:
        out["rollout/router_replay/mismatch_frac"] = float(
            computed["router_mismatched"].sum() / max(int(computed["router_compared"].sum()), 1))
    if "log_probs_without_replay" in computed:
        mask = batch.response_mask
        diff = np.abs(computed["log_probs_without_replay"] - batch.rollout_log_probs) * mask
        where = "rollout/router_replay/logprob_abs_diff_without_replay"
        out[f"{where}/mean"] = float(diff.sum() / max(mask.sum(), 1))
        out[f"{where}/max"] = float(diff.max(initial=0.0))
    return out
