"""LoRA adapters in Hugging Face PEFT's folder format: `adapter_config.json` +
`adapter_model.safetensors`, loadable with `peft.PeftModel.from_pretrained(base, folder)` onto the
transformers base model (and back into ours with `load_peft_adapter`).

Tensor names and layouts (ours -> PEFT), per layer `i` and target `proj` of `self_attn` / `mlp`:
  lora_a [*in, r]  -> `base_model.model.model.layers.{i}.<self_attn|mlp>.<proj>.lora_A.weight` [r, prod(in)]
  lora_b [r, *out] -> `...<proj>.lora_B.weight` [prod(out), r]
(flattened in the order of the kernel's own `[out, in]` Hugging Face layout, see `_hf.py`).
PEFT scales by `lora_alpha / r`, as we do. The safetensors I/O is `_hf.py`'s.
"""
from __future__ import annotations

import json
import os

import jax
import numpy as np
from flax import nnx

from sharding import to_host

from ._decoder import CausalLM
from ._hf import _SafetensorsFolder, _write_safetensors
from ._lora import LORA_TARGETS, LoraSpec, _layer_modules, add_lora

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def _hf_name(layer: int, proj: str, which: str) -> str:
    owner = LORA_TARGETS[proj][0]
    return f"base_model.model.model.layers.{layer}.{owner}.{proj}.lora_{which}.weight"


def save_peft_adapter(model, path: str, *, base_model_name_or_path: str = "") -> None:
    """Writes `model`'s LoRA adapters (CausalLM with `add_lora`) as a PEFT adapter folder. In a
    multi-host run every process must call this (gathers are collective); process 0 writes."""
    spec = model.lora_spec
    if spec is None:
        raise ValueError("save_peft_adapter: the model has no LoRA adapters (models.add_lora)")
    if not isinstance(model, CausalLM):
        raise ValueError("save_peft_adapter: only causal LMs are exported in PEFT's format, got "
                         f"{type(model).__name__}")
    tensors = []
    stacked = hasattr(model.model.layers, "self_attn")
    for li, layer in enumerate(_layer_modules(model)):
        for proj in spec.target_modules:
            p = getattr(getattr(layer, LORA_TARGETS[proj][0]), proj)
            a = to_host(p["lora_a"][...])
            b = to_host(p["lora_b"][...])
            for i in range(a.shape[0] if stacked else 1):
                ai, bi = (a[i], b[i]) if stacked else (a, b)
                index = i if stacked else li
                r = ai.shape[-1]
                hf_a = np.ascontiguousarray(ai.reshape(-1, r).T)
                hf_b = np.ascontiguousarray(bi.reshape(r, -1).T)
                for which, arr in (("A", hf_a), ("B", hf_b)):
                    tensors.append((_hf_name(index, proj, which), arr.shape, arr.dtype,
                                    lambda arr=arr: arr))
    if jax.process_index() != 0:
        return
    os.makedirs(path, exist_ok=True)
    _write_safetensors(os.path.join(path, ADAPTER_WEIGHTS), tensors)
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": int(spec.rank),
        "lora_alpha": float(spec.alpha), "lora_dropout": float(spec.dropout),
        "target_modules": list(spec.target_modules), "bias": "none", "fan_in_fan_out": False,
        "use_rslora": False, "use_dora": False, "init_lora_weights": True, "inference_mode": True,
        "modules_to_save": None, "layers_to_transform": None, "rank_pattern": {}, "alpha_pattern": {},
        "base_model_name_or_path": base_model_name_or_path or None,
    }
    with open(os.path.join(path, ADAPTER_CONFIG), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)


def read_peft_config(path: str) -> LoraSpec:
    """The LoraSpec of a PEFT adapter folder; raises on what we cannot represent."""
    file = os.path.join(path, ADAPTER_CONFIG)
    if not os.path.exists(file):
        raise FileNotFoundError(f"{file} not found: a PEFT adapter folder needs {ADAPTER_CONFIG}")
    with open(file) as f:
        cfg = json.load(f)
    if cfg.get("peft_type") != "LORA":
        raise ValueError(f"{file}: peft_type={cfg.get('peft_type')!r}; only LORA adapters are supported")
    for key, ok in (("use_rslora", False), ("use_dora", False), ("bias", "none"),
                    ("fan_in_fan_out", False), ("modules_to_save", None),
                    ("layers_to_transform", None)):
        if cfg.get(key, ok) != ok:
            raise ValueError(f"{file}: {key}={cfg[key]!r} is not supported (expected {ok!r})")
    if cfg.get("rank_pattern") or cfg.get("alpha_pattern"):
        raise ValueError(f"{file}: per-module rank_pattern / alpha_pattern are not supported")
    targets = cfg["target_modules"]
    return LoraSpec(rank=int(cfg["r"]), alpha=float(cfg["lora_alpha"]),
                    target_modules=targets if isinstance(targets, str) else tuple(targets))


def load_peft_adapter(model, path: str, *, mesh=None, rules=None):
    """Adds the adapters of a PEFT folder to `model` (a CausalLM without adapters) and returns it.
    Raises ValueError naming a missing or mis-shaped tensor."""
    spec = read_peft_config(path)
    add_lora(model, spec, mesh=mesh, rules=rules)
    files = _SafetensorsFolder(path)
    used = set()
    stacked = hasattr(model.model.layers, "self_attn")
    for li, layer in enumerate(_layer_modules(model)):
        for proj in spec.target_modules:
            p = getattr(getattr(layer, LORA_TARGETS[proj][0]), proj)
            for key, which in (("lora_a", "A"), ("lora_b", "B")):
                var = p[key]
                shape = tuple(var.shape)
                n = shape[0] if stacked else 1
                layer_shape = shape[1:] if stacked else shape
                arrays = []
                for i in range(n):
                    name = _hf_name(i if stacked else li, proj, which)
                    if name not in files.names():
                        raise ValueError(f"{path}: adapter tensor {name!r} is missing")
                    w = np.asarray(files.get(name))
                    r = spec.rank
                    want = ((r, int(np.prod(layer_shape[:-1]))) if which == "A"
                            else (int(np.prod(layer_shape[1:])), r))
                    if w.shape != want:
                        raise ValueError(f"{path}: tensor {name!r} has shape {w.shape}, expected {want}")
                    ours = w.T.reshape(layer_shape)
                    arrays.append(ours)
                    used.add(name)
                value = np.stack(arrays) if stacked else arrays[0]
                old = var.get_value()
                var.set_value(jax.device_put(value.astype(old.dtype), old.sharding))
    extra = sorted(files.names() - used)
    if extra:
        raise ValueError(f"{path}: {len(extra)} adapter tensor(s) this model does not use: {extra[:4]}")
    return model


__all__ = ["save_peft_adapter", "load_peft_adapter", "read_peft_config", "ADAPTER_CONFIG",
           "ADAPTER_WEIGHTS"]
