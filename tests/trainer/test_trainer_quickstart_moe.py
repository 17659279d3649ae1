"""The MoE learning run: `configs/quickstart.py:moe` (every MLP a Qwen3-MoE sparse block, 4
experts, top-2, load-balancing loss 0.01) must raise held-out arithmetic accuracy by at least 20
points over the SFT warm start, log the router losses and the expert load, and export a
Qwen3-MoE checkpoint that transformers' config reading accepts. The project's one MoE learning run
(CPU, minutes)."""
import json
import os
import subprocess
import sys

import pytest

from jaxrl_llm.config import ConfigError, load_config
from trainer_helpers import QUICKSTART

KEY = "val-core/arithmetic/reward/mean@1"


def test_quickstart_moe_learns_arithmetic(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # a user's plain CPU
    proc = subprocess.run([sys.executable, "-m", "jaxrl_llm.train", f"--config={QUICKSTART}:moe,local",
                           "--config.trainer.progress_bar=False", "--config.trainer.plot=False"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stderr[-4000:]
    run = tmp_path / "runs" / "quickstart-moe"
    records = [json.loads(line) for line in open(run / "metrics.jsonl")]
    vals = [(r["training/global_step"], r[KEY]) for r in records if KEY in r]
    assert vals[0][0] == 0, "validation before training is the baseline"
    before, after = vals[0][1], vals[-1][1]
    print(f"quickstart moe: held-out accuracy {before:.3f} -> {after:.3f}")
    assert after - before >= 0.20, vals
    steps = [r for r in records if "actor/moe_aux_loss" in r]
    assert len(steps) == 40 and all(r["actor/moe_aux_loss"] > 0 for r in steps)
    # each expert's share of the routed tokens over the mean share: 1 everywhere is an even load
    assert all(0 < r["moe/expert_load/min"] <= 1 <= r["moe/expert_load/max"] <= 4 for r in steps)
    hf = json.loads((run / "hf_actor" / "config.json").read_text())
    assert hf["model_type"] == "qwen3_moe" and hf["num_experts"] == 4 and hf["num_experts_per_tok"] == 2


@pytest.mark.parametrize("overrides, match", [
    (["model.init.model_type=qwen3_moe"], r"model\.init\.num_experts and model\.init\.moe_intermediate_size"),
    (["model.init.model_type=mixtral", "model.init.num_experts=4", "model.init.moe_intermediate_size=8",
      "model.init.num_experts_per_tok=5"], r"num_experts_per_tok must be in \[1, model\.init\.num_experts=4\]"),
    (["model.init.num_experts=4"], r"for model_type qwen3_moe or mixtral; model\.init\.model_type is 'qwen2'"),
    (["model.init.model_type=gpt2"], r"model\.init\.model_type='gpt2'"),
    (["model.init.decoder_sparse_step=2"], r"decoder_sparse_step=2 \(dense layers among sparse ones\) are for "
                                           r"model_type qwen3_moe; model\.init\.model_type is 'qwen2'"),
    (["model.init.model_type=qwen3_moe", "model.init.num_experts=4", "model.init.moe_intermediate_size=8",
      "model.init.num_experts_per_tok=2", "model.init.mlp_only_layers=[0,1]"], r"no layer of the 2 has experts"),
    (["model.init.model_type=qwen3_moe", "model.init.num_experts=4", "model.init.moe_intermediate_size=8",
      "model.init.num_experts_per_tok=2", "model.init.mlp_only_layers=[5]"], r"layer indices in \[0, 1\]"),
])
def test_bad_moe_init_names_the_field(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_config(QUICKSTART, overrides)


def test_moe_variant_builds_a_sparse_model():
    from jaxrl_llm.workers._common import model_config_for

    c = load_config(QUICKSTART + ":tiny,moe")
    cfg = model_config_for(c.model, 64)
    assert cfg.is_moe and cfg.num_experts == 4 and cfg.num_experts_per_tok == 2 and cfg.qk_norm
    assert cfg.moe_intermediate_size == c.model.init.intermediate_size // 2
    assert c.trainer.default_local_dir.endswith("quickstart-tiny-moe")
    mixed = model_config_for(load_config(QUICKSTART + ":tiny,moe", ["model.init.mlp_only_layers=[0]"]).model, 64)
    assert mixed.sparse_layers == tuple(range(1, c.model.init.num_hidden_layers)) and mixed.mixed_layers
