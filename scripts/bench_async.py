"""Synchronous vs one-step-off vs fully asynchronous training, same config, same samples: throughput
and the reward curve against steps and wall time.

    XLA_FLAGS=--xla_force_host_platform_device_count=2 python scripts/bench_async.py      # CPU
    python scripts/bench_async.py --config configs/X.py --steps 40 --out runs/bench_async
    python scripts/bench_async.py --dry-run          # print each mode's command, run nothing

Every mode runs `python -m jaxrl_llm.train` in its own process on the same config (default:
configs/quickstart_async.py, the quickstart model and task) with `placement.mode=separate` (the
last device rolls out, the others train, so the modes differ only in scheduling):

- `sync`: generate a batch, train on it, sync (the synchronous trainer on separate devices);
- `one_step_off`: `trainer.v1.trainer_mode=separate_async` one batch ahead with a bound of one
  version (step k+1's rollout while step k trains; `placement.one_step_off_policy` is its alias);
- `async_s{S}` / `async_s{S}_partial`: `separate_async` with `num_warmup_batches` S (the alias
  `async_training.staleness_threshold`) and `max_off_policy_threshold` ceil(S), without / with
  partial rollout (one training step per loader batch, a sync after every step).

Reported per mode (one JSON line each, then a summary line): `tokens_per_s_per_device` = (prompt +
response tokens trained) / (wall time of the training steps, the sum of `timing_s/step`) /
devices; `steps_per_s`; the reward curve (`critic/score/mean` per step, with the cumulative step
time) and the last held-out accuracy; for async modes the mean trainer / rollouter idle ratios and
the largest staleness seen. The summary gives each mode's throughput relative to `sync`. With
`--plot`, a PNG of the reward against steps and against wall time. Startup, SFT and validation
are outside the timed steps.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODES = ("sync", "one_step_off", "async_s0.5", "async_s0.5_partial", "async_s1", "async_s1_partial")
REWARD, VAL = "critic/score/mean", "val-core/arithmetic/reward/mean@1"


def mode_overrides(mode: str) -> dict:
    """`--config.*` overrides of one mode (on top of a separate-placement config), in the
    `trainer.v1` names; every mode sets every field, so the base config's own mode is replaced."""
    o = {"placement.mode": "separate", "trainer.v1.trainer_mode": "sync",
         "trainer.v1.colocate_async.num_warmup_batches": 1.0,
         "trainer.v1.sampler.max_off_policy_threshold": 1, "async_training.partial_rollout": False}
    if mode == "one_step_off":  # separate_async one batch ahead, a bound of one version
        o["trainer.v1.trainer_mode"] = "separate_async"
    elif mode.startswith("async_s"):
        s = float(mode[len("async_s"):].removesuffix("_partial"))
        o.update({"trainer.v1.trainer_mode": "separate_async", "trainer.v1.colocate_async.num_warmup_batches": s,
                  "trainer.v1.sampler.max_off_policy_threshold": max(math.ceil(s), 1),
                  "async_training.partial_rollout": mode.endswith("_partial")})
    elif mode != "sync":
        raise ValueError(f"unknown mode {mode!r}; choose from {MODES}")
    return o


def command(args, mode: str, run_dir: str) -> list[str]:
    o = {**mode_overrides(mode), "trainer.total_training_steps": args.steps,
         "trainer.default_local_dir": run_dir, "trainer.test_freq": 0, "trainer.save_freq": 0,
         "trainer.export_hf": False, "trainer.plot": False, "trainer.progress_bar": False,
         "trainer.logger": "jsonl", "trainer.resume_mode": "disable"}
    return [sys.executable, "-m", "jaxrl_llm.train", f"--config={args.config}"] + [
        f"--config.{k}={v}" for k, v in o.items()] + list(args.override)


def summarize(mode: str, rows: list[dict]) -> dict:
    steps = [r for r in rows if "timing_s/step" in r]
    wall = sum(r["timing_s/step"] for r in steps)
    tokens = sum(r["perf/total_num_tokens"] for r in steps)
    devices = steps[0]["perf/total_num_tokens"] / max(steps[0]["perf/throughput"] * steps[0]["timing_s/step"], 1e-9)
    out = {"mode": mode, "steps": len(steps), "train_wall_s": wall,
           "tokens_per_s_per_device": tokens / max(wall, 1e-9) / max(round(devices), 1),
           "steps_per_s": len(steps) / max(wall, 1e-9),
           "reward": [r.get(REWARD) for r in steps],
           "wall_s": [sum(r["timing_s/step"] for r in steps[:i + 1]) for i in range(len(steps))]}
    vals = [r[VAL] for r in rows if VAL in r]
    if vals:
        out["val_first"], out["val_last"] = vals[0], vals[-1]
    for key in ("fully_async/trainer/idle_ratio", "fully_async/rollouter/idle_ratio"):
        xs = [r[key] for r in steps if key in r]
        if xs:
            out[key.split("/")[1] + "_idle_ratio"] = sum(xs) / len(xs)
    stale = [r["fully_async/staleness/max"] for r in steps if "fully_async/staleness/max" in r]
    if stale:
        out["staleness_max"] = max(stale)
    return out


def plot(results: list[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for r in results:
        a.plot(range(1, len(r["reward"]) + 1), r["reward"], label=r["mode"])
        b.plot(r["wall_s"], r["reward"], label=r["mode"])
    a.set_xlabel("training step"), b.set_xlabel("training wall time (s)")
    for ax in (a, b):
        ax.set_ylabel(REWARD)
        ax.grid(alpha=0.3)
    a.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default=os.path.join(ROOT, "configs", "quickstart_async.py"))
    p.add_argument("--modes", nargs="+", default=list(MODES))
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--out", default="", help="folder for the runs (default: a temporary one)")
    p.add_argument("--json", default="", help="also write the results to this file")
    p.add_argument("--plot", default="", help="PNG of the reward against steps and wall time")
    p.add_argument("--override", nargs="*", default=[], help="more --config.x=y flags for every mode")
    p.add_argument("--dry-run", action="store_true", help="print each mode's command and exit")
    args = p.parse_args(argv)
    for mode in args.modes:
        mode_overrides(mode)  # unknown modes fail before anything runs
    out = args.out or tempfile.mkdtemp(prefix="bench_async-")
    results = []
    for mode in args.modes:
        run_dir = os.path.join(out, mode)
        cmd = command(args, mode, run_dir)
        if args.dry_run:
            results.append({"mode": mode, "command": cmd})
            print(json.dumps(results[-1]), flush=True)
            continue
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            results.append({"mode": mode, "error": proc.stderr[-3000:]})
        else:
            with open(os.path.join(run_dir, "metrics.jsonl"), encoding="utf-8") as f:
                results.append(summarize(mode, [json.loads(line) for line in f]))
        print(json.dumps({k: v for k, v in results[-1].items() if k not in ("reward", "wall_s")}), flush=True)
    if args.dry_run:
        return results
    ok = {r["mode"]: r for r in results if "error" not in r}
    summary = {"summary": True, "config": args.config, "steps": args.steps}
    if "sync" in ok:
        summary.update({f"throughput_vs_sync/{m}": r["tokens_per_s_per_device"] / ok["sync"]["tokens_per_s_per_device"]
                        for m, r in ok.items()})
    print(json.dumps(summary), flush=True)
    results.append(summary)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=1)
    if args.plot and ok:
        plot(list(ok.values()), args.plot)
    return results


if __name__ == "__main__":
    main()
