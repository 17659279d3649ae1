"""Curve and summary of a configs/grpo_smollm2_gym.py run: held-out greedy accuracy and training
reward by step (PNG) plus a JSON of the figures that docs/benchmarks.md quotes.

    python scripts/plot_smollm2_gym.py runs/grpo_smollm2_gym/metrics.jsonl \
        --fp32 runs/onemb_fp32/metrics.jsonl --bf16-one-minibatch runs/onemb_bf16/metrics.jsonl \
        --out docs/figures/smollm2_gym_h200
"""
from __future__ import annotations

import argparse
import json

VAL = "val-core/reasoning_gym/chain_sum/acc/mean@1"
DIFF = ("mean", "p99", "max", "frac_gt_0.1")


def read(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def logprob_figures(rows):
    """rollout/logprob_abs_diff/* of step 1 (the initial model) and over all steps (mean of each)."""
    steps = [r for r in rows if "rollout/logprob_abs_diff/mean" in r]
    first = {k: steps[0][f"rollout/logprob_abs_diff/{k}"] for k in DIFF}
    avg = {k: sum(r[f"rollout/logprob_abs_diff/{k}"] for r in steps) / len(steps) for k in DIFF}
    return {"step_1": first, "mean_over_steps": avg, "steps": len(steps)}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("metrics")
    p.add_argument("--fp32", help="metrics.jsonl of a float32 run (log-prob agreement)")
    p.add_argument("--bf16-one-minibatch", help="metrics.jsonl of a bf16 run with one mini-batch per step")
    p.add_argument("--out", required=True, help="path prefix: writes <out>.json and <out>.png")
    args = p.parse_args()
    rows = read(args.metrics)
    val = [(r["training/global_step"], r[VAL]) for r in rows if VAL in r]
    train = [(r["training/global_step"], r["critic/score/mean"]) for r in rows if "critic/score/mean" in r]
    secs = [r.get("timing_s/step", 0.0) for r in rows if "timing_s/step" in r]
    summary = {
        "held_out_greedy_accuracy": [{"step": s, "acc": a} for s, a in val],
        "train_reward_mean": [{"step": s, "score": x} for s, x in train],
        "train_seconds_total": sum(secs), "train_seconds_first_step": secs[0] if secs else None,
        "logprob_abs_diff_bf16": logprob_figures(rows),
    }
    if args.fp32:
        summary["logprob_abs_diff_fp32"] = logprob_figures(read(args.fp32))
    if args.bf16_one_minibatch:
        one = read(args.bf16_one_minibatch)
        summary["bf16_one_minibatch_step_metrics"] = [
            {k: r[k] for k in ("training/global_step", "actor/ppo_kl", "actor/pg_clipfrac",
                               "actor/pg_clipfrac_lower", "actor/kl_loss") if k in r} for r in one]
    with open(args.out + ".json", "w") as f:
        json.dump(summary, f, indent=1)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(*zip(*train), color="0.7", lw=1, label="train reward (sampled, T=1)")
    ax.plot(*zip(*val), "o-", color="C0", lw=2, label="held-out greedy accuracy (500)")
    ax.set_xlabel("GRPO step (64 prompts x 8 samples)")
    ax.set_ylabel("accuracy")
    ax.set_ylim(0, 1)
    ax.set_title("SmolLM2-135M-Instruct, GRPO on reasoning-gym chain_sum (1 x H200)")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(args.out + ".png", dpi=110)
    print(json.dumps({k: v for k, v in summary.items() if k != "train_reward_mean"}, indent=1))


if __name__ == "__main__":
    main()
