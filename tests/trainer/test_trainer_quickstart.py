"""The README's main job: `python -m jaxrl_llm.train --config=configs/quickstart.py` on CPU.

It must raise held-out accuracy (val-core/arithmetic/reward/mean@1, greedy) by at least 20
points over the SFT warm start, and leave metrics.jsonl, TensorBoard logs, a checkpoint, a
Hugging Face export and curves.png. Runs the real command in a subprocess, as a user would.
"""
import json
import os
import subprocess
import sys

from trainer_helpers import QUICKSTART

KEY = "val-core/arithmetic/reward/mean@1"


def test_quickstart_learns_and_leaves_its_artifacts(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # a user's plain CPU
    proc = subprocess.run([sys.executable, "-m", "jaxrl_llm.train", f"--config={QUICKSTART}"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stderr[-4000:]
    run = tmp_path / "runs" / "quickstart"
    records = [json.loads(line) for line in open(run / "metrics.jsonl")]
    vals = [(r["training/global_step"], r[KEY]) for r in records if KEY in r]
    assert vals[0][0] == 0, "validation before training is the baseline"
    before, after = vals[0][1], vals[-1][1]
    print(f"quickstart: held-out accuracy {before:.3f} -> {after:.3f}")
    assert after - before >= 0.20, vals
    assert "GRPO" in proc.stderr  # the progress bar
    assert any(p.name.startswith("events") for p in (run / "tensorboard").iterdir())
    assert sorted(int(p.name) for p in (run / "checkpoints").iterdir() if p.name.isdigit())
    assert (run / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (run / "hf_actor" / "model.safetensors").exists()
    assert json.loads(proc.stdout.strip().splitlines()[-1])["final_validation"][KEY] == after
