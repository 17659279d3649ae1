"""Trainer modes on one device with a long-tailed response length: `sync` vs `colocate_async`
(`trainer.v1.trainer_mode`), same config, same number of trained samples.

    python scripts/bench_modes.py                               # Qwen2.5-1.5B shape on one GPU
    python scripts/bench_modes.py --modes sync colocate_async --steps 5 --out runs/bench_modes.json
    python scripts/bench_modes.py --dry-run                     # tiny model on CPU (tests call it)

Each mode runs the real trainer (`RLTrainer.fit`, workers in-process, colocated placement) on a
random-init model with Qwen2.5 shapes. The responses' lengths are the point: a random model
almost never writes its stop token, so the rows run through the `long_tail_agent` loop defined
here, a single-turn loop whose request asks for `L` new tokens, `L` drawn per row from a
lognormal (median `--median`, log-std `--sigma`, capped at `--cap`) seeded by the row, so both
modes generate the same lengths for the same prompt and row (the bench's tokenizer gives the
engine no stop token, so learning cannot shorten them). The reward is one a random model
can learn (`scripts/bench_modes_reward.py`: ids past the character vocabulary decode as "a" for
an even id and "b" for an odd one; the score is the share of a's, about 0.5 at the start), so
reward against step and against wall time compare how the modes learn at equal samples.

`sync` generates a batch and waits for its longest row before training; `colocate_async` keeps
generating the next batches (`num_warmup_batches`), trains as soon as a batch's groups are done,
holds the unfinished requests over the update (the engine asleep: `rollout.free_cache_engine`)
and resumes them after the sync with their tokens kept.

Reported per mode (one JSON object; the first `--warmup` steps, which compile, are left out):
`tokens_per_s_per_device` = sum of `perf/total_num_tokens` (prompt + response tokens trained) /
sum of `timing_s/step` / devices, `step_s` per step, `response_length/mean` and `/max`, the mean
`timing_s/gen` (the trainer's wait for its batch) and, for colocate_async, held groups and
staleness, and the curves: `score_mean` (`critic/score/mean`) and `wall_s` (cumulative step
time) per step, warm-up steps included. The last line is the summary: each mode's throughput
relative to `sync`. `--plot PATH` draws reward against step and against wall time (PNG).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile

import numpy as np
import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from jaxrl_llm import agent, models  # noqa: E402
from jaxrl_llm.models import QWEN25_SHAPES  # noqa: E402

MODES = ("sync", "colocate_async")
_ARCH = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
         "num_key_value_heads")


def response_budget(seed: int, row: int, *, median: float, sigma: float, cap: int) -> int:
    """The row's response length: lognormal(log(median), sigma) rounded, in [1, cap]."""
    rng = np.random.default_rng([seed, row])
    return int(min(cap, max(1, round(rng.lognormal(math.log(median), sigma)))))


agent.AGENT_LOOPS.pop("long_tail_agent", None)  # this file loaded again (tests) registers anew


@agent.register_agent_loop("long_tail_agent")
class LongTailAgentLoop(agent.SingleTurnAgentLoop):
    """`single_turn_agent` with a per-row length budget (`response_budget`); the settings come
    from the environment (JAXRL_BENCH_LENGTHS = "median,sigma,cap") so that every process that
    imports this file draws the same lengths."""

    def __init__(self, ctx):
        super().__init__(ctx)
        median, sigma, cap = os.environ.get("JAXRL_BENCH_LENGTHS", "300,1.0,4096").split(",")
        self._lengths = dict(median=float(median), sigma=float(sigma), cap=int(cap))

    async def generate(self, session, prompt_ids, sample, turn, max_new_tokens):
        budget = response_budget(self.ctx.seed, sample.row, **self._lengths)
        return await super().generate(session, prompt_ids, sample, turn, min(budget, max_new_tokens))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="1.5b", choices=sorted(QWEN25_SHAPES))
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument("--prompts", type=int, default=16, help="groups per training step (train_batch_size)")
    p.add_argument("--n", type=int, default=8, help="samples per prompt (rollout.n)")
    p.add_argument("--median", type=float, default=300.0)
    p.add_argument("--sigma", type=float, default=1.0, help="log-std of the response lengths")
    p.add_argument("--cap", type=int, default=4096, help="longest response (data.max_response_length)")
    p.add_argument("--steps", type=int, default=5, help="training steps per mode, --warmup included")
    p.add_argument("--warmup", type=int, default=1, help="first steps left out of the figures")
    p.add_argument("--warmup-batches", type=float, default=1.0, help="colocate_async.num_warmup_batches")
    p.add_argument("--slots", type=int, default=0, help="max_concurrent_decodes (0: 2 batches' rows)")
    p.add_argument("--micro", type=int, default=4, help="actor.ppo_micro_batch_size_per_device")
    p.add_argument("--steps-per-sync", type=int, default=16)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a run-config override for every mode, e.g. rollout.free_cache_engine=false")
    p.add_argument("--lr", type=float, default=1e-5, help="actor.optim.lr")
    p.add_argument("--out", default="", help="also write the results (a JSON list) here")
    p.add_argument("--plot", default="", help="also draw reward vs step and vs wall time here (PNG)")
    p.add_argument("--dry-run", "--tiny", dest="dry_run", action="store_true",
                   help="tiny model, 4 prompts x 2 samples, lengths up to 12, 2 steps, CPU")
    args = p.parse_args(argv)
    if args.dry_run:
        args.model, args.prompts, args.n, args.median, args.cap = "tiny", 4, 2, 4.0, 12
        args.steps, args.warmup, args.micro, args.steps_per_sync = 2, 1, 4, 4
    if args.steps <= args.warmup:
        p.error("--steps must exceed --warmup (the figures need a timed step)")
    return args


def run_config(mode: str, args, run_dir: str):
    """The run config of one mode (a `RunConfig`)."""
    from jaxrl_llm import config as C

    tiny = args.model == "tiny"
    c = C.base_config()
    s = QWEN25_SHAPES[args.model]
    c.model.init.update(model_type="qwen2", rope_theta=1e6, max_position_embeddings=32768,
                        head_dim=s["hidden_size"] // s["num_attention_heads"], tie_word_embeddings=True,
                        **{k: s[k] for k in _ARCH})  # the vocabulary: PaddedCharTokenizer
    c.model.tokenizer = "char"  # the built-in arithmetic prompts; the model's vocabulary is larger
    c.model.dtype = "float32" if tiny else "bfloat16"
    c.model.remat = "none" if tiny else "full"
    c.data.builtin_task, c.data.builtin_val_size = "arithmetic", 0
    c.reward.custom_reward_function.path = os.path.join(ROOT, "scripts", "bench_modes_reward.py")
    c.reward.custom_reward_function.name = "even_token_share"
    c.actor.optim.lr = args.lr
    c.data.builtin_train_size = max(256, args.prompts * (args.steps + 4))
    c.data.max_prompt_length, c.data.max_response_length = 16, args.cap
    c.data.train_batch_size = args.prompts
    c.actor.ppo_mini_batch_size = args.prompts  # one optimizer step per RL step
    c.actor.ppo_micro_batch_size_per_device = args.micro
    c.rollout.n = args.n
    c.rollout.temperature = 1.0
    c.rollout.max_concurrent_decodes = args.slots or 2 * args.prompts * args.n
    c.rollout.steps_per_sync = args.steps_per_sync
    c.rollout.multi_turn.enable = True
    c.rollout.multi_turn.default_agent_loop = "long_tail_agent"
    c.sft.steps = 0
    c.trainer.backend = "local"
    c.trainer.total_training_steps = args.steps
    c.trainer.save_freq = c.trainer.test_freq = 0
    c.trainer.val_before_train = c.trainer.export_hf = c.trainer.plot = c.trainer.progress_bar = False
    c.trainer.async_save = False
    c.trainer.logger = ("jsonl",)
    c.trainer.default_local_dir = run_dir
    c.trainer.v1.trainer_mode = mode
    c.trainer.v1.colocate_async.num_warmup_batches = args.warmup_batches
    for item in args.set:  # a.b.c=value, the value read as YAML (true, 1.5, "text")
        path, _, value = item.partition("=")
        *parents, key = path.split(".")
        node = c
        for part in parents:
            node = node[part]
        node[key] = yaml.safe_load(value)
    return C.to_run_config(c)


def summarize(mode: str, rows: list[dict], *, warmup: int, devices: int) -> dict:
    """The figures of one mode from its metrics.jsonl rows (steps after `warmup`)."""
    timed = [r for r in rows if r["training/global_step"] > warmup]
    step_s = [r["timing_s/step"] for r in timed]
    tokens = sum(r["perf/total_num_tokens"] for r in timed)
    out = {"mode": mode, "timed_steps": len(timed), "step_s": [round(x, 3) for x in step_s],
           "tokens_trained": int(tokens),
           "tokens_per_s_per_device": tokens / sum(step_s) / devices,
           "gen_wait_s_mean": float(np.mean([r.get("timing_s/gen", 0.0) for r in timed])),
           "response_length_mean": float(np.mean([r["response_length/mean"] for r in timed])),
           "response_length_max": float(max(r["response_length/max"] for r in timed)),
           "score_mean": [round(float(r.get("critic/score/mean", 0.0)), 5) for r in rows],
           "wall_s": [round(float(x), 3) for x in np.cumsum([r["timing_s/step"] for r in rows])],
           "response_length_per_step": [round(float(r["response_length/mean"]), 1) for r in rows]}
    if mode == "colocate_async":
        out["held_groups_mean"] = float(np.mean([r.get("colocate_async/held_groups", 0.0) for r in timed]))
        out["staleness_max"] = float(max(r.get("fully_async/staleness/max", 0.0) for r in timed))
        out["kv_bytes_released"] = float(max(r.get("colocate_async/kv_bytes_released", 0.0) for r in timed))
    return out


class PaddedCharTokenizer(models.CharTokenizer):
    """The character tokenizer with the model shape's vocabulary size (the trainer sizes the
    embedding and LM head by the tokenizer): ids past the characters decode as "a" (even) or
    "b" (odd), which the bench's reward counts; no stop ids."""

    def __init__(self, vocab_size: int):
        super().__init__()
        self.num_chars, self.vocab_size = self.vocab_size, max(vocab_size, self.vocab_size)
        # no stop token: a model that learns from the reward could learn to stop early and
        # shorten the long tail; every row runs to its lognormal budget in every step and mode
        self.eos_token_ids = ()

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        text = super().decode([i for i in ids if i < self.num_chars], skip_special_tokens)
        return text + "".join("b" if i % 2 else "a" for i in map(int, ids) if i >= self.num_chars)


def run_mode(mode: str, args) -> dict:
    import jax

    from jaxrl_llm.metrics import read_jsonl
    from jaxrl_llm.trainer import RLTrainer, _rl

    vocab = QWEN25_SHAPES[args.model]["vocab_size"]
    # the shape's LM head: the trainer's tokenizer (which sizes the model and gives the stop ids,
    # `_rl.load_tokenizer`) and the agent loops' (which decode what the reward reads,
    # `models.load_tokenizer`) are both the padded one
    padded = lambda *a, **k: PaddedCharTokenizer(vocab)  # noqa: E731
    real = _rl.load_tokenizer, models.load_tokenizer
    _rl.load_tokenizer, models.load_tokenizer = padded, padded
    try:
        with tempfile.TemporaryDirectory(prefix=f"bench_modes_{mode}_") as run_dir:
            trainer = RLTrainer(run_config(mode, args, run_dir))
            trainer.fit()
            rows = read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
    finally:
        _rl.load_tokenizer, models.load_tokenizer = real
    return {**summarize(mode, rows, warmup=args.warmup, devices=jax.device_count()),
            "vocab_size": trainer.tokenizer.vocab_size,
            "stop_token_ids": list(trainer.tokenizer.eos_token_ids)}


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    os.environ["JAXRL_BENCH_LENGTHS"] = f"{args.median},{args.sigma},{args.cap}"
    results = []
    for mode in args.modes:
        result = {"model": args.model, "prompts": args.prompts, "n": args.n, "set": args.set,
                  "lengths": {"median": args.median, "sigma": args.sigma, "cap": args.cap},
                  **run_mode(mode, args)}
        print(json.dumps(result), flush=True)
        results.append(result)
    base = next((r for r in results if r["mode"] == "sync"), None)
    summary = {"summary": {r["mode"]: (r["tokens_per_s_per_device"] / base["tokens_per_s_per_device"]
                                       if base else None) for r in results}}
    print(json.dumps(summary), flush=True)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(results + [summary], f, indent=1)
    if args.plot:
        plot(results, args.plot)
    return results


def label(result: dict) -> str:
    """A result's legend: its mode, its --set overrides, its throughput."""
    sets = ", ".join(s.split(".")[-1] for s in result.get("set", []))
    return (f"{result['mode']}{f' ({sets})' if sets else ''}: "
            f"{result['tokens_per_s_per_device']:,.0f} tok/s/GPU")


def plot(results: list[dict], path: str) -> None:
    """Reward against step and against wall time, one line per result."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_step, by_time) = plt.subplots(1, 2, figsize=(11, 4))
    for r in results:
        steps = range(1, len(r["score_mean"]) + 1)
        by_step.plot(steps, r["score_mean"], marker="o", label=label(r))
        by_time.plot(r["wall_s"], r["score_mean"], marker="o", label=label(r))
    by_step.set(xlabel="training step", ylabel="critic/score/mean")
    by_time.set(xlabel="wall time, s (sum of timing_s/step)", ylabel="critic/score/mean")
    by_step.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
