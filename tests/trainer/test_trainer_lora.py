"""A LoRA run end to end (tiny model, local workers, SFT warm start, KL to the reference):
checkpoints hold adapters + optimizer state and a reference to the base, a killed run resumes
exactly, and the exports are the merged model and a PEFT adapter folder that reproduce it."""
import json
import os
import shutil

import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm import models
from jaxrl_llm.config import load_config
from jaxrl_llm.trainer import RLTrainer

from trainer_helpers import QUICKSTART, tiny_overrides

_NONDETERMINISTIC = ("timing_s/", "timing_per_token_ms/", "perf/", "rollout/sync_time_s")


def _config(run_dir, **extra):
    extra = {"trainer.total_training_steps": 3, "trainer.save_freq": 2, "trainer.test_freq": 3,
             "actor.use_kl_loss": True, "actor.lora.rank": 4, "actor.lora.alpha": 8.0,
             "actor.optim.lr": 1e-3, **extra}
    return load_config(f"{QUICKSTART}:tiny,local", tiny_overrides(run_dir, **extra))


def _steps(run_dir):
    out = {}
    for line in open(os.path.join(run_dir, "metrics.jsonl")):
        rec = json.loads(line)
        out[rec["training/global_step"]] = {k: v for k, v in rec.items()
                                            if not k.startswith(_NONDETERMINISTIC)}
    return out


class _Killed(RuntimeError):
    pass


class _KilledAfter(RLTrainer):
    def save_checkpoint(self):
        super().save_checkpoint()
        if self.global_step == 2:
            raise _Killed("simulated preemption")


def test_lora_run_checkpoints_adapters_only_resumes_exactly_and_exports_peft(tmp_path):
    full_dir, cut_dir = tmp_path / "full", tmp_path / "cut"
    RLTrainer(_config(full_dir, **{"trainer.export_hf": True})).fit()
    full = _steps(full_dir)
    assert full[3]["actor/kl_loss"] > 0  # the trained adapters moved away from the base reference
    # the SFT-tuned base is written once and referenced; checkpoints hold no base weights
    base = full_dir / "lora_base"
    meta = json.loads((full_dir / "checkpoints" / "2" / "meta" / "metadata").read_text())
    assert meta["lora_base"]["path"].endswith("lora_base") and len(meta["lora_base"]["fingerprint"]) == 2
    assert (base / "model.safetensors").exists()
    saved = json.loads((full_dir / "checkpoints" / "2" / "state" / "_METADATA").read_text())["tree_metadata"]
    arrays = [k for k in saved if "'params'" in k or "'mu'" in k or "'nu'" in k]
    assert arrays and all("'lora_a'" in k or "'lora_b'" in k for k in arrays), arrays[:4]
    assert not any(k.startswith("('ref'") for k in saved)  # no reference copy either

    with pytest.raises(_Killed):
        _KilledAfter(_config(cut_dir)).fit()
    RLTrainer(_config(cut_dir)).fit()  # resumes at step 2: reloads the base from lora_base/
    resumed = _steps(cut_dir)
    assert resumed[3].keys() == full[3].keys()
    for key, value in full[3].items():
        assert resumed[3][key] == pytest.approx(value, rel=1e-5, abs=1e-6), key

    # exports: the merged model, and base + PEFT adapter giving the same logits
    merged = models.from_pretrained(str(full_dir / "hf_actor"))
    adapted = models.load_peft_adapter(models.from_pretrained(str(base)), str(full_dir / "lora_adapter"))
    ids = jnp.asarray(np.arange(24, dtype=np.int32).reshape(2, 12) % 20 + 1)
    np.testing.assert_allclose(np.asarray(adapted(ids)), np.asarray(merged(ids)), atol=1e-4)
    cfg = json.loads((full_dir / "lora_adapter" / "adapter_config.json").read_text())
    assert cfg["r"] == 4 and cfg["lora_alpha"] == 8.0 and cfg["base_model_name_or_path"].endswith("lora_base")

    # a base that changed since the checkpoint (here: its folder now holds other weights) is refused
    shutil.copy(full_dir / "hf_actor" / "model.safetensors", base / "model.safetensors")
    other = _config(tmp_path / "b", **{"trainer.resume_mode": str(full_dir / "checkpoints" / "2")})
    with pytest.raises(Exception, match="base weights differ"):
        RLTrainer(other).fit()
