"""The LoRA learning run: `configs/quickstart.py:lora` (rank-16 adapters, all-linear, on the
SFT-tuned base) must raise held-out arithmetic accuracy by at least 20 points over the warm start,
and leave the merged and the PEFT exports. The project's one LoRA learning run (CPU, minutes)."""
import json
import os
import subprocess
import sys

from trainer_helpers import QUICKSTART

KEY = "val-core/arithmetic/reward/mean@1"


def test_quickstart_lora_learns_arithmetic(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # a user's plain CPU
    proc = subprocess.run([sys.executable, "-m", "jaxrl_llm.train", f"--config={QUICKSTART}:lora,local",
                           "--config.trainer.progress_bar=False", "--config.trainer.plot=False"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stderr[-4000:]
    run = tmp_path / "runs" / "quickstart-lora"
    records = [json.loads(line) for line in open(run / "metrics.jsonl")]
    vals = [(r["training/global_step"], r[KEY]) for r in records if KEY in r]
    assert vals[0][0] == 0, "validation before training is the baseline"
    before, after = vals[0][1], vals[-1][1]
    print(f"quickstart lora: held-out accuracy {before:.3f} -> {after:.3f}")
    assert after - before >= 0.20, vals
    assert (run / "hf_actor" / "model.safetensors").exists()
    assert (run / "lora_adapter" / "adapter_model.safetensors").exists()
