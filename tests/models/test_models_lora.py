"""LoRA adapters on our decoder: exact no-op when fresh, merged weights equal the adapter
forward, and PEFT's format both ways (the fixture was written by peft itself, see
scripts/make_lora_fixture.py; with peft installed, peft also loads our export)."""
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl_llm import models
from jaxrl_llm.models._hf import _SafetensorsFolder

FIXTURES = os.path.join(os.path.dirname(__file__), "..", "fixtures", "models")
BASE, ADAPTER = os.path.join(FIXTURES, "qwen2"), os.path.join(FIXTURES, "qwen2_lora")


def _ids():
    return jnp.asarray(np.load(os.path.join(ADAPTER, "reference.npz"))["input_ids"])


def _randomize(model, scale=0.1, seed=1):
    graphdef, adapters, base = models.split_lora(model)
    keys = iter(jax.random.split(jax.random.key(seed), len(jax.tree.leaves(adapters))))
    adapters = jax.tree.map(lambda x: x + scale * jax.random.normal(next(keys), x.shape), adapters)
    return nnx.merge(graphdef, adapters, base)


def test_fresh_adapters_change_nothing_and_merged_weights_equal_the_adapter_forward():
    model = models.from_pretrained(BASE)
    before = model(_ids())
    models.add_lora(model, models.LoraSpec(rank=4, alpha=8.0))
    np.testing.assert_array_equal(np.asarray(model(_ids())), np.asarray(before))  # B = 0
    model = _randomize(model)
    after = model(_ids())
    assert float(jnp.abs(after - before).max()) > 1e-2
    merged = models.merged_model(model)
    assert merged.lora_spec is None and "lora_a" not in str(nnx.to_pure_dict(nnx.state(merged)))
    np.testing.assert_allclose(np.asarray(merged(_ids())), np.asarray(after), atol=2e-5)


def test_peft_adapter_written_by_peft_loads_with_peft_logits():
    model = models.load_peft_adapter(models.from_pretrained(BASE), ADAPTER)
    assert model.lora_spec.rank == 4 and model.lora_spec.scale == 2.0
    assert model.lora_spec.target_modules == tuple(models.LORA_TARGETS)
    want = np.load(os.path.join(ADAPTER, "reference.npz"))["logits"]
    np.testing.assert_allclose(np.asarray(model(_ids())), want, atol=2e-5)


def test_peft_export_writes_peft_names_layouts_and_values(tmp_path):
    model = models.load_peft_adapter(models.from_pretrained(BASE), ADAPTER)
    models.save_peft_adapter(model, str(tmp_path), base_model_name_or_path="qwen2")
    ours, theirs = _SafetensorsFolder(str(tmp_path)), _SafetensorsFolder(ADAPTER)
    assert ours.names() == theirs.names()
    for name in theirs.names():
        np.testing.assert_array_equal(ours.get(name), theirs.get(name))
    ours_cfg = json.load(open(tmp_path / "adapter_config.json"))
    peft_cfg = json.load(open(os.path.join(ADAPTER, "adapter_config.json")))
    for key in ("peft_type", "task_type", "r", "lora_alpha", "bias", "fan_in_fan_out", "use_rslora"):
        assert ours_cfg[key] == peft_cfg[key], key
    assert sorted(ours_cfg["target_modules"]) == sorted(peft_cfg["target_modules"])


def test_peft_loads_our_export_onto_the_transformers_base_with_our_logits(tmp_path):
    peft = pytest.importorskip("peft")  # dev extra only; CI relies on the fixture tests above
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    model = models.from_pretrained(BASE)
    models.add_lora(model, models.LoraSpec(rank=2, alpha=6.0, target_modules=("q_proj", "o_proj", "down_proj")))
    model = _randomize(model, seed=3)
    models.save_peft_adapter(model, str(tmp_path))
    hf = transformers.AutoModelForCausalLM.from_pretrained(BASE, dtype=torch.float32)
    loaded = peft.PeftModel.from_pretrained(hf, str(tmp_path)).eval()
    with torch.no_grad():
        theirs = loaded(torch.from_numpy(np.array(_ids())).long()).logits.numpy()
    np.testing.assert_allclose(theirs, np.asarray(model(_ids())), atol=2e-5)


def test_lora_config_errors_name_the_problem(tmp_path):
    with pytest.raises(ValueError, match="unknown module.*qkv"):
        models.LoraSpec(rank=4, alpha=8.0, target_modules=("qkv",))
    with pytest.raises(ValueError, match="rank must be >= 1"):
        models.LoraSpec(rank=0, alpha=8.0)
    with pytest.raises(ValueError, match="dropout"):
        models.LoraSpec(rank=4, alpha=8.0, dropout=0.1)
    with pytest.raises(FileNotFoundError, match="adapter_config.json"):
        models.load_peft_adapter(models.from_pretrained(BASE), str(tmp_path))
    cfg = json.load(open(os.path.join(ADAPTER, "adapter_config.json")))
    (tmp_path / "adapter_config.json").write_text(json.dumps(dict(cfg, use_dora=True)))
    with pytest.raises(ValueError, match="use_dora"):
        models.load_peft_adapter(models.from_pretrained(BASE), str(tmp_path))
    model = models.add_lora(models.from_pretrained(BASE), models.LoraSpec(rank=4, alpha=8.0))
    with pytest.raises(ValueError, match="already has LoRA"):
        models.add_lora(model, models.LoraSpec(rank=4, alpha=8.0))
