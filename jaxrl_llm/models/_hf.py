"""Hugging Face checkpoints: `config.json` <-> `ModelConfig`, safetensors <-> the stacked NNX model.

`from_pretrained` reads a folder written by transformers (one `*.safetensors` file, or several
with `model.safetensors.index.json`) straight into the stacked layout: every parameter is built
from memory-mapped file slices by `jax.make_array_from_callback`, so each device only receives
its own shard (optionally laid out by `sharding` rules on a mesh) and no random model is built
first. `save_pretrained` writes what transformers writes (tensor names `model.layers.{i}.…`,
Linear weights `[out, in]`, tied embeddings without `lm_head.weight`, shards with an index).

Layout mapping (ours <- HF), per layer `i`:
  q/k/v kernel [e, heads, d]   <- `self_attn.{q,k,v}_proj.weight` [heads*d, e] (transposed, split)
  o kernel     [heads, d, e]   <- `self_attn.o_proj.weight` [e, heads*d]
  mlp kernels  [e, f] / [f, e] <- `mlp.{gate,up,down}_proj.weight` (transposed)
  norm scales, biases          <- `*.weight` / `*.bias` (biases of q/k/v split into [heads, d])
  lm_head.kernel [e, v] <- `lm_head.weight` [v, e]; score.kernel [e, 1] <- `score.weight` [1, e].

The safetensors format is read and written here directly (a JSON header plus raw little-endian
bytes), which keeps bfloat16 and memory mapping simple. Tokenizers live in `_tokenizer.py`.
"""
from __future__ import annotations

import json
import logging
import math
import os
import re
import shutil
import struct
from collections.abc import Callable, Iterable
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx

from sharding import to_host

from ._config import ModelConfig, RopeScaling, to_dtype
from ._decoder import CausalLM, ValueModel, abstract_model

log = logging.getLogger(__name__)

# ---------------------------------------------------------------------------------------------
# config.json
# ---------------------------------------------------------------------------------------------

_ARCH = {  # architecture -> (model_type, value_head)
    "LlamaForCausalLM": ("llama", False), "LlamaForTokenClassification": ("llama", True),
    "Qwen2ForCausalLM": ("qwen2", False), "Qwen2ForTokenClassification": ("qwen2", True),
    "Qwen3ForCausalLM": ("qwen3", False), "Qwen3ForTokenClassification": ("qwen3", True),
    "Qwen3MoeForCausalLM": ("qwen3_moe", False), "Qwen3MoeForTokenClassification": ("qwen3_moe", True),
    "MixtralForCausalLM": ("mixtral", False), "MixtralForTokenClassification": ("mixtral", True),
}
_ARCH_NAME = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3", "qwen3_moe": "Qwen3Moe", "mixtral": "Mixtral"}
_TORCH_DTYPE = {jnp.float32: "float32", jnp.bfloat16: "bfloat16", jnp.float16: "float16"}


def _architecture(hf: dict) -> tuple[str, bool]:
    """(model_type, value_head) from `architectures` (or `model_type` when that is absent)."""
    archs = hf.get("architectures") or []
    if archs:
        if len(archs) != 1 or archs[0] not in _ARCH:
            raise ValueError(f"config.json: unsupported architectures={archs}; supported: {sorted(_ARCH)}")
        model_type, value_head = _ARCH[archs[0]]
        if hf.get("model_type", model_type) != model_type:
            raise ValueError(f"config.json: model_type={hf['model_type']!r} does not match "
                             f"architectures={archs}")
        return model_type, value_head
    if hf.get("model_type") not in _ARCH_NAME:
        raise ValueError(f"config.json: unsupported model_type={hf.get('model_type')!r}; "
                         f"supported: {sorted(_ARCH_NAME)}")
    return hf["model_type"], False


def _rope(hf: dict) -> tuple[float, RopeScaling | None]:
    """RoPE theta and scaling from `rope_theta`/`rope_scaling` or transformers-5 `rope_parameters`."""
    params = hf.get("rope_parameters")
    if params is not None:
        if "full_attention" in params and isinstance(params["full_attention"], dict):
            params = params["full_attention"]  # per-layer-type layout
        theta = params.get("rope_theta", hf.get("rope_theta"))
        scaling = params
    else:
        theta = hf.get("rope_theta", 10000.0)
        scaling = hf.get("rope_scaling")
    if theta is None:
        raise ValueError("config.json: rope_parameters has no rope_theta")
    if not scaling:
        return float(theta), None
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return float(theta), None
    if kind != "llama3":
        raise ValueError(f"config.json: rope type {kind!r} is not supported (only 'default' and "
                         f"'llama3')")
    try:
        rs = RopeScaling(factor=float(scaling["factor"]),
                         low_freq_factor=float(scaling["low_freq_factor"]),
                         high_freq_factor=float(scaling["high_freq_factor"]),
                         original_max_position_embeddings=int(scaling["original_max_position_embeddings"]))
    except KeyError as e:
        raise ValueError(f"config.json: llama3 rope scaling lacks field {e.args[0]!r}") from None
    return float(theta), rs


def _require(hf: dict, name: str):
    if name not in hf:
        raise ValueError(f"config.json: missing field {name!r}")
    return hf[name]


def _moe_fields(hf: dict, model_type: str) -> dict:
    """The ModelConfig MoE fields of a Qwen3-MoE / Mixtral config.json ({} for dense types),
    Qwen3-MoE's dense layers (`mlp_only_layers`, `decoder_sparse_step`) included."""
    if model_type == "mixtral":
        if hf.get("sliding_window") is not None:
            raise ValueError(f"config.json: sliding_window={hf['sliding_window']} is not supported "
                             f"(sliding-window attention); it must be null")
        experts = _require(hf, "num_local_experts")
        width = int(_require(hf, "intermediate_size"))
        normalize = True  # Mixtral always renormalises over the chosen experts
    elif model_type == "qwen3_moe":
        experts = hf.get("num_experts", hf.get("num_local_experts"))  # transformers 5 writes the latter
        if experts is None:
            raise ValueError("config.json: missing field 'num_experts' (or 'num_local_experts')")
        width = int(_require(hf, "moe_intermediate_size"))
        normalize = bool(hf.get("norm_topk_prob", False))
        mixing = dict(mlp_only_layers=tuple(hf.get("mlp_only_layers") or ()),
                      decoder_sparse_step=hf.get("decoder_sparse_step", 1))
    else:
        return {}
    return dict(num_experts=int(experts), num_experts_per_tok=int(_require(hf, "num_experts_per_tok")),
                moe_intermediate_size=width, norm_topk_prob=normalize,
                router_aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.001)),
                **(mixing if model_type == "qwen3_moe" else {}))


def config_from_hf(hf: dict, **overrides) -> ModelConfig:
    """`ModelConfig` from a Hugging Face `config.json` dict. `overrides` replace fields (e.g. dtype)."""
    model_type, value_head = _architecture(hf)
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"config.json: hidden_act={hf['hidden_act']!r} is not supported (only 'silu')")
    if hf.get("mlp_bias"):
        raise ValueError("config.json: mlp_bias=true is not supported")
    if hf.get("use_sliding_window") or any(t != "full_attention" for t in hf.get("layer_types") or ()):
        raise ValueError("config.json: sliding-window attention (use_sliding_window / layer_types) "
                         "is not supported")
    if value_head and hf.get("num_labels", len(hf.get("id2label") or {0: 0})) != 1:
        raise ValueError(f"config.json: a value model needs num_labels=1 (id2label has "
                         f"{len(hf.get('id2label') or {})} entries)")
    theta, scaling = _rope(hf)
    heads = int(_require(hf, "num_attention_heads"))
    moe = _moe_fields(hf, model_type)
    eos = hf.get("eos_token_id")
    fields = dict(
        vocab_size=int(_require(hf, "vocab_size")),
        hidden_size=int(_require(hf, "hidden_size")),
        intermediate_size=int(_require(hf, "intermediate_size")),
        num_hidden_layers=int(_require(hf, "num_hidden_layers")),
        num_attention_heads=heads,
        num_key_value_heads=int(hf.get("num_key_value_heads") or heads),
        head_dim=hf.get("head_dim"),
        model_type=model_type,
        rope_theta=theta,
        rope_scaling=scaling,
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        attention_bias=True if model_type == "qwen2" else bool(hf.get("attention_bias", False)),
        qk_norm=model_type in ("qwen3", "qwen3_moe"),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_id=tuple(eos) if isinstance(eos, list) else eos,
        pad_token_id=hf.get("pad_token_id"),
        **moe,
    )
    fields.update(overrides)
    try:
        return ModelConfig(**fields)
    except ValueError as e:
        raise ValueError(f"config.json: {e}") from None


def config_to_hf(config: ModelConfig, *, value_head: bool = False) -> dict:
    """The `config.json` dict transformers writes for `config` (both rope layouts are written:
    `rope_theta`/`rope_scaling` for transformers 4, `rope_parameters` for transformers 5)."""
    c = config
    if c.model_type == "qwen2":
        if not c.attention_bias:
            raise ValueError("a qwen2 config must have attention_bias=True (HF Qwen2 always has q/k/v biases)")
        if c.head_dim != c.hidden_size // c.num_attention_heads:
            raise ValueError("qwen2 needs head_dim == hidden_size // num_attention_heads; use qwen3 or llama")
    if c.qk_norm != (c.model_type in ("qwen3", "qwen3_moe")):
        raise ValueError(f"qk_norm={c.qk_norm} cannot be expressed for model_type={c.model_type!r}")
    if c.model_type == "mixtral" and c.moe_intermediate_size != c.intermediate_size:
        raise ValueError("mixtral needs moe_intermediate_size == intermediate_size (its experts' width)")
    if c.model_type == "mixtral" and not c.norm_topk_prob:
        raise ValueError("mixtral always renormalises the top-k router weights: norm_topk_prob must be True")
    if c.attention_bias and c.model_type in ("qwen3", "qwen3_moe", "mixtral"):
        raise ValueError("HF Qwen3 attention_bias adds an o_proj bias that this decoder lacks")
    arch = _ARCH_NAME[c.model_type] + ("ForTokenClassification" if value_head else "ForCausalLM")
    dtype_name = _TORCH_DTYPE.get(c.param_dtype, "float32")
    rope = None
    if c.rope_scaling is not None:
        rs = c.rope_scaling
        rope = dict(rope_type=rs.rope_type, factor=rs.factor, low_freq_factor=rs.low_freq_factor,
                    high_freq_factor=rs.high_freq_factor,
                    original_max_position_embeddings=rs.original_max_position_embeddings)
    eos = c.eos_token_id
    hf = dict(
        architectures=[arch], model_type=c.model_type,
        vocab_size=c.vocab_size, hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size, num_hidden_layers=c.num_hidden_layers,
        num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_key_value_heads,
        head_dim=c.head_dim, hidden_act="silu",
        max_position_embeddings=c.max_position_embeddings, rms_norm_eps=c.rms_norm_eps,
        rope_theta=c.rope_theta, rope_scaling=rope,
        rope_parameters=dict(rope or {"rope_type": "default"}, rope_theta=c.rope_theta),
        tie_word_embeddings=c.tie_word_embeddings, attention_dropout=0.0,
        initializer_range=0.02, use_cache=True,
        bos_token_id=c.bos_token_id, eos_token_id=list(eos) if isinstance(eos, tuple) else eos,
        pad_token_id=c.pad_token_id, torch_dtype=dtype_name, dtype=dtype_name,
    )
    if c.model_type == "qwen2":
        del hf["head_dim"]  # transformers' Qwen2 derives it from hidden_size / num_attention_heads
    if c.model_type == "llama":
        hf.update(attention_bias=c.attention_bias, mlp_bias=False, pretraining_tp=1)
    elif c.is_moe:
        hf.update(num_local_experts=c.num_experts, num_experts_per_tok=c.num_experts_per_tok,
                  output_router_logits=False, router_aux_loss_coef=c.router_aux_loss_coef,
                  sliding_window=None)
        if c.model_type == "mixtral":
            hf.update(router_jitter_noise=0.0)
            if c.head_dim == c.hidden_size // c.num_attention_heads:
                hf["head_dim"] = None  # as transformers writes it (derived from hidden / heads)
        else:
            hf.update(num_experts=c.num_experts, moe_intermediate_size=c.moe_intermediate_size,
                      norm_topk_prob=c.norm_topk_prob, decoder_sparse_step=c.decoder_sparse_step,
                      mlp_only_layers=list(c.mlp_only_layers),
                      attention_bias=False, use_sliding_window=False)
    else:
        hf.update(use_sliding_window=False, sliding_window=None,
                  max_window_layers=28,
                  layer_types=["full_attention"] * c.num_hidden_layers)
        if c.model_type == "qwen3":
            hf["attention_bias"] = False
    if value_head:
        hf.update(id2label={"0": "LABEL_0"}, label2id={"LABEL_0": 0})
    return hf


# ---------------------------------------------------------------------------------------------
# safetensors (header JSON + raw little-endian bytes)
# ---------------------------------------------------------------------------------------------

_ST_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
    "BOOL": np.bool_, "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2,
}
_ST_NAMES = {np.dtype(v): k for k, v in _ST_DTYPES.items()}


class _SafetensorsFolder:
    """Memory-mapped tensors of every `*.safetensors` file of a checkpoint folder, by name."""

    def __init__(self, path: str):
        index = os.path.join(path, "model.safetensors.index.json")
        if os.path.exists(index):
            with open(index) as f:
                files = sorted(set(json.load(f)["weight_map"].values()))
        else:
            files = sorted(n for n in os.listdir(path) if n.endswith(".safetensors"))
        if not files:
            raise FileNotFoundError(f"{path}: no *.safetensors file (and no model.safetensors.index.json)")
        self.where: dict[str, tuple[np.memmap, dict]] = {}
        for name in files:
            file = os.path.join(path, name)
            if not os.path.exists(file):
                raise FileNotFoundError(f"{file}: listed in model.safetensors.index.json but missing")
            mm = np.memmap(file, dtype=np.uint8, mode="r")
            (n,) = struct.unpack("<Q", bytes(mm[:8]))
            header = json.loads(bytes(mm[8:8 + n]))
            header.pop("__metadata__", None)
            for tensor, info in header.items():
                if tensor in self.where:
                    raise ValueError(f"{path}: tensor {tensor!r} appears in two files")
                info = dict(info, base=8 + n, file=name)
                self.where[tensor] = (mm, info)

    def names(self) -> set[str]:
        return set(self.where)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.where[name][1]["shape"])

    def get(self, name: str) -> np.ndarray:
        mm, info = self.where[name]
        if info["dtype"] not in _ST_DTYPES:
            raise ValueError(f"tensor {name!r} in {info['file']}: dtype {info['dtype']} is not supported")
        start, end = info["data_offsets"]
        raw = mm[info["base"] + start: info["base"] + end]
        return raw.view(_ST_DTYPES[info["dtype"]]).reshape(info["shape"])


def _write_safetensors(file: str, tensors: list[tuple[str, tuple[int, ...], Any, Callable[[], np.ndarray]]]):
    """Writes (name, shape, dtype, producer) entries, calling each producer once, in order."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape, dtype, _ in tensors:
        size = math.prod(shape) * np.dtype(dtype).itemsize
        header[name] = {"dtype": _ST_NAMES[np.dtype(dtype)], "shape": list(shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(file, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for name, shape, dtype, produce in tensors:
            arr = np.ascontiguousarray(produce(), dtype=dtype)
            if arr.shape != tuple(shape):
                raise AssertionError(f"{name}: produced shape {arr.shape}, expected {shape}")
            f.write(arr.tobytes())


# ---------------------------------------------------------------------------------------------
# name and layout mapping
# ---------------------------------------------------------------------------------------------

_IGNORED = re.compile(r"(^|\.)rotary_emb\.inv_freq$")


class _Entry:
    """One parameter of ours and the HF tensor(s) it comes from: one per layer when stacked, and
    one per expert for the stacked expert weights of a sparse MLP (`...experts.{j}.<name>`); the
    leading dims that index those tensors are `lead_shape`, the rest is one tensor's shape."""

    def __init__(self, path: tuple[str, ...], shape: tuple[int, ...], stacked: bool, experts: bool = False,
                 layer_ids: tuple[int, ...] | None = None):
        self.path, self.stacked = path, stacked
        self.layer_ids = layer_ids  # row r of a stack is HF layer layer_ids[r] (None: r)
        lead = int(stacked) + int(experts)
        self.lead_shape, self.layer_shape = tuple(shape[:lead]), tuple(shape[lead:])
        parts = list(path)
        leaf = parts.pop()
        self.kind = leaf
        self.n_in = 2 if parts[-1:] == ["o_proj"] else 1
        suffix = "bias" if leaf == "bias" else "weight"
        if experts:
            at = parts.index("experts") + 1
            parts = parts[:at] + ["{j}"] + parts[at:]
        if stacked:
            rest = parts[parts.index("layers") + 1:]
            rest = ["mlp"] + rest[1:] if rest[:1] == ["dense_mlp"] else rest  # HF names every MLP `mlp`
            self.template = ".".join(["model.layers.{i}"] + rest + [suffix])
        else:
            self.template = ".".join(parts + [suffix])
        self.num_layers = shape[0] if stacked else 1
        s = self.layer_shape
        if leaf == "kernel":
            self.hf_shape = (math.prod(s[self.n_in:]), math.prod(s[:self.n_in]))
        elif leaf == "embedding":
            self.hf_shape = tuple(s)
        else:
            self.hf_shape = (math.prod(s),)

    def lead_indices(self) -> list[tuple[int, ...]]:
        """The index into the leading dims of each HF tensor, in `hf_names` order."""
        return list(np.ndindex(*self.lead_shape)) if self.lead_shape else [()]

    def hf_names(self) -> list[str]:
        names = []
        for idx in self.lead_indices():
            keys = dict(zip(("i", "j") if self.stacked else ("j",), idx))
            if self.layer_ids is not None:
                keys["i"] = self.layer_ids[keys["i"]]
            names.append(self.template.format(**keys) if keys else self.template)
        return names

    def to_ours(self, w: np.ndarray) -> np.ndarray:
        """One HF tensor -> our per-layer layout (a view when numpy can make one)."""
        if self.kind == "kernel":
            return w.T.reshape(self.layer_shape)
        return w.reshape(self.layer_shape)

    def to_hf(self, x: np.ndarray) -> np.ndarray:
        if self.kind == "kernel":
            return x.reshape(math.prod(self.layer_shape[:self.n_in]), -1).T
        return x.reshape(self.hf_shape)


def _entries(state: nnx.State, config: ModelConfig) -> list[tuple[_Entry, nnx.Variable]]:
    out = []
    for path, var in nnx.to_flat_state(state):
        path = tuple(str(p) for p in path)
        axes = var.get_metadata().get("logical_axes") or ()
        stacked = bool(axes) and axes[0] == "layers"
        experts = "experts" in path and len(axes) > int(stacked) and axes[int(stacked)] == "expert"
        ids = None  # stacked mixed layers: the MLP stacks hold the sparse / dense layers only
        if stacked and config.mixed_layers:
            stack = path[path.index("layers") + 1]
            ids = {"mlp": config.sparse_layers, "dense_mlp": config.dense_layers}.get(stack)
        out.append((_Entry(path, tuple(var.get_value().shape), stacked, experts, ids), var))
    return out


# ---------------------------------------------------------------------------------------------
# loading
# ---------------------------------------------------------------------------------------------

def _read_config(path: str) -> dict:
    file = os.path.join(path, "config.json")
    if not os.path.exists(file):
        raise FileNotFoundError(f"{file} not found: a Hugging Face model folder needs config.json")
    with open(file) as f:
        return json.load(f)


def _check_tensors(entries, files: _SafetensorsFolder, *, fresh_score: bool, ignore: Iterable[str]):
    expected = {}
    for entry, _ in entries:
        if fresh_score and entry.path[0] == "score":
            continue
        for name in entry.hf_names():
            expected[name] = entry.hf_shape
    present = files.names()
    missing = sorted(set(expected) - present)
    if missing:
        raise ValueError(f"checkpoint is missing {len(missing)} tensor(s): {missing[:8]}"
                         + (" ..." if len(missing) > 8 else ""))
    extra = sorted(n for n in present - set(expected)
                   if not _IGNORED.search(n) and n not in set(ignore))
    if extra:
        raise ValueError(f"checkpoint has {len(extra)} unexpected tensor(s) this architecture does "
                         f"not use: {extra[:8]}" + (" ..." if len(extra) > 8 else ""))
    for name, shape in expected.items():
        if files.shape(name) != tuple(shape):
            raise ValueError(f"tensor {name!r} has shape {files.shape(name)}, expected {tuple(shape)}")


def _load_array(entry: _Entry, files: _SafetensorsFolder, dtype, sharding_) -> jax.Array:
    names = dict(zip(entry.lead_indices(), entry.hf_names()))
    lead = len(entry.lead_shape)
    shape = entry.lead_shape + tuple(entry.layer_shape)

    def one_layer(name, index):
        return np.asarray(entry.to_ours(files.get(name))[index]).astype(dtype)

    def callback(index):
        if not lead:
            return one_layer(names[()], index)
        ranges = [range(n)[sl] for n, sl in zip(entry.lead_shape, index[:lead])]
        out = np.empty(tuple(map(len, ranges)) + one_layer(names[(0,) * lead], tuple(index[lead:])).shape, dtype)
        for pos in np.ndindex(*out.shape[:lead]):
            out[pos] = one_layer(names[tuple(r[p] for r, p in zip(ranges, pos))], tuple(index[lead:]))
        return out

    return jax.make_array_from_callback(shape, sharding_, callback)


def _shardings_for(entries, mesh, rules):
    if mesh is None:
        single = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        return [single] * len(entries)
    import sharding  # the mesh / rules vocabulary; only needed when placing on a mesh

    rules = sharding.TRAIN_RULES if rules is None else rules
    return [sharding.logical_sharding(mesh, var.get_metadata().get("logical_axes") or
                                      (None,) * len(entry.layer_shape), rules,
                                      var.get_value().shape, name=entry.template.replace("{i}", "*").replace("{j}", "*"))
            for entry, var in entries]


def from_pretrained(path: str, dtype: Any = jnp.float32, *, param_dtype: Any = None,
                    value_head: bool | None = None, mesh: jax.sharding.Mesh | None = None,
                    rules: Any = None, seed: int = 0, **config_overrides) -> CausalLM | ValueModel:
    """Load a Hugging Face folder (config.json + safetensors) as a `CausalLM` or `ValueModel`.

    dtype: compute dtype; param_dtype: storage dtype of the parameters (default: `dtype`).
    value_head: None follows `architectures` (`*ForTokenClassification` -> ValueModel). With
      value_head=True on a causal-LM checkpoint the `score` head is freshly initialised
      (normal(0.02) kernel, zero bias; as transformers' AutoModelForTokenClassification does for a
      critic built from an actor) and `lm_head.weight` is ignored; a warning is logged.
    mesh, rules: place each parameter sharded as the `sharding` rules say (rules default to
      `sharding.TRAIN_RULES`); without a mesh everything goes to the first local device.
    config_overrides: replace ModelConfig fields (e.g. remat="full").
    `rotary_emb.inv_freq` buffers are skipped, and so is a redundant `lm_head.weight` next to
    tied embeddings (transformers ignores it too); any other unused tensor is an error.
    Raises ValueError naming the tensor for missing, unexpected or mis-shaped tensors.
    """
    hf = _read_config(path)
    _, arch_value = _architecture(hf)
    value_head = arch_value if value_head is None else value_head
    param_dtype = dtype if param_dtype is None else param_dtype
    config = config_from_hf(hf, dtype=dtype, param_dtype=param_dtype, **config_overrides)
    files = _SafetensorsFolder(path)
    fresh_score = value_head and not {"score.weight", "score.bias"} & files.names()
    ignore = ["lm_head.weight"] if (fresh_score or config.tie_word_embeddings) else []
    graphdef, state = nnx.split(abstract_model(config, value_head=value_head))
    entries = _entries(state, config)
    _check_tensors(entries, files, fresh_score=fresh_score, ignore=ignore)
    np_dtype = np.dtype(to_dtype(param_dtype))
    rng = np.random.default_rng(seed)
    for (entry, var), shard in zip(entries, _shardings_for(entries, mesh, rules)):
        if fresh_score and entry.path[0] == "score":
            init = (rng.normal(0, 0.02, entry.layer_shape) if entry.kind == "kernel"
                    else np.zeros(entry.layer_shape))
            var.set_value(jax.device_put(init.astype(np_dtype), shard))
        else:
            var.set_value(_load_array(entry, files, np_dtype, shard))
    if fresh_score:
        log.warning("%s: no score.* tensors; initialised a fresh value head", path)
    return nnx.merge(graphdef, state)


# ---------------------------------------------------------------------------------------------
# saving
# ---------------------------------------------------------------------------------------------

_SIZE_UNITS = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                    "chat_template.jinja", "generation_config.json", "vocab.json", "merges.txt",
                    "added_tokens.json", "jaxrl_char_tokenizer.json")


def _parse_size(size: int | str) -> int:
    if isinstance(size, int):
        return size
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]I?B)\s*", size.upper())
    if not m:
        raise ValueError(f"max_shard_size={size!r}: use bytes or a string like '5GB' / '500MB'")
    return int(float(m.group(1)) * _SIZE_UNITS[m.group(2)])


def save_pretrained(model: CausalLM | ValueModel, path: str, *, max_shard_size: int | str = "5GB",
                    dtype: Any = None, tokenizer: Any = None) -> None:
    """Write `model` as a Hugging Face folder: config.json + safetensors (+ index when sharded).

    dtype: storage dtype of the written tensors (default: the parameters' own). Tensors are
    split into `model-0000k-of-0000n.safetensors` files of at most `max_shard_size` bytes (a
    single `model.safetensors` when everything fits). tokenizer: an object with `.save(path)`
    (HFTokenizer / CharTokenizer) or a folder whose tokenizer files are copied.
    In a multi-host run every process must call this (gathers are collective); process 0 writes.
    """
    from ._lora import merged_model

    model = merged_model(model)  # a LoRA model is written with W + (α/r)·A·B
    value_head = isinstance(model, ValueModel)
    config = model.config if dtype is None else model.config.replace(param_dtype=dtype)
    entries = _entries(nnx.state(model, nnx.Param), model.config)
    hf = config_to_hf(config, value_head=value_head)
    tensors = []

    def producer(entry, var, idx, np_dtype):
        def produce():  # one layer (and expert) at a time: sliced on device, then fetched
            x = var.get_value()
            return entry.to_hf(to_host(x[idx] if idx else x)).astype(np_dtype)
        return produce

    for entry, var in entries:
        np_dtype = np.dtype(to_dtype(dtype)) if dtype is not None else np.dtype(var.get_value().dtype)
        for idx, name in zip(entry.lead_indices(), entry.hf_names()):
            tensors.append((name, entry.hf_shape, np_dtype, producer(entry, var, idx, np_dtype)))
    tensors.sort(key=lambda t: _hf_sort_key(t[0]))
    limit = _parse_size(max_shard_size)
    shards: list[list] = [[]]
    used = 0
    for t in tensors:
        size = math.prod(t[1]) * t[2].itemsize
        if shards[-1] and used + size > limit:
            shards.append([])
            used = 0
        shards[-1].append(t)
        used += size
    # every process runs the producers (the gathers are collective), only process 0 keeps files
    write = jax.process_index() == 0
    if write:
        os.makedirs(path, exist_ok=True)
    target = path if write else os.devnull
    total = sum(math.prod(t[1]) * t[2].itemsize for t in tensors)
    names = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))])
    for name, shard in zip(names, shards):
        if write:
            _write_safetensors(os.path.join(target, name), shard)
        else:
            for t in shard:
                t[3]()
    if not write:
        return
    if len(shards) > 1:
        index = {"metadata": {"total_size": total},
                 "weight_map": {t[0]: n for n, s in zip(names, shards) for t in s}}
        with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
            json.dump(index, f, indent=2, sort_keys=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf, f, indent=2, sort_keys=True)
    if tokenizer is not None:
        _save_tokenizer(tokenizer, path)


def _hf_sort_key(name: str):
    """Order tensors as transformers does: by layer, then name (embeddings first, lm_head last)."""
    m = re.match(r"model\.layers\.(\d+)\.(.*)", name)
    if m:
        return (1, int(m.group(1)), m.group(2))
    return (0 if name.startswith("model.embed") else 2, 0, name)


def _save_tokenizer(tokenizer: Any, path: str):
    if isinstance(tokenizer, (str, os.PathLike)):
        copied = 0
        for name in _TOKENIZER_FILES:
            src = os.path.join(tokenizer, name)
            if os.path.exists(src):
                shutil.copy(src, os.path.join(path, name))
                copied += 1
        if not copied:
            raise FileNotFoundError(f"{tokenizer}: no tokenizer files ({', '.join(_TOKENIZER_FILES)})")
    elif hasattr(tokenizer, "save"):
        tokenizer.save(path)
    else:
        raise TypeError(f"tokenizer must be a folder path or have .save(path), got {type(tokenizer)}")
