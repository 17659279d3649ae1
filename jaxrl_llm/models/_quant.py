"""Low-precision weights for the rollout engine (`rollout.quantization`): per-output-channel
quantization of the dense linear layers and the matmul that reads them.

What is quantized: the attention projections (q/k/v/o, or the fused `qkv_proj`) and the dense
MLP's gate/up/down (or `gate_up_proj`). What stays in the engine's dtype: the embedding, the LM
head, the norms, biases, LoRA adapters, and a mixture-of-experts block (router and experts: their
grouped `ragged_dot` matmuls are not quantized).

A quantized projection's param dict is {"kernel": q, "scale": s} (plus any bias):
  q: the weight in `int8` or `float8_e4m3fn`, stored with its input (contracted) axes LAST,
     [*out, *in] (so both operands of the matmul contract their minor dim: the layout cuBLASLt's
     FP8 GEMM takes without a transpose); a stacked layer tree keeps its leading [L] axis first.
  s: float32 [*out], one scale per output channel: w ~= q * s (symmetric, absmax / qmax).

The matmul (`linear`):
  int8: weight-only (W8A16): dot(x, q as x.dtype) in fp32, times s. On TPU the compiler reads
    the int8 weights inside the matmul fusion (no bf16 copy written; tests/rollout/
    test_rollout_quant_aot.py checks the compiled v5e decode step).
  fp8: W8A8 with dynamic per-token activation scales: x is scaled by its row's absmax / 448 and
    cast to e4m3, `lax.dot_general(x_fp8, q_fp8, preferred_element_type=float32)`, then times
    (row scale x channel scale). Both operands fp8 is the pattern XLA's GPU GEMM rewriter turns
    into a cuBLASLt FP8 GEMM on Hopper; on CPU XLA upcasts the operands (same numbers, slower).

Quantization happens in the engine's weight sync (`rollout._weights.WeightSync`), inside the
jitted sync program, after the cast and relayout: `quantize_params` on the engine's layer tree.
This module holds no state and knows nothing of meshes (the scales carry logical axis names,
like every param).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from ._config import QUANTIZATIONS

_DTYPES = {"fp8": jnp.float8_e4m3fn, "int8": jnp.int8}
_QMAX = {"fp8": float(jnp.finfo(jnp.float8_e4m3fn).max), "int8": 127.0}  # 448, 127

# The dense projections that are quantized and how many leading (input) axes each contracts.
ATTENTION_PROJ = {"q_proj": 1, "k_proj": 1, "v_proj": 1, "qkv_proj": 1, "o_proj": 2}
MLP_PROJ = {"gate_proj": 1, "up_proj": 1, "down_proj": 1, "gate_up_proj": 1}


def check_quantization(value: str) -> str:
    if value not in QUANTIZATIONS:
        raise ValueError(f"quantization={value!r} is not one of {QUANTIZATIONS}")
    return value


def storage_dtype(fmt: str):
    """The dtype a quantized kernel is stored in (int8 or float8_e4m3fn)."""
    return _DTYPES[fmt]


def quantized_layout(shape, axes, n_in: int):
    """(kernel shape, kernel axes, scale shape, scale axes) of a projection whose unquantized
    kernel is `shape`/`axes` ([layers]? + in + out, `n_in` input axes): [layers]? + out + in, and
    [layers]? + out."""
    lead = 1 if axes and axes[0] == "layers" else 0
    cut = lead + n_in
    q_shape = tuple(shape[:lead]) + tuple(shape[cut:]) + tuple(shape[lead:cut])
    q_axes = tuple(axes[:lead]) + tuple(axes[cut:]) + tuple(axes[lead:cut])
    return q_shape, q_axes, tuple(shape[:lead]) + tuple(shape[cut:]), tuple(axes[:lead]) + tuple(axes[cut:])


def quantized_param(shape, axes, n_in: int, fmt: str) -> nnx.Dict:
    """A quantized projection's {"kernel", "scale"} params (zeros / ones: the sync fills them)."""
    q_shape, q_axes, s_shape, s_axes = quantized_layout(shape, axes, n_in)
    return nnx.Dict(kernel=nnx.Param(jnp.zeros(q_shape, storage_dtype(fmt)), logical_axes=q_axes),
                    scale=nnx.Param(jnp.ones(s_shape, jnp.float32), logical_axes=s_axes))


def quantize_kernel(w, fmt: str, n_in: int, lead: int = 0):
    """w [lead.., *in (n_in axes), *out] -> (q [lead.., *out, *in] int8 / e4m3, scale f32
    [lead.., *out]), per output channel: scale = absmax over the input axes / qmax (1 for an
    all-zero channel), q = w / scale rounded (int8: to the nearest integer, clipped to +-127;
    fp8: e4m3's round to nearest even)."""
    qmax = _QMAX[fmt]
    ins = tuple(range(lead, lead + n_in))
    w32 = w.astype(jnp.float32)
    amax = jnp.max(jnp.abs(w32), axis=ins, keepdims=True)
    scale = jnp.where(amax > 0, amax / qmax, 1.0)
    scaled = w32 / scale
    if fmt == "int8":
        q = jnp.clip(jnp.round(scaled), -qmax, qmax).astype(jnp.int8)
    else:
        q = jnp.clip(scaled, -qmax, qmax).astype(storage_dtype(fmt))
    q = jnp.moveaxis(q, ins, tuple(range(w.ndim - n_in, w.ndim)))
    return q, jnp.squeeze(scale, axis=ins)


def dequantize_kernel(q, scale, n_in: int, lead: int = 0, dtype=jnp.float32):
    """The inverse of `quantize_kernel` up to rounding: q [lead.., *out, *in], scale [lead.., *out]
    -> w [lead.., *in, *out] in `dtype`."""
    w = q.astype(jnp.float32) * scale.reshape(scale.shape + (1,) * n_in)
    return jnp.moveaxis(w, tuple(range(q.ndim - n_in, q.ndim)), tuple(range(lead, lead + n_in))).astype(dtype)


def _quantize_proj(p: dict, fmt: str, n_in: int, lead: int) -> dict:
    q, scale = quantize_kernel(p["kernel"], fmt, n_in, lead)
    return {**p, "kernel": q, "scale": scale}


def quantize_layer(layer: dict, fmt: str, lead: int = 0) -> dict:
    """One layer's pure param dict (or the stacked layers' dict, `lead=1`) with its dense
    projections quantized; norms, biases and a sparse MLP (router, experts) as they are."""
    attn = {k: (_quantize_proj(v, fmt, ATTENTION_PROJ[k], lead) if k in ATTENTION_PROJ else v)
            for k, v in layer["self_attn"].items()}
    out = {**layer, "self_attn": attn}
    for name in ("mlp", "dense_mlp"):  # dense_mlp: the dense layers of stacked mixed layers
        mlp = layer.get(name)
        if mlp is not None and "experts" not in mlp:  # dense; Qwen3-MoE's sparse `mlp` stays
            out[name] = {k: (_quantize_proj(v, fmt, MLP_PROJ[k], lead) if k in MLP_PROJ else v)
                         for k, v in mlp.items()}
    return out


def quantize_params(params: dict, fmt: str) -> dict:
    """A causal LM's pure param dict in any layer layout with every dense projection quantized
    (`quantize_layer`); embedding and LM head untouched. Run it inside a jit (the sync's)."""
    layers = params["model"]["layers"]
    if "self_attn" in layers:  # stacked: one dict with a leading [L] axis on every leaf
        new = quantize_layer(layers, fmt, lead=1)
    else:
        new = {i: quantize_layer(layers[i], fmt) for i in range(len(layers))}
    return {**params, "model": {**params["model"], "layers": new}}


def linear(x, p, n_in: int):
    """x [..., *in] times a quantized projection `p` ({"kernel": q [*out, *in], "scale" [*out]})
    -> [..., *out] in x.dtype (the format is the kernel's dtype; see the module docstring)."""
    q, scale = p["kernel"][...], p["scale"][...]
    x_in = tuple(range(x.ndim - n_in, x.ndim))
    dims = ((x_in, tuple(range(q.ndim - n_in, q.ndim))), ((), ()))
    if q.dtype == jnp.int8:
        y = jax.lax.dot_general(x, q.astype(x.dtype), dims, preferred_element_type=jnp.float32)
        return (y * scale).astype(x.dtype)
    qmax = float(jnp.finfo(q.dtype).max)
    x32 = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(x32), axis=x_in, keepdims=True)  # per token
    sx = jnp.maximum(amax, jnp.finfo(jnp.float32).tiny) / qmax
    xq = (x32 / sx).astype(q.dtype)
    y = jax.lax.dot_general(xq, q, dims, preferred_element_type=jnp.float32)
    sx = sx.reshape(x.shape[:-n_in] + (1,) * (q.ndim - n_in))
    return (y * sx * scale).astype(x.dtype)
