"""Model hyper-parameters: one frozen dataclass for the Llama 3 / Qwen2 / Qwen3 decoder family
(and its mixture-of-experts members Qwen3-MoE and Mixtral).

Field names follow Hugging Face's `config.json` so a user can read one against the other.
Conversion from and to `config.json` lives in `_hf.py`; this module only holds and checks values.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

MODEL_TYPES = ("llama", "qwen2", "qwen3", "qwen3_moe", "mixtral")
MOE_MODEL_TYPES = ("qwen3_moe", "mixtral")
REMAT_POLICIES = ("none", "full", "dots", "dots_no_batch")
TRAIN_ATTENTIONS = ("auto", "xla", "cudnn", "rolled", "splash")
QUANTIZATIONS = ("none", "fp8", "int8")  # `_quant.QUANTIZATIONS`
DECODE_ATTENTIONS = ("auto", "einsum", "reduce", "cudnn", "pallas", "triton")

_DTYPES = {
    "float32": jnp.float32, "fp32": jnp.float32,
    "bfloat16": jnp.bfloat16, "bf16": jnp.bfloat16,
    "float16": jnp.float16, "fp16": jnp.float16,
}


def to_dtype(value: Any):
    """Accept a jnp dtype or a string such as 'bfloat16' / 'bf16' / 'float32'."""
    if isinstance(value, str):
        if value not in _DTYPES:
            raise ValueError(f"unknown dtype {value!r}; choose one of {sorted(_DTYPES)}")
        return _DTYPES[value]
    return jnp.dtype(value).type


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """llama3-type RoPE frequency scaling (`rope_scaling.rope_type == "llama3"`)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int
    rope_type: str = "llama3"


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Decoder hyper-parameters.

    `dtype` is the compute dtype (activations, matmul inputs); `param_dtype` the storage dtype of
    parameters. `remat` is the rematerialisation policy of each decoder layer in training.

    Kernel choices (part of the config, so part of every compiled program's cache key; they
    change results only by float rounding):
    `train_attention`, the attention of the full forward (training, log-probs, scoring, prefill):
      "xla": `attend` with the [b, t, t] padding mask (materialises fp32 scores);
      "cudnn": cuDNN flash attention on rows rotated so their real tokens start at 0 (each
        row's real tokens must be one contiguous run; GPU, bf16/fp16);
      "rolled": the same rotation with XLA's `jax.nn.dot_product_attention` (CPU tests of it);
      "splash": the Pallas TPU splash kernel, causal with segment ids = the attention mask (any
        padding pattern); Pallas interpret mode off TPU;
      "auto": splash on TPU with head_dim a multiple of 128, cudnn on GPU with bf16/fp16 and
        head_dim <= 128 (a multiple of 8), else xla.
      Packed rows (attention mask = segment ids 1, 2, ... per sequence, 0 padding; the forward's
      `packed=True`): every choice masks across sequences; cudnn and rolled then use each row's
      runs (cuDNN's packed layout; rolled: the same runs as an XLA mask) instead of the rotation.
    `decode_attention`, one new token per row over the KV cache (more tokens: always einsum):
      "einsum": `attend` (batched matmuls); "reduce": multiply + reduce over the cache in its
      stored layout; "cudnn": cuDNN with per-row key lengths (GPU, bf16/fp16); "pallas": a Pallas
      TPU kernel reading each row's cache up to its length in place (interpret mode off TPU);
      "triton": a Pallas Triton GPU kernel that does the same, one program per (row, kv head,
      split of the slots) (interpret mode off GPU);
      "auto": pallas on TPU with head_dim a multiple of 128; on GPU with bf16/fp16, triton when
      head_dim is a power of two in 16..256 and the cache length a multiple of 16, else cudnn as
      above; else einsum.
    `decode_unroll`: layers unrolled per scan iteration of the stacked layout's decode (1 = a
      rolled loop, 0 = all); the per-layer layout always unrolls. With dense and sparse layers
      repeating in a period (`mlp_only_layers` / `decoder_sparse_step`), one scan iteration is
      a period, so at least that many layers are unrolled.
    `layer_unroll`: the same for the stacked layout's full forward and prefill (XLA's cost
      analysis counts a loop body once, so `scripts/tpu/aot_compile.py` unrolls small models).
    "On TPU" / "on GPU" is the platform of the active `sharding.use_rules` mesh (so an
    ahead-of-time compile for a TPU topology picks the TPU kernels), else JAX's default backend.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int | None = None
    model_type: str = "qwen2"
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v biases (Qwen2 style); llama also puts one on o_proj
    qk_norm: bool = False  # RMSNorm on q and k per head before RoPE (Qwen3)
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    pad_token_id: int | None = None
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32
    remat: str = "none"
    train_attention: str = "auto"
    decode_attention: str = "auto"
    decode_unroll: int = 1
    layer_unroll: int = 1
    # Mixture of experts (model_type qwen3_moe / mixtral): every layer's MLP is a sparse block of
    # `num_experts` SwiGLU experts of width `moe_intermediate_size`; each token goes to its
    # `num_experts_per_tok` highest-scoring experts (softmax router), weighted by the router
    # probabilities, renormalised over the chosen experts when `norm_topk_prob`. 0 = dense.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    # Qwen3-MoE's dense layers: layer i has a dense MLP (width `intermediate_size`) when i is in
    # `mlp_only_layers` or (i + 1) % decoder_sparse_step != 0, as in transformers; every other
    # layer is sparse (`sparse_layers`). Router logits, recorded and replayed experts, the aux
    # loss and the expert-load metrics cover the sparse layers only, in layer order.
    mlp_only_layers: tuple[int, ...] = ()
    decoder_sparse_step: int = 1
    router_aux_loss_coef: float = 0.001  # config.json's value, round trip only (actor: model.moe.aux_loss_coef)
    # The rollout engine's weight format for the dense linear layers (`_quant`): "none" (param_dtype),
    # "fp8" (e4m3 weights + activations, per-channel / per-token scales) or "int8" (weight-only);
    # set by `rollout.Engine(quantization=...)`, never by a trainer.
    quantization: str = "none"

    def __post_init__(self):
        if self.model_type not in MODEL_TYPES:
            raise ValueError(f"model_type={self.model_type!r} is not supported; choose one of {MODEL_TYPES}")
        if self.remat not in REMAT_POLICIES:
            raise ValueError(f"remat={self.remat!r}; choose one of {REMAT_POLICIES}")
        if self.train_attention not in TRAIN_ATTENTIONS:
            raise ValueError(f"train_attention={self.train_attention!r}; choose one of {TRAIN_ATTENTIONS}")
        if self.decode_attention not in DECODE_ATTENTIONS:
            raise ValueError(f"decode_attention={self.decode_attention!r}; choose one of {DECODE_ATTENTIONS}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization={self.quantization!r}; choose one of {QUANTIZATIONS}")
        for name in ("decode_unroll", "layer_unroll"):
            value = getattr(self, name)
            if isinstance(value, bool) or int(value) < 0:
                raise ValueError(f"{name}={value!r} must be an int >= 0 (0 = all layers)")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads"):
            if int(getattr(self, name)) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if (self.model_type in MOE_MODEL_TYPES) != (int(self.num_experts) > 0):
            raise ValueError(f"model_type={self.model_type!r} with num_experts={self.num_experts}: the "
                             f"MoE types {MOE_MODEL_TYPES} need num_experts > 0, the dense ones 0")
        if self.num_experts:
            if not 0 < int(self.num_experts_per_tok) <= int(self.num_experts):
                raise ValueError(f"num_experts_per_tok={self.num_experts_per_tok} must be in "
                                 f"1..num_experts={self.num_experts}")
            if int(self.moe_intermediate_size) <= 0:
                raise ValueError(f"moe_intermediate_size must be positive, got {self.moe_intermediate_size}")
        self._check_layer_kinds()
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} must be a multiple of "
                f"num_key_value_heads={self.num_key_value_heads} (grouped-query attention)")
        if self.head_dim is None:
            if self.hidden_size % self.num_attention_heads:
                raise ValueError(
                    f"hidden_size={self.hidden_size} is not divisible by num_attention_heads="
                    f"{self.num_attention_heads}; set head_dim explicitly")
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for rotary embeddings")
        object.__setattr__(self, "dtype", to_dtype(self.dtype))
        object.__setattr__(self, "param_dtype", to_dtype(self.param_dtype))

    def _check_layer_kinds(self):
        dense = self.mlp_only_layers
        if isinstance(dense, (str, bytes)) or not hasattr(dense, "__iter__"):
            raise ValueError(f"mlp_only_layers={dense!r} must be a list of layer indices")
        dense = tuple(sorted({int(i) for i in dense}))
        object.__setattr__(self, "mlp_only_layers", dense)
        step = self.decoder_sparse_step
        if isinstance(step, bool) or int(step) < 1:
            raise ValueError(f"decoder_sparse_step={step!r} must be an int >= 1")
        object.__setattr__(self, "decoder_sparse_step", int(step))
        if (dense or step != 1) and self.model_type != "qwen3_moe":
            raise ValueError(f"mlp_only_layers={list(dense)} / decoder_sparse_step={step}: dense layers "
                             f"among sparse ones are a qwen3_moe feature, not {self.model_type!r}'s")
        bad = [i for i in dense if not 0 <= i < self.num_hidden_layers]
        if bad:
            raise ValueError(f"mlp_only_layers={list(dense)}: {bad} not in 0..num_hidden_layers - 1 = "
                             f"{self.num_hidden_layers - 1}")
        if self.is_moe and not self.sparse_layers:
            raise ValueError(f"mlp_only_layers={list(dense)}, decoder_sparse_step={step}: no layer of the "
                             f"{self.num_hidden_layers} is sparse; a model without experts is model_type "
                             f"'qwen3'")

    @property
    def sparse_layers(self) -> tuple[int, ...]:
        """The indices of the layers with a sparse MLP (all layers of an MoE model unless
        `mlp_only_layers` / `decoder_sparse_step` make some dense; none of a dense model)."""
        if not self.is_moe:
            return ()
        dense = set(self.mlp_only_layers)
        return tuple(i for i in range(self.num_hidden_layers)
                     if i not in dense and (i + 1) % self.decoder_sparse_step == 0)

    @property
    def dense_layers(self) -> tuple[int, ...]:
        """The indices of the layers with a dense MLP."""
        sparse = set(self.sparse_layers)
        return tuple(i for i in range(self.num_hidden_layers) if i not in sparse)

    @property
    def mixed_layers(self) -> bool:
        """Whether an MoE model has dense layers too (stacked: two MLP stacks, `DecoderLayers`)."""
        return self.is_moe and len(self.sparse_layers) < self.num_hidden_layers

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def num_groups(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads
