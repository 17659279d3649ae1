"""Chaos check: kill a training run at chosen phases, resume it each time, and compare its final
weights and metrics with an uninterrupted run's.

    python scripts/chaos.py                          # quickstart:tiny, kills at generation, update, save
    python scripts/chaos.py --case async             # + a kill after a save with the async queue non-empty
    python scripts/chaos.py --case tools             # + a kill as a tool call starts
    python scripts/chaos.py --case all               # the three, one after the other
    python scripts/chaos.py --phases save --steps 2  # one kill (what CI runs)
    python scripts/chaos.py --dry-run                # print the plan and commands, run nothing

1. A reference run of `--steps` steps (`save_freq=1`, every checkpoint kept, HF export at the
   end). Its first and last checkpoints must hold different actor weights: a run whose weights
   never move (e.g. every reward 0, so every gradient is 0) checks nothing. The cases score with
   a reward whose value varies between responses (`tests/fixtures/rewards/length_parity.py`).
2. The chaos run: the same command, started once per phase with `JAXRL_CHAOS_KILL_AT=<phase>:<step>`
   (jaxrl_llm/_chaos.py), so the trainer SIGKILLs itself there; the step is after the newest
   checkpoint, so every start after the first must resume (its log says "resumed from").
   Then it is started once more and left to finish.
3. Both runs' `metrics.jsonl` and `val_generations.jsonl` must match row for row (rel 1e-5;
   wall-time, memory, idle-ratio and queue-size keys aside; the engine-vs-trainer log-prob gaps
   within 1e-4) and both exported `hf_actor` folders must hold the same tensors.

Prints one JSON report per case; `"ok": false` with the reasons, and exit status 1, when the runs
differ or a check did not run: a kill that did not land at its phase, a start that did not resume,
weights that did not move. Each run generates its built-in data in its own folder (the same rows:
the same generator settings).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # jaxrl_llm from this checkout
# wall time and what follows from it (how far the rollouter got while the trainer waited)
_NONDETERMINISTIC = re.compile(r"^(timing_s/|timing_per_token_ms/|perf/|fully_async/queue_size)"
                               r"|_s(/|$)|idle_ratio|held_requests")
_KILL_ENV = "JAXRL_CHAOS_KILL_AT"
REWARD = ROOT / "tests" / "fixtures" / "rewards" / "length_parity.py"
_BASE = ("generation", "update", "save")
CASES = {  # name: (config, phases, extra environment, extra overrides)
    "quickstart": (f"{ROOT}/configs/quickstart.py:tiny,local", _BASE, {}, {}),
    # separate placement: one CPU device for the rollouter, one for training. Which tokens a
    # partial rollout generates before a sync depends on timing, so no two runs of the config's
    # staleness 0.5 + partial rollout are equal; staleness 0 without partial rollout is
    # reproducible (and the rollouter still holds handed-out prompts at every save)
    "async": (f"{ROOT}/configs/quickstart_async.py:tiny,local", _BASE + ("async_queue",),
              {"XLA_FLAGS": "--xla_force_host_platform_device_count=2"},
              {"async_training.staleness_threshold": 0.0, "async_training.partial_rollout": False}),
    # the tiny model writes tool calls (about 0.3 per trajectory) only after a longer warm start
    "tools": (f"{ROOT}/configs/quickstart_tools.py:tiny,local", _BASE + ("tool_call",), {},
              {"sft.steps": 300}),
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--case", default="quickstart", choices=[*CASES, "all"])
    p.add_argument("--config", default=None, help="run config instead of the case's")
    p.add_argument("--phases", default=None,
                   help="comma-separated kill phases (default: the case's; jaxrl_llm/_chaos.py lists them)")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--out", default="runs/chaos")
    p.add_argument("--timeout", type=float, default=900, help="seconds one start may take")
    p.add_argument("--override", action="append", default=[],
                   help="extra --config.a.b=v for both runs (repeatable)")
    p.add_argument("--dry-run", action="store_true", help="print the plan and commands and exit")
    args = p.parse_args(argv)
    if args.steps < 2:
        p.error("--steps must be >= 2: a kill needs a checkpoint before it to resume from")
    return args


def train_command(config: str, args, run_dir: Path, extra: dict | None = None) -> list[str]:
    overrides = {
        "trainer.default_local_dir": run_dir, "trainer.total_training_steps": args.steps,
        "trainer.save_freq": 1, "trainer.max_to_keep": args.steps + 1, "trainer.export_hf": True,
        "trainer.async_save": False, "trainer.progress_bar": False, "trainer.plot": False,
        "trainer.logger": "jsonl",
        "reward.custom_reward_function.path": REWARD,
        "reward.custom_reward_function.name": "compute_score", **(extra or {}),
    }
    return ([sys.executable, "-m", "jaxrl_llm.train", f"--config={config}"]
            + [f"--config.{k}={v}" for k, v in overrides.items()] + list(args.override))


def _env(extra: dict, kill_at: str | None) -> dict:
    env = {**os.environ, **extra, "PYTHONPATH": os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    env.pop(_KILL_ENV, None)
    if kill_at:
        env[_KILL_ENV] = kill_at
    return env


def start(cmd: list[str], env: dict, log_path: Path, timeout: float) -> tuple[int, str]:
    """Runs `cmd` in its own process group to its end (or `timeout`); returns (exit status, its
    output). Whatever of the group is left afterwards (tool or reward workers of a killed run)
    is killed."""
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            rc = None
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        if rc is None:
            rc = proc.wait()
            log.write(f"\nchaos.py: killed after the {timeout:g} s timeout\n")
    return rc, log_path.read_text(errors="replace")


def newest_checkpoint(run_dir: Path) -> int:
    from jaxrl_llm.checkpoint import checkpoint_root, newest_valid_step
    return newest_valid_step(checkpoint_root(run_dir)) or 0


def weight_change(run_dir: Path) -> tuple[int, int, float]:
    """(first step, last step, max |difference|) of the actor's params between the run's first
    and last checkpoints."""
    import jax
    import numpy as np

    from jaxrl_llm.checkpoint import Checkpointer, checkpoint_root

    ckpt = Checkpointer(checkpoint_root(run_dir), max_to_keep=None, async_save=False, enable=False)
    steps = ckpt.all_steps()
    if len(steps) < 2:
        return (steps or [0])[0], (steps or [0])[-1], 0.0

    def params(step):
        saved = ckpt._manager.item_metadata(step)["state"]  # noqa: SLF001 - shapes to restore as numpy
        tree = getattr(saved, "tree", saved)
        target = jax.tree.map(lambda m: np.zeros(m.shape, m.dtype), tree)
        return jax.tree.leaves(ckpt.restore(step, target=target)[0]["actor"]["params"])

    first, last = params(steps[0]), params(steps[-1])
    diff = max(float(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)).max())
               for a, b in zip(first, last))
    return steps[0], steps[-1], diff


def _rows(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    with open(path) as f:
        return [{k: v for k, v in json.loads(line).items() if not _NONDETERMINISTIC.search(k)}
                for line in f if line.strip()]


# engine-vs-trainer log-prob gaps: float rounding (~1e-6) that moves with the engine's slot
# layout, which a restarted server lays out afresh
_ROUNDING = re.compile(r"^rollout/(logprob_abs_diff|probs_diff)/")


def _close(a, b, key: str = "") -> bool:
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return abs(a - b) <= (1e-4 if _ROUNDING.search(key) else 1e-6) + 1e-5 * abs(b)
    return a == b


def compare_metrics(ref: Path, got: Path) -> list[str]:
    problems = []
    for name in ("metrics.jsonl", "val_generations.jsonl"):
        want, have = _rows(ref / name), _rows(got / name)
        steps = lambda rows: [r["training/global_step"] for r in rows]  # noqa: E731
        if steps(want) != steps(have):
            problems.append(f"{name} rows differ: steps {steps(have)} vs the reference's {steps(want)}")
            continue
        problems += [f"{name} step {w['training/global_step']} {k}: {h.get(k)} vs {v}"
                     for w, h in zip(want, have) for k, v in w.items() if not _close(h.get(k), v, k)]
    return problems


def compare_weights(ref: Path, got: Path) -> list[str]:
    import numpy as np
    from safetensors.numpy import load_file

    def tensors(folder):
        out = {}
        for f in sorted(folder.glob("*.safetensors")):
            out.update(load_file(str(f)))
        return out

    want, have = tensors(ref / "hf_actor"), tensors(got / "hf_actor")
    if not want:
        return [f"no exported tensors in {ref / 'hf_actor'}"]
    if want.keys() != have.keys():
        return [f"exported tensors differ: {sorted(set(want) ^ set(have))}"]
    return [f"tensor {k} differs (max |diff| {float(np.abs(want[k] - have[k]).max()):.3g})"
            for k in want if not np.allclose(want[k], have[k], rtol=1e-5, atol=1e-6)]


def kill_steps(phases, steps: int) -> list[int]:
    """The planned step of each kill: 2, 3, ..., steps, 2, ... (never step 1: before it there is
    no checkpoint to resume from). At run time a kill moves past the newest checkpoint."""
    return [2 + i % (steps - 1) for i in range(len(phases))]


def run_case(name: str, args) -> dict:
    config, phases, env_extra, case_overrides = CASES[name]
    config = args.config or config
    phases = tuple(args.phases.split(",")) if args.phases else phases
    out = Path(args.out).absolute() / name
    ref_dir, chaos_dir = out / "reference", out / "chaos"
    extra = {} if args.config else case_overrides
    ref_cmd, chaos_cmd = (train_command(config, args, d, extra) for d in (ref_dir, chaos_dir))
    plan = list(zip(phases, kill_steps(phases, args.steps)))
    if args.dry_run:
        print(f"# case {name}: kills {', '.join(f'{p}:{s}' for p, s in plan)}")
        print("+ " + shlex.join(ref_cmd))
        for phase, step in plan:
            print(f"+ {_KILL_ENV}={phase}:{step} " + shlex.join(chaos_cmd))
        print("+ " + shlex.join(chaos_cmd))
        return {"case": name, "ok": True, "dry_run": True}
    if ref_dir.exists() or chaos_dir.exists():
        raise SystemExit(f"{ref_dir} or {chaos_dir} exists: pick a fresh --out")
    out.mkdir(parents=True, exist_ok=True)
    problems, kills, resumes = [], [], 0
    t0 = time.perf_counter()
    rc, _ = start(ref_cmd, _env(env_extra, None), out / "reference.log", args.timeout)
    report = {"case": name, "config": config, "steps": args.steps}
    if rc != 0:
        return {**report, "ok": False, "problems": [f"the reference run failed (exit {rc}); see {out / 'reference.log'}"]}
    report["reference_s"] = round(time.perf_counter() - t0, 1)
    first, last, moved = weight_change(ref_dir)
    report["weights_moved"] = {"from_step": first, "to_step": last, "max_abs_change": moved}
    if moved == 0.0:
        problems.append(f"the actor's weights did not change between checkpoints {first} and {last} "
                        "of the reference run: the run trains nothing, so the check proves nothing")
    starts = [(phase, step) for phase, step in plan] + [(None, None)]
    for i, (phase, step) in enumerate(starts):
        newest = newest_checkpoint(chaos_dir)
        if phase is not None:
            step = min(args.steps, max(step, newest + 1))
            if step <= newest:
                problems.append(f"no step left after checkpoint {newest} to kill at {phase}; raise --steps")
                continue
        log = out / (f"chaos-{i}-{phase}.log" if phase else f"chaos-{i}-final.log")
        rc, text = start(chaos_cmd, _env(env_extra, f"{phase}:{step}" if phase else None), log, args.timeout)
        resumed = "resumed from" in text
        if newest > 0:
            resumes += resumed
            if not resumed:
                problems.append(f"start {i} did not resume from checkpoint {newest}; see {log}")
        if phase is None:
            if rc != 0:
                problems.append(f"the final start failed (exit {rc}); see {log}")
            continue
        landed = f"chaos: killed at {phase} step" in text and rc == -signal.SIGKILL
        kills.append({"phase": phase, "step": step, "landed": landed, "resumed_from": newest or None})
        if not landed:
            what = "finished" if rc == 0 else f"ended with exit {rc}"
            problems.append(f"the kill at {phase} (step >= {step}) did not land: the run {what}; see {log}")
    if resumes == 0:
        problems.append("no start resumed from a checkpoint")
    if not problems:
        problems += compare_metrics(ref_dir, chaos_dir) + compare_weights(ref_dir, chaos_dir)
    return {**report, "kills": kills, "resumes": resumes, "ok": not problems, "problems": problems[:20]}


def main(argv=None) -> int:
    args = parse_args(argv)
    from jaxrl_llm._chaos import PHASES
    unknown = set(args.phases.split(",")) - set(PHASES) if args.phases else set()
    if unknown:
        raise SystemExit(f"--phases: unknown phase(s) {sorted(unknown)}; choose from {', '.join(PHASES)}")
    ok = True
    for name in (CASES if args.case == "all" else [args.case]):
        report = run_case(name, args)
        if not args.dry_run:
            print(json.dumps(report, indent=1), flush=True)
        ok &= report["ok"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
