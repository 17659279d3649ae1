"""Build the PEFT LoRA fixture under tests/fixtures/models/qwen2_lora/.

`peft` puts rank-4 adapters (alpha 8, all seven projections of every layer) on the tiny
transformers `qwen2` fixture (tests/fixtures/models/qwen2, made by make_model_fixtures.py),
overwrites A and B with seeded random values (a fresh B is zero, which would test nothing), and
saves them with `PeftModel.save_pretrained`: exactly the `adapter_config.json` and
`adapter_model.safetensors` peft writes. `reference.npz` holds the base fixture's `input_ids`
[2, 16] and the PEFT model's fp32 `logits` on them. The tests load these files into our models
(`models.load_peft_adapter`) and compare; they never import torch or peft.

    pip install torch transformers peft
    HF_HUB_OFFLINE=1 python scripts/make_lora_fixture.py            # writes the fixture
    python scripts/make_lora_fixture.py --dry-run                    # prints the folder it would write

Made with torch 2.14.1, transformers 5.24.0 and peft 0.21.2 (CPU).
"""
from __future__ import annotations

import argparse
import os
import shutil

FIXTURES = os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures", "models")
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
RANK, ALPHA, SEED = 4, 8.0, 7


def build(fixtures: str) -> str:
    import numpy as np
    import peft
    import torch
    import transformers

    base = os.path.join(fixtures, "qwen2")
    out = os.path.join(fixtures, "qwen2_lora")
    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    cfg = peft.LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=TARGETS, lora_dropout=0.0,
                          bias="none", task_type="CAUSAL_LM")
    model = peft.get_peft_model(model, cfg).eval()
    g = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(0.2 * torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
    shutil.rmtree(out, ignore_errors=True)
    model.peft_config["default"].base_model_name_or_path = "tests/fixtures/models/qwen2"
    model.save_pretrained(out)
    os.chmod(os.path.join(out, "adapter_model.safetensors"), 0o644)
    ids = np.load(os.path.join(base, "reference.npz"))["input_ids"]
    with torch.no_grad():
        logits = model(torch.from_numpy(ids).long()).logits.float().numpy()
    np.savez(os.path.join(out, "reference.npz"), input_ids=ids, logits=logits)
    readme = os.path.join(out, "README.md")
    if os.path.exists(readme):
        os.remove(readme)  # peft's model card template: nothing the tests read
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=FIXTURES, help="the fixtures folder (holds qwen2/)")
    p.add_argument("--dry-run", action="store_true", help="print the folder, build nothing")
    args = p.parse_args(argv)
    if args.dry_run:
        print(os.path.join(args.out, "qwen2_lora"))
        return
    print(build(args.out))


if __name__ == "__main__":
    main()
