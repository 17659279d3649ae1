"""The agentic demo: `python -m jaxrl_llm.train --config=configs/quickstart_tools.py` on CPU.

A tiny model learns to call the calculator for two-digit multiplication: GRPO over agent
rollouts must raise held-out greedy accuracy (val-core/arithmetic/reward/mean@1) by at least 20
points over the SFT warm start, with multi-turn trajectories (num_turns/mean > 1) in which the
model calls the tool. Runs the real command in a subprocess, as a user would.
"""
import json
import os
import subprocess
import sys

from trainer_helpers import ROOT

CONFIG = os.path.join(ROOT, "configs", "quickstart_tools.py")
KEY = "val-core/arithmetic/reward/mean@1"


def test_quickstart_tools_learns_to_use_the_calculator(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # a user's plain CPU
    proc = subprocess.run([sys.executable, "-m", "jaxrl_llm.train", f"--config={CONFIG}"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stderr[-4000:]
    run = tmp_path / "runs" / "quickstart_tools"
    records = [json.loads(line) for line in open(run / "metrics.jsonl")]
    vals = [(r["training/global_step"], r[KEY]) for r in records if KEY in r]
    assert vals[0][0] == 0, "validation before training is the baseline"
    before, after = vals[0][1], vals[-1][1]
    steps = [r for r in records if "num_turns/mean" in r]
    print(f"quickstart_tools: held-out accuracy {before:.3f} -> {after:.3f}; tool calls per "
          f"trajectory {steps[0]['tool_calls/mean']:.2f} -> {steps[-1]['tool_calls/mean']:.2f}")
    assert after - before >= 0.20, vals
    assert all(r["num_turns/mean"] > 2 for r in steps)  # a single answer counts 2 (verl)
    assert steps[-1]["tool_calls/mean"] > steps[0]["tool_calls/mean"]
    assert (run / "hf_actor" / "model.safetensors").exists()
