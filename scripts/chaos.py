"""Chaos check: kill a training run at random points, resume it each time, and compare its final
weights and metrics with an uninterrupted run's.

    python scripts/chaos.py                        # tiny quickstart on CPU, 3 kills (a few minutes)
    python scripts/chaos.py --kills 10 --steps 6 --seed 1
    python scripts/chaos.py --dry-run              # print the commands, run nothing (tests call it)

1. A reference run of `--steps` steps (`save_freq=1`, HF export at the end).
2. The chaos run: the same command, started again and again in its own folder and sent
   SIGKILL (its whole process group) after a random delay within the reference run's duration,
   `--kills` times, then left to finish. Every start resumes with `resume_mode=auto`.
3. Both runs' `metrics.jsonl` and `val_generations.jsonl` must match row for row (timing and
   memory keys aside, rel 1e-5) and both exported `hf_actor` folders must hold the same tensors.

Prints one JSON report; exits 1 when the runs differ. Each run generates its built-in data in its own folder.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_NONDETERMINISTIC = ("timing_s/", "timing_per_token_ms/", "perf/", "rollout/sync_time_s")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=f"{ROOT}/configs/quickstart.py:tiny,local")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--kills", type=int, default=3)
    p.add_argument("--seed", type=int, default=0, help="seed of the kill times")
    p.add_argument("--out", default="runs/chaos")
    p.add_argument("--override", action="append", default=[],
                   help="extra --config.a.b=v for both runs (repeatable)")
    p.add_argument("--dry-run", action="store_true", help="print the commands and exit")
    return p.parse_args(argv)


def train_command(args, run_dir: Path) -> list[str]:
    overrides = {
        "trainer.default_local_dir": run_dir, "trainer.total_training_steps": args.steps,
        "trainer.save_freq": 1, "trainer.export_hf": True, "trainer.async_save": False,
        "trainer.progress_bar": False, "trainer.plot": False, "trainer.logger": "jsonl",
    }
    return ([sys.executable, "-m", "jaxrl_llm.train", f"--config={args.config}"]
            + [f"--config.{k}={v}" for k, v in overrides.items()] + list(args.override))


def _start(cmd: list[str], log) -> subprocess.Popen:
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def run_to_end(cmd: list[str], log_path: Path) -> float:
    t0 = time.perf_counter()
    with open(log_path, "a") as log:
        rc = _start(cmd, log).wait()
    if rc != 0:
        raise SystemExit(f"run failed with exit code {rc}; see {log_path}")
    return time.perf_counter() - t0


def kill_after(cmd: list[str], delay_s: float, log_path: Path) -> bool:
    """Starts `cmd`, SIGKILLs its process group after `delay_s`. Returns whether it was killed
    (False: it finished first)."""
    with open(log_path, "a") as log:
        proc = _start(cmd, log)
        try:
            proc.wait(timeout=delay_s)
            return False
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return True


def _rows(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    with open(path) as f:
        return [{k: v for k, v in json.loads(line).items() if not k.startswith(_NONDETERMINISTIC)}
                for line in f if line.strip()]


def _close(a, b) -> bool:
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return abs(a - b) <= 1e-6 + 1e-5 * abs(b)
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
                     for w, h in zip(want, have) for k, v in w.items() if not _close(h.get(k), v)]
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
    if want.keys() != have.keys():
        return [f"exported tensors differ: {sorted(set(want) ^ set(have))}"]
    return [f"tensor {k} differs (max |diff| {float(np.abs(want[k] - have[k]).max()):.3g})"
            for k in want if not np.allclose(want[k], have[k], rtol=1e-5, atol=1e-6)]


def main(argv=None) -> int:
    args = parse_args(argv)
    out = Path(args.out).absolute()
    ref_dir, chaos_dir = out / "reference", out / "chaos"
    ref_cmd, chaos_cmd = train_command(args, ref_dir), train_command(args, chaos_dir)
    if args.dry_run:
        print("+ " + shlex.join(ref_cmd))
        for _ in range(args.kills):
            print("+ " + shlex.join(chaos_cmd) + "  # SIGKILL after a random delay")
        print("+ " + shlex.join(chaos_cmd))
        return 0
    if ref_dir.exists() or chaos_dir.exists():
        raise SystemExit(f"{ref_dir} or {chaos_dir} exists: pick a fresh --out")
    out.mkdir(parents=True, exist_ok=True)
    duration = run_to_end(ref_cmd, out / "reference.log")
    rng = random.Random(args.seed)
    delays, killed = [], 0
    for _ in range(args.kills):
        delay = rng.uniform(0.1, 1.0) * duration
        delays.append(round(delay, 2))
        killed += kill_after(chaos_cmd, delay, out / "chaos.log")
    run_to_end(chaos_cmd, out / "chaos.log")
    problems = compare_metrics(ref_dir, chaos_dir) + compare_weights(ref_dir, chaos_dir)
    print(json.dumps({"steps": args.steps, "kills": killed, "kill_delays_s": delays,
                      "reference_s": round(duration, 1), "ok": not problems,
                      "problems": problems[:20]}, indent=1))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
