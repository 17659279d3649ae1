"""Flax NNX decoder for the Llama 3 / Qwen2 / Qwen3 family and its mixture-of-experts members
(Qwen3-MoE, Mixtral: `SparseMLP`), with a causal-LM and a value head.

Layer parameters are stored stacked along a leading `layers` axis and the layers run under
`jax.lax.scan`, so compile time does not grow with depth and the trainer and the rollout engine
can share one parameter pytree. A second, inference-only layout (`layer_layout="per_layer"`:
`Transformer.layers` is an `nnx.List` of one-layer modules, the pure dict's `layers` is
`{0: {...}, 1: {...}, ...}`) runs the layers as an unrolled Python loop over separate arrays, so a
decode step reads every layer's weights and KV cache in place instead of slicing stacked arrays
(`unstack_layers` / `stack_layers` convert pure param dicts between the two). Every parameter
carries its logical axis names as `logical_axes` metadata; activations are constrained with
`sharding.constrain`. Mesh axes are `sharding/`'s business, not this module's.

Three ways to run the same weights:
- `__call__` / `hidden_states`: a full forward for training and scoring (padding mask, positions).
- `prefill`: a full forward that also returns every layer's keys and values.
- `decode`: tokens appended to an existing KV cache at per-row offsets (the engine's generate).
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import math
import re
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

import sharding

from . import _kernels, _quant
from ._config import ModelConfig
from ._context_parallel import context_attention, context_parts
from ._lora import lora_delta

_NEG_INF = -0.7 * float(jnp.finfo(jnp.float32).max)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
    """Keys and values of every layer, in one of two layouts:

    stacked: `k`, `v` are arrays [layers, b, s, kv_heads, head_dim];
    per layer: `k`, `v` are tuples of `layers` arrays [b, s, kv_heads, head_dim] (each one its own
      buffer, updated in place by a donated decode step).
    """

    k: Any
    v: Any

    LOGICAL_AXES = ("layers", "cache_batch", "cache_length", "kv_heads", "head_dim")
    PER_LAYER_AXES = LOGICAL_AXES[1:]

    @property
    def per_layer(self) -> bool:
        return isinstance(self.k, (tuple, list))


def _lead(n, shape, axes):
    """Prepends the stacked `layers` axis (size n) to a layer parameter's shape and axes; n None:
    a single layer's parameter (the per-layer layout)."""
    return (shape, axes) if n is None else ((n,) + shape, ("layers",) + axes)


def _param(rngs, shape, axes, dtype, std=0.02):
    return nnx.Param(std * jax.random.normal(rngs.params(), shape, jnp.float32).astype(dtype),
                     logical_axes=axes)


def _linear(rngs, c: ModelConfig, n, shape, axes, n_in: int = 1) -> nnx.Dict:
    """A projection's {"kernel"} ([layers]? + in + out, `n_in` input axes), or under
    `c.quantization` its quantized {"kernel", "scale"} (`_quant`: the engine's weights)."""
    shape, axes = _lead(n, shape, axes)
    if c.quantization != "none":
        return _quant.quantized_param(shape, axes, n_in, c.quantization)
    return nnx.Dict(kernel=_param(rngs, shape, axes, c.param_dtype))


def _ones(shape, axes, dtype):
    return nnx.Param(jnp.ones(shape, dtype), logical_axes=axes)


def _zeros(shape, axes, dtype):
    return nnx.Param(jnp.zeros(shape, dtype), logical_axes=axes)


class RMSNorm(nnx.Module):
    """x / rms(x) * scale, computed in fp32 and cast back (as Hugging Face does)."""

    def __init__(self, shape, axes, eps, dtype):
        self.scale = _ones(shape, axes, dtype)
        self.eps = eps

    def __call__(self, x):
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return self.scale[...].astype(x.dtype) * x32.astype(x.dtype)


def rope_inv_freq(config: ModelConfig) -> jax.Array:
    """Inverse frequencies [head_dim // 2], with llama3-type scaling when configured."""
    d = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))
    rs = config.rope_scaling
    if rs is None:
        return inv_freq
    low_wavelen = rs.original_max_position_embeddings / rs.low_freq_factor
    high_wavelen = rs.original_max_position_embeddings / rs.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = jnp.where(wavelen > low_wavelen, inv_freq / rs.factor, inv_freq)
    smooth = (rs.original_max_position_embeddings / wavelen - rs.low_freq_factor) / (
        rs.high_freq_factor - rs.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rs.factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return jnp.where(is_medium, smoothed, scaled)


def apply_rope(x, positions, inv_freq):
    """Rotate-half RoPE. x [b, t, h, d], positions int32[b, t]."""
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [b, t, d/2]
    cos = jnp.cos(angles)[:, :, None, :]
    sin = jnp.sin(angles)[:, :, None, :]
    x32 = x.astype(jnp.float32)
    x1, x2 = jnp.split(x32, 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


def attend(q, k, v, mask):
    """Grouped-query attention. q [b, tq, h, d]; k, v [b, tk, kvh, d]; mask bool[b, tq, tk]."""
    b, tq, h, d = q.shape
    kvh = k.shape[2]
    q = q.reshape(b, tq, kvh, h // kvh, d)
    scores = jnp.einsum("bqkgd,bskd->bkgqs", q, k, preferred_element_type=jnp.float32)
    scores = scores / math.sqrt(d)
    scores = jnp.where(mask[:, None, None, :, :], scores, _NEG_INF)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgqs,bskd->bqkgd", probs, v)
    return out.reshape(b, tq, h, d)


# Kernel choices are `ModelConfig.train_attention` / `.decode_attention` / `.decode_unroll` (see
# there); measured effects of the GPU ones are in docs/benchmarks.md §3 (H200, 1.5B shape: in the
# stacked layout cudnn beat einsum and reduce; in the per-layer engine layout the Triton kernel
# beats cudnn by about 4 % per decode step at batch 256 and 512, 2 % at 64).


KV_CACHE_DTYPES = ("auto", "fp8")
_FP8 = jnp.dtype(jnp.float8_e4m3fn)
_FP8_MAX = float(jnp.finfo(jnp.float8_e4m3fn).max)  # 448


def kv_cache_dtype(name: str, dtype):
    """The KV cache's storage dtype for `rollout.kv_cache_dtype`: "auto" keeps the engine's
    `dtype`; "fp8" stores e4m3 keys and values (unscaled: scale 1, values saturated at +-448),
    read back in `dtype` by attention."""
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype={name!r} is not one of {KV_CACHE_DTYPES}")
    return jnp.dtype(dtype) if name == "auto" else _FP8


def to_cache(x, dtype):
    """x cast to the cache's dtype; to fp8 saturating (e4m3fn has no infinity: a value past 448
    would become NaN)."""
    if jnp.dtype(dtype) == _FP8:
        x = jnp.clip(x.astype(jnp.float32), -_FP8_MAX, _FP8_MAX)
    return x.astype(dtype)


def _from_cache(x, dtype):
    """A layer's cache as attention reads it: an fp8 cache upcast to the compute dtype (the
    Triton decode kernel instead reads the fp8 bytes and converts in registers)."""
    return x.astype(dtype) if x.dtype == _FP8 else x


def attend_one(q, k_cache, v_cache, kv_lengths):
    """Attention of one new query per row over a cache. q [b, 1, h, d]; caches [b, s, kvh, d];
    kv_lengths int32[b]: row b sees cache slots < kv_lengths[b]. Same math as `attend`."""
    b, _, h, d = q.shape
    s, kvh = k_cache.shape[1], k_cache.shape[2]
    qg = q.reshape(b, 1, kvh, h // kvh, d).astype(jnp.float32)
    # scores[b, s, k, g] = sum_d q[b, k, g, d] * K[b, s, k, d]; reads the cache once, in place
    scores = jnp.sum(qg * k_cache[:, :, :, None, :].astype(jnp.float32), axis=-1) / math.sqrt(d)
    visible = jnp.arange(s, dtype=jnp.int32)[None, :] < kv_lengths[:, None]  # [b, s]
    scores = jnp.where(visible[:, :, None, None], scores, _NEG_INF)
    probs = jax.nn.softmax(scores, axis=1).astype(v_cache.dtype).astype(jnp.float32)
    out = jnp.sum(probs[..., None] * v_cache[:, :, :, None, :].astype(jnp.float32), axis=1)  # [b, k, g, d]
    return out.astype(v_cache.dtype).reshape(b, 1, h, d)


def _attend_one_cudnn(q, k_cache, v_cache, kv_lengths):
    return jax.nn.dot_product_attention(q.astype(k_cache.dtype), k_cache, v_cache,
                                        key_value_seq_lengths=kv_lengths.astype(jnp.int32),
                                        implementation="cudnn")


def _cudnn_ok(dtype, head_dim: int) -> bool:
    return (_kernels.target_platform() == "gpu" and jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16)
            and head_dim % 8 == 0 and head_dim <= 128)


def _pallas_ok(dtype, head_dim: int) -> bool:
    return _kernels.target_platform() == "tpu" and head_dim % 128 == 0 and jnp.dtype(dtype) != _FP8


def _triton_ok(dtype, head_dim: int, cache_len: int) -> bool:
    """bf16/fp16 caches, and fp8 ones (the kernel converts the loaded keys and values)."""
    return (_kernels.target_platform() == "gpu" and jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16, _FP8)
            and 16 <= head_dim <= 256 and head_dim & (head_dim - 1) == 0 and cache_len % 16 == 0)


def _decode_attention_impl(config: ModelConfig, t: int, dtype, head_dim: int, cache_len: int) -> str:
    """The decode kernel `config.decode_attention` resolves to for t new tokens per row."""
    impl = config.decode_attention
    if t != 1:
        return "einsum"
    if impl == "auto":
        if _pallas_ok(dtype, head_dim):
            return "pallas"
        if _triton_ok(dtype, head_dim, cache_len):
            return "triton"
        return "cudnn" if _cudnn_ok(dtype, head_dim) else "einsum"
    return impl


class Attention(nnx.Module):
    def __init__(self, c: ModelConfig, n: int | None, rngs: nnx.Rngs, *, fused: bool = False):
        e, h, kvh, d, pd = c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.param_dtype

        def zeros(shape, axes):
            return _zeros(*_lead(n, shape, axes), pd)

        if fused:  # one [e, kvh, g + 2, d] matmul: each kv head's g query heads, its key, its value
            g = h // kvh
            self.qkv_proj = _linear(rngs, c, n, (e, kvh, g + 2, d), ("embed", "kv_heads", None, "head_dim"))
            if c.attention_bias:
                self.qkv_proj["bias"] = zeros((kvh, g + 2, d), ("kv_heads", None, "head_dim"))
        else:
            self.q_proj = _linear(rngs, c, n, (e, h, d), ("embed", "heads", "head_dim"))
            self.k_proj = _linear(rngs, c, n, (e, kvh, d), ("embed", "kv_heads", "head_dim"))
            self.v_proj = _linear(rngs, c, n, (e, kvh, d), ("embed", "kv_heads", "head_dim"))
        self.o_proj = _linear(rngs, c, n, (h, d, e), ("heads", "head_dim", "embed"), n_in=2)
        if c.attention_bias:
            if not fused:
                self.q_proj["bias"] = zeros((h, d), ("heads", "head_dim"))
                self.k_proj["bias"] = zeros((kvh, d), ("kv_heads", "head_dim"))
                self.v_proj["bias"] = zeros((kvh, d), ("kv_heads", "head_dim"))
            if c.model_type == "llama":
                self.o_proj["bias"] = zeros((e,), ("embed",))
        if c.qk_norm:
            self.q_norm = RMSNorm(*_lead(n, (d,), ("head_dim",)), c.rms_norm_eps, pd)
            self.k_norm = RMSNorm(*_lead(n, (d,), ("head_dim",)), c.rms_norm_eps, pd)
        self.config = c
        self.lora_scale = None  # α/r once `add_lora` gave the projections adapters


    def _proj(self, p, x, out_axes):
        if "scale" in p:  # a quantized engine's weights
            y = _quant.linear(x, p, 1)
        else:
            y = jnp.einsum("bte,e...->bt...", x, p["kernel"][...].astype(x.dtype))
        y = y + lora_delta(p, x, 1, self.lora_scale)
        if "bias" in p:
            y = y + p["bias"][...].astype(x.dtype)
        return sharding.constrain(y, ("batch", "length") + out_axes)

    def qkv(self, x, positions, inv_freq):
        if hasattr(self, "qkv_proj"):  # the fused layout: slices of one matmul's output
            b, t, _ = x.shape
            y = self._proj(self.qkv_proj, x, ("kv_heads", None, "head_dim"))  # [b, t, kvh, g + 2, d]
            g = y.shape[3] - 2
            q = y[:, :, :, :g].reshape(b, t, -1, y.shape[-1])
            k, v = y[:, :, :, g], y[:, :, :, g + 1]
        else:
            q = self._proj(self.q_proj, x, ("heads", "head_dim"))
            k = self._proj(self.k_proj, x, ("kv_heads", "head_dim"))
            v = self._proj(self.v_proj, x, ("kv_heads", "head_dim"))
        if self.config.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        return apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq), v

    def out(self, o):
        if "scale" in self.o_proj:  # a quantized engine's weights
            y = _quant.linear(o, self.o_proj, 2)
        else:
            y = jnp.einsum("bthd,hde->bte", o, self.o_proj["kernel"][...].astype(o.dtype))
        y = y + lora_delta(self.o_proj, o, 2, self.lora_scale)
        if "bias" in self.o_proj:
            y = y + self.o_proj["bias"][...].astype(o.dtype)
        return y


class MLP(nnx.Module):
    def __init__(self, c: ModelConfig, n: int | None, rngs: nnx.Rngs, *, fused: bool = False):
        e, f = c.hidden_size, c.intermediate_size
        if fused:  # gate and up as one [e, 2, f] matmul
            self.gate_up_proj = _linear(rngs, c, n, (e, 2, f), ("embed", None, "mlp"))
        else:
            self.gate_proj = _linear(rngs, c, n, (e, f), ("embed", "mlp"))
            self.up_proj = _linear(rngs, c, n, (e, f), ("embed", "mlp"))
        self.down_proj = _linear(rngs, c, n, (f, e), ("mlp", "embed"))
        self.lora_scale = None  # α/r once `add_lora` gave the projections adapters

    def _lin(self, p, x, spec):
        if "scale" in p:  # a quantized engine's weights
            return _quant.linear(x, p, 1) + lora_delta(p, x, 1, self.lora_scale)
        return jnp.einsum(spec, x, p["kernel"][...].astype(x.dtype)) + lora_delta(p, x, 1, self.lora_scale)

    def __call__(self, x):
        if hasattr(self, "gate_up_proj"):
            y = self._lin(self.gate_up_proj, x, "bte,eif->btif")
            gate, up = y[:, :, 0], y[:, :, 1]
        else:
            gate = self._lin(self.gate_proj, x, "bte,ef->btf")
            up = self._lin(self.up_proj, x, "bte,ef->btf")
        h = sharding.constrain(jax.nn.silu(gate) * up, ("batch", "length", "mlp"))
        return self._lin(self.down_proj, h, "btf,fe->bte")


class _Experts(nnx.Module):
    """The stacked expert weights of a sparse MLP: `gate_proj`/`up_proj` kernels [E, e, f] and
    `down_proj` [E, f, e] (a leading `layers` axis when stacked); Mixtral's names w1/w3/w2."""

    def __init__(self, c: ModelConfig, n: int | None, rngs: nnx.Rngs, names: tuple[str, str, str]):
        E, e, f, pd = c.num_experts, c.hidden_size, c.moe_intermediate_size, c.param_dtype
        self.names = names
        gate, up, down = names
        setattr(self, gate, nnx.Dict(kernel=_param(rngs, *_lead(n, (E, e, f), ("expert", "embed", "mlp")), pd)))
        setattr(self, up, nnx.Dict(kernel=_param(rngs, *_lead(n, (E, e, f), ("expert", "embed", "mlp")), pd)))
        setattr(self, down, nnx.Dict(kernel=_param(rngs, *_lead(n, (E, f, e), ("expert", "mlp", "embed")), pd)))

    def kernels(self):
        return tuple(getattr(self, name)["kernel"][...] for name in self.names)


def route(router_logits, top_k: int, normalize: bool):
    """Top-k softmax routing (transformers' Qwen3-MoE / Mixtral): router_logits [..., E] ->
    (weights fp32 [..., k], expert ids int32 [..., k]); the softmax is over all experts in fp32,
    renormalised over the k chosen ones when `normalize`."""
    probs = jax.nn.softmax(router_logits.astype(jnp.float32), axis=-1)
    weights, experts = jax.lax.top_k(probs, top_k)
    if normalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, experts.astype(jnp.int32)


def replay_route(router_logits, given, top_k: int, normalize: bool):
    """Router replay (R3): the experts `given` (int [..., k], e.g. those the rollout engine chose)
    instead of the top-k, with the gate weights recomputed from `router_logits` [..., E] at them:
    the softmax over all experts in fp32 taken at the given ids, renormalised over them when
    `normalize` (as `route`), so the router still gets gradients. A token whose first given id is
    negative (not recorded: padding, a response's last token) keeps its own top-k (`route`).
    Returns (weights fp32 [..., k], expert ids int32 [..., k]); equal to `route` where the given
    ids are its top-k in its order."""
    probs = jax.nn.softmax(router_logits.astype(jnp.float32), axis=-1)
    _, own = jax.lax.top_k(probs, top_k)
    given = jnp.asarray(given).astype(jnp.int32)
    experts = jnp.where(given[..., :1] >= 0, given, own.astype(jnp.int32))
    weights = jnp.take_along_axis(probs, experts, axis=-1)
    if normalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, experts


def routing_mismatch(router_logits, given, top_k: int, attention_mask=None):
    """Per token, how many layers' own top-k expert set (`route` on router_logits [L, b, t, E])
    differs from the `given` ids (int [b, t, L, k], e.g. the engine's), over the tokens with given
    ids (>= 0) that are real (attention_mask [b, t] != 0; None: all). Returns (mismatched layers,
    compared layers), both int32 [b, t]; no gradient."""
    _, own = route(jax.lax.stop_gradient(router_logits), top_k, False)  # [L, b, t, k]
    own = jnp.sort(jnp.moveaxis(own, 0, 2), axis=-1)  # [b, t, L, k], as a set
    given = jnp.asarray(given).astype(jnp.int32)
    compared = given[..., 0] >= 0  # [b, t, L]
    if attention_mask is not None:
        compared = compared & (attention_mask != 0)[..., None]
    differs = jnp.any(own != jnp.sort(given, axis=-1), axis=-1) & compared
    return differs.sum(-1).astype(jnp.int32), compared.sum(-1).astype(jnp.int32)


def expert_index_dtype(num_experts: int):
    """The smallest signed int dtype for expert ids and the -1 of an unrecorded token: int8 up to
    127 experts, else int16 (router replay's recorded ids, [rows, tokens, layers, k])."""
    return jnp.int8 if num_experts <= 127 else jnp.int16


def load_balancing_loss(router_logits, top_k: int, attention_mask=None):
    """The Switch/Mixtral router load-balancing loss, as transformers' `load_balancing_loss_func`:
    E * sum_e f_e * P_e, where P_e is the mean router probability of expert e and f_e the
    fraction of (token, choice) pairs routed to e (summed over the k choices), both over real
    tokens of every layer. router_logits [L, b, t, E] (or [..., E]); attention_mask [b, t] (0 =
    padding; None: every token counts). The top-k choice carries no gradient; P_e does. The
    actor adds it to its loss (`model.moe.aux_loss_coef`) on the logits of
    `hidden_states(..., router_logits=True)`."""
    E = router_logits.shape[-1]
    probs = jax.nn.softmax(router_logits.astype(jnp.float32), axis=-1)
    _, chosen = jax.lax.top_k(probs, top_k)
    picked = jax.nn.one_hot(chosen, E, dtype=jnp.float32).sum(axis=-2)  # [..., E], counts over k
    if attention_mask is None:
        w = jnp.ones(probs.shape[:-1], jnp.float32)
    else:
        w = jnp.broadcast_to((attention_mask != 0).astype(jnp.float32), probs.shape[:-1])
    total = jnp.maximum(jnp.sum(w), 1.0)
    frac = jnp.sum(picked * w[..., None], axis=tuple(range(picked.ndim - 1))) / total  # [E]
    mean_prob = jnp.sum(probs * w[..., None], axis=tuple(range(probs.ndim - 1))) / total
    return E * jnp.sum(jax.lax.stop_gradient(frac) * mean_prob)


def _token_weights(shape, attention_mask):
    if attention_mask is None:
        return jnp.ones(shape, jnp.float32)
    return jnp.broadcast_to((attention_mask != 0).astype(jnp.float32), shape)


def router_z_loss(router_logits, attention_mask=None):
    """The ST-MoE router z-loss: the mean over layers and real tokens of logsumexp(logits)^2
    (it keeps the router logits small). router_logits [L, b, t, E] (or [..., E]); attention_mask
    [b, t] as `load_balancing_loss`."""
    z = jax.nn.logsumexp(router_logits.astype(jnp.float32), axis=-1)
    w = _token_weights(z.shape, attention_mask)
    return jnp.sum(w * z * z) / jnp.maximum(jnp.sum(w), 1.0)


def expert_load(router_logits, top_k: int, attention_mask=None):
    """Per layer, the fraction of the real tokens' top-k (token, expert) choices that go to each
    expert: router_logits [L, b, t, E] -> fp32 [L, E], each row summing to 1 (0 when no real
    token). The same top-k as the forward's routing (`route`), without gradient."""
    E = router_logits.shape[-1]
    probs = jax.nn.softmax(jax.lax.stop_gradient(router_logits).astype(jnp.float32), axis=-1)
    _, chosen = jax.lax.top_k(probs, top_k)  # as `route` (ties in fp32 probs resolve alike)
    picked = jax.nn.one_hot(chosen, E, dtype=jnp.float32).sum(axis=-2)  # [L, b, t, E]
    w = _token_weights(picked.shape[:-1], attention_mask)
    counts = jnp.einsum("lbte,lbt->le", picked, w)
    return counts / jnp.maximum(counts.sum(-1, keepdims=True), 1.0)


def _ragged_swiglu(xs, sizes, kernels):
    """SwiGLU of row groups: xs [M, e] sorted by expert, sizes int32 [E] (rows past their sum are
    left out of every group); kernels (gate [E, e, f], up [E, e, f], down [E, f, e]) -> [M, e]."""
    gate_w, up_w, down_w = (w.astype(xs.dtype) for w in kernels)
    gate = jax.lax.ragged_dot(xs, gate_w, sizes)
    up = jax.lax.ragged_dot(xs, up_w, sizes)
    return jax.lax.ragged_dot(jax.nn.silu(gate) * up, down_w, sizes)


def grouped_experts(x, experts, kernels):
    """SwiGLU experts on tokens x [T, e] routed to experts int32 [T, k]; kernels (gate [E, e, f],
    up [E, e, f], down [E, f, e]). Capacity-free: the T*k (token, expert) pairs are sorted by
    expert and each expert's contiguous group is multiplied by its weights with
    `jax.lax.ragged_dot` (a grouped matmul; XLA on every backend). Returns [T, k, e], output j of
    token t from expert experts[t, j]."""
    t, k = experts.shape
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True)  # pair positions grouped by expert
    sizes = jnp.bincount(flat, length=kernels[0].shape[0]).astype(jnp.int32)
    xs = jnp.take(x, order // k, axis=0)  # [T*k, e]
    out = _ragged_swiglu(xs, sizes, kernels)  # [T*k, e], sorted
    unsorted = jnp.zeros_like(out).at[order].set(out, unique_indices=True)
    return unsorted.reshape(t, k, -1)


# a grouped matmul kept in optimized HLO text: the `ragged-dot` op (the opcode after a shape, not a
# name) or a Pallas kernel; without either, XLA replaced it by a dense dot over all experts
_GROUPED_HLO = re.compile(r'[\]}] ragged-dot\(|custom_call_target="[^"]*(?:xla\.gpu\.triton|mosaic_gpu)')


def ragged_dot_programs(num_experts: int, hidden: int, width: int, *, rows: int = 256,
                        dtype=jnp.bfloat16) -> dict:
    """{"fwd", "wgrad"}: this backend's compiled forward and weight gradient of the experts'
    grouped matmul, `jax.lax.ragged_dot` of `rows` x [hidden] by [num_experts, hidden, width]."""
    lhs = jax.ShapeDtypeStruct((rows, hidden), dtype)
    rhs = jax.ShapeDtypeStruct((num_experts, hidden, width), dtype)
    sizes = jax.ShapeDtypeStruct((num_experts,), jnp.int32)
    dy = jax.ShapeDtypeStruct((rows, width), dtype)
    fwd = jax.lax.ragged_dot
    wgrad = lambda a, b, g, dy: jax.vjp(lambda b: fwd(a, b, g), b)[1](dy)[0]  # noqa: E731
    return {"fwd": jax.jit(fwd).lower(lhs, rhs, sizes).compile(),
            "wgrad": jax.jit(wgrad).lower(lhs, rhs, sizes, dy).compile()}


def program_expanded(compiled) -> bool:
    """Whether a compiled program has no grouped matmul left (`_GROUPED_HLO`): XLA replaced its
    `ragged_dot` by a dense dot over all experts."""
    return _GROUPED_HLO.search(compiled.as_text() or "") is None


def ragged_dot_expanded(num_experts: int, hidden: int, width: int, *, rows: int = 256,
                        dtype=jnp.bfloat16) -> bool:
    """Whether this backend compiles the experts' grouped matmul (`ragged_dot_programs`), forward
    or weight gradient, to a dense dot over all experts: no `ragged-dot` op and no Pallas kernel
    left in the optimized program. Then every token-expert pair pays for every expert's matmul
    (num_experts times the FLOPs). On TPU the op stays grouped; on GPU only with XLA's cuDNN
    ragged-dot fusion (cuDNN >= 9.22; the weight gradient needs a newer one) or a Pallas lowering."""
    programs = ragged_dot_programs(num_experts, hidden, width, rows=rows, dtype=dtype)
    return any(program_expanded(c) for c in programs.values())


@functools.cache
def warn_if_experts_expanded(num_experts: int, hidden: int, width: int, top_k: int) -> bool:
    """On GPU, logs a warning (once per shape) when `ragged_dot_expanded`: the experts then run
    densely (`dense_experts`: every expert on every token). Returns whether it warned."""
    if jax.default_backend() != "gpu" or not _expanded_on_gpu(num_experts, hidden, width):
        return False
    logging.getLogger(__name__).warning(
        "mixture-of-experts on GPU: XLA would compile the experts' grouped matmul (jax.lax.ragged_dot) to "
        "a dense dot over all %d experts for every token-expert pair, so the experts run densely "
        "instead: every expert on every token, %.0fx the expert FLOPs of a grouped matmul (%dx less "
        "than XLA's expansion); results are the same. XLA's cuDNN ragged-dot fusion "
        "(XLA_FLAGS=--xla_gpu_experimental_use_ragged_dot_fusion=true, cuDNN >= 9.22) keeps it grouped; "
        "docs/concepts.md, 'Mixture-of-experts models'", num_experts, num_experts / top_k, top_k)
    return True


def _route_matrix(experts, weights, n: int, first: int = 0):
    """[T, n] routing weights of experts first .. first + n - 1: weights[t, j] where
    experts[t, j] is one of them, else 0 (summed if an expert repeats)."""
    hit = experts[..., None] == first + jnp.arange(n, dtype=experts.dtype)  # [T, k, n]
    return jnp.einsum("tkn,tk->tn", hit.astype(weights.dtype), weights)


def _dense_swiglu_impl(x, route, kernels):
    gate_w, up_w, down_w = (w.astype(x.dtype) for w in kernels)
    h = jax.nn.silu(jnp.einsum("te,Eef->tEf", x, gate_w)) * jnp.einsum("te,Eef->tEf", x, up_w)
    return jnp.einsum("tEf,Efe->te", h * route.astype(x.dtype)[..., None], down_w)


@jax.custom_vjp
def _dense_swiglu(x, route, kernels):
    """sum_E route[t, E] * expert_E(x[t]) over every expert (`route` 0 for unchosen ones): one
    matmul per projection over all experts; x [T, e], route [T, E], kernels as `grouped_experts`.
    Its backward keeps only the inputs and recomputes the forward: the `[T, E, f]` products (num
    experts / top_k times the sorted dispatch's activations) are never kept for it, whatever the
    model's remat policy (a nested `jax.checkpoint` would not override an outer `dots` policy)."""
    return _dense_swiglu_impl(x, route, kernels)


def _dense_swiglu_fwd(x, route, kernels):
    return _dense_swiglu_impl(x, route, kernels), (x, route, kernels)


def _dense_swiglu_bwd(inputs, g):
    return jax.vjp(_dense_swiglu_impl, *inputs)[1](g)


_dense_swiglu.defvjp(_dense_swiglu_fwd, _dense_swiglu_bwd)


def dense_experts(kernels) -> bool:
    """Whether `expert_mix` runs every expert on every token (`_dense_swiglu`) instead of the
    sorted `ragged_dot` dispatch: on GPU where XLA expands `ragged_dot` into a dense dot over all
    experts for every token-expert pair (`ragged_dot_expanded`), which costs top_k times more than
    running each expert once per token. Elsewhere (TPU, CPU, a GPU that keeps the grouped matmul)
    the dispatch is `ragged_dot`."""
    if _kernels.target_platform() != "gpu":
        return False
    n, e, f = kernels[0].shape[-3:]
    return _expanded_on_gpu(int(n), int(e), int(f))


@functools.cache
def _expanded_on_gpu(n: int, e: int, f: int) -> bool:
    return ragged_dot_expanded(n, e, f)


def expert_mix(x, experts, weights, kernels):
    """The sparse MLP's output: token t gets sum_j weights[t, j] * expert_{experts[t, j]}(x[t]).
    x [T, e], experts int32 [T, k], weights [T, k] (cast to x's dtype), kernels as
    `grouped_experts` -> [T, e].

    Where the active sharding rules split the experts' `expert` dim over mesh axes (expert
    parallelism, see `_expert_parallel`), the dispatch runs per expert shard under `shard_map`;
    otherwise (no rules active, or the dim whole) it is `grouped_experts` on all experts."""
    plan = _expert_plan(kernels[0].shape[0])
    if plan is None:
        if dense_experts(kernels):
            return _dense_swiglu(x, _route_matrix(experts, weights, kernels[0].shape[0]), kernels)
        return jnp.einsum("tke,tk->te", grouped_experts(x, experts, kernels), weights.astype(x.dtype))
    return _expert_parallel(plan, x, experts, weights, kernels)


@dataclasses.dataclass(frozen=True)
class _ExpertPlan:
    """How the active rules lay out one sparse MLP: mesh axes of the flat token dim, of the
    experts' `expert` dim and of their `mlp` dim."""

    mesh: Any
    tokens: tuple[str, ...]
    experts: tuple[str, ...]
    mlp: tuple[str, ...]


def _names(entry) -> tuple[str, ...]:
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def _expert_plan(num_experts: int) -> _ExpertPlan | None:
    """The expert-parallel layout under the active rules, or None when the experts are whole."""
    mesh, rules = sharding.current_mesh(), sharding.current_rules()
    if mesh is None or sharding.logical_axis_size(mesh, "expert", rules) == 1:
        return None
    kernel = sharding.logical_to_spec(("expert", "embed", "mlp"), rules, mesh)
    act = sharding.logical_to_spec(("batch", "length", "embed"), rules, mesh)
    plan = _ExpertPlan(mesh, _names(act[0]) + _names(act[1]), _names(kernel[0]), _names(kernel[2]))
    parts = math.prod(mesh.shape[a] for a in plan.experts)
    if num_experts % parts:
        raise ValueError(f"num_experts={num_experts} does not split over the {parts} expert-parallel devices "
                         f"(mesh axes {plan.experts}, the `expert` sharding rule); make those mesh axes "
                         f"divide num_experts (e.g. a smaller mesh.fsdp, the other devices on mesh.data)")
    return plan


# (token, expert) pairs one device runs through its experts in one step of the expert-parallel
# dispatch: more gathered pairs go in steps of a scan (bounds the [pairs, embed] buffers)
EP_STEP_PAIRS = 1 << 16


def _expert_parallel(plan: _ExpertPlan, x, experts, weights, kernels):
    """`expert_mix` with the experts split over `plan.experts`: every device holds E/n experts
    (and its `mlp` slice of them). Under `shard_map`, each device all-gathers the tokens (with
    their expert ids and weights) of the devices that share its data but hold other experts, runs
    its own experts on the pairs routed to them (`_own_experts`), and a reduce-scatter over the
    expert axes sums the shards' partial outputs and hands each device back its own tokens (a
    psum over the `mlp` axes adds the tensor-parallel parts). More than `EP_STEP_PAIRS` gathered
    pairs run in steps of a rematerialised scan over row blocks, so the per-pair buffers stay that
    size whatever the expert-parallel group (capacity-free in every step: a block's pairs may all
    be this device's). Token counts are padded to a multiple of the token shards (zero weight)."""
    mesh, T = plan.mesh, x.shape[0]
    k = experts.shape[1]
    pad = -T % math.prod(mesh.shape[a] for a in plan.tokens)
    if pad:
        x, experts, weights = (jnp.pad(a, ((0, pad), (0, 0))) for a in (x, experts, weights))
    gather = tuple(a for a in plan.experts if a in plan.tokens)  # tokens split over these: gather
    reduce = tuple(a for a in plan.experts if a not in plan.tokens) + plan.mlp  # partial sums: add
    P = jax.sharding.PartitionSpec
    tok, ker = P(plan.tokens or None), P(plan.experts, None, plan.mlp or None)
    down = P(plan.experts, plan.mlp or None, None)

    dense = dense_experts(kernels)

    def local(x, ids, w, gate_w, up_w, down_w):
        if gather:
            x, ids, w = (jax.lax.all_gather(a, gather, axis=0, tiled=True) for a in (x, ids, w))
        shard = 0
        for a in plan.experts:  # this device's expert block, major axis first (as the sharding)
            shard = shard * mesh.shape[a] + jax.lax.axis_index(a)
        kern = (gate_w, up_w, down_w)
        own = _own_experts_dense if dense else _own_experts
        rows, steps = x.shape[0], -(-x.shape[0] * k // EP_STEP_PAIRS)
        if steps <= 1:
            y = own(x, ids, w, shard, kern)
        else:
            block = -(-rows // steps)
            xs = [jnp.pad(a, ((0, block * steps - rows), (0, 0))).reshape(steps, block, -1) for a in (x, ids, w)]
            step = jax.checkpoint(lambda _, xiw: (None, own(*xiw, shard, kern)))
            y = jax.lax.scan(step, None, tuple(xs))[1].reshape(block * steps, -1)[:rows]
        if gather:
            y = jax.lax.psum_scatter(y, gather, scatter_dimension=0, tiled=True)
        return jax.lax.psum(y, reduce) if reduce else y

    fn = jax.shard_map(local, mesh=mesh, in_specs=(tok, tok, tok, ker, ker, down), out_specs=tok)
    y = fn(x, experts, weights.astype(x.dtype), *kernels)
    return y[:T] if pad else y


def _own_experts(x, ids, w, shard, kernels):
    """One device's share of `expert_mix`: x [R, e], ids int32 [R, k] (global expert ids), w [R, k];
    kernels the device's experts `shard * E_local ...` -> [R, e], the weighted sum over each row's
    pairs routed to those experts (0 for the others). The pairs are sorted by local expert id and
    run with `ragged_dot` on the local group sizes; pairs of other shards' experts sort last,
    outside every group, and are zeroed."""
    k, n_local = ids.shape[1], kernels[0].shape[0]
    own = ids - shard * n_local
    mine = (own >= 0) & (own < n_local)
    flat = jnp.where(mine, own, n_local).reshape(-1)  # other shards' pairs: one group past the end
    order = jnp.argsort(flat, stable=True)
    sizes = jnp.bincount(flat, length=n_local + 1)[:n_local].astype(jnp.int32)
    out = _ragged_swiglu(jnp.take(x, order // k, axis=0), sizes, kernels)
    mine = mine.reshape(-1)[order]
    scale = jnp.where(mine, w.reshape(-1)[order], 0)[:, None]
    out = jnp.where(mine[:, None], out * scale, 0)  # rows outside every group: 0 whatever the kernel left
    return jnp.zeros(x.shape, out.dtype).at[order // k].add(out)


def _own_experts_dense(x, ids, w, shard, kernels):
    """`_own_experts` with every local expert run on every row (`dense_experts`)."""
    n_local = kernels[0].shape[0]
    return _dense_swiglu(x, _route_matrix(ids, w, n_local, shard * n_local), kernels)


class SparseMLP(nnx.Module):
    """A mixture-of-experts MLP (Qwen3-MoE's `mlp`, Mixtral's `block_sparse_moe`): the router
    `gate` kernel [e, E], then each token through its top-k experts (`route`, `expert_mix`),
    summed with the router weights."""

    def __init__(self, c: ModelConfig, n: int | None, rngs: nnx.Rngs):
        self.gate = nnx.Dict(kernel=_param(rngs, *_lead(n, (c.hidden_size, c.num_experts), ("embed", "expert")),
                                           c.param_dtype))
        names = ("w1", "w3", "w2") if c.model_type == "mixtral" else ("gate_proj", "up_proj", "down_proj")
        self.experts = _Experts(c, n, rngs, names)
        self.top_k, self.normalize = c.num_experts_per_tok, c.norm_topk_prob

    def router_logits(self, x):
        """[..., E] router logits (fp32 accumulation) of hidden states x [..., e]."""
        return jnp.einsum("...e,eE->...E", x, self.gate["kernel"][...].astype(x.dtype),
                          preferred_element_type=jnp.float32)

    def choose(self, logits, given=None):
        """The routing choice of tokens with router logits [T, E]: (weights fp32 [T, k], expert ids
        int32 [T, k]); the top-k (`route`), or with `given` int [T, k] the replayed experts
        (`replay_route`, router replay)."""
        if given is None:
            return route(logits, self.top_k, self.normalize)
        return replay_route(logits, given, self.top_k, self.normalize)

    def __call__(self, x, *, return_router_logits: bool = False, experts=None, return_experts: bool = False):
        """[b, t, e] -> [b, t, e]; with `return_router_logits`, also the router logits fp32 [b, t, E];
        with `return_experts`, also the chosen expert ids int32 [b, t, k] (after the logits).
        `experts` int [b, t, k]: replay these experts (`choose`)."""
        b, t, e = x.shape
        flat = x.reshape(b * t, e)
        logits = self.router_logits(flat)
        weights, experts = self.choose(logits, None if experts is None else experts.reshape(b * t, -1))
        out = expert_mix(flat, experts, weights, self.experts.kernels())  # [T, e]
        out = sharding.constrain(out.reshape(b, t, e), ("batch", "length", "embed"))
        extra = ((logits.reshape(b, t, -1),) if return_router_logits else ()) + (
            (experts.reshape(b, t, -1),) if return_experts else ())
        return (out, *extra) if extra else out


class DecoderLayers(nnx.Module):
    """All decoder layers; every parameter has a leading `layers` axis of size num_hidden_layers.
    With `stacked=False`, one layer without that axis (an element of the per-layer layout), with a
    sparse MLP when `sparse` (default: whether the model has experts), else a dense one.

    A Qwen3-MoE model with dense layers too (`config.mixed_layers`) keeps, stacked, the attention
    and norms of all layers, `mlp` the sparse MLPs of `config.sparse_layers` (leading axis of that
    length) and `dense_mlp` the dense MLPs of `config.dense_layers`; per layer, each layer's MLP is
    its `mlp`, as transformers names it."""

    def __init__(self, c: ModelConfig, rngs: nnx.Rngs, *, stacked: bool = True, fused: bool = False,
                 sparse: bool | None = None):
        n, e = (c.num_hidden_layers if stacked else None), c.hidden_size
        self.input_layernorm = RMSNorm(*_lead(n, (e,), ("embed",)), c.rms_norm_eps, c.param_dtype)
        self.self_attn = Attention(c, n, rngs, fused=fused)
        self.post_attention_layernorm = RMSNorm(*_lead(n, (e,), ("embed",)), c.rms_norm_eps, c.param_dtype)
        if stacked and c.mixed_layers:
            self.mlp = SparseMLP(c, len(c.sparse_layers), rngs)
            self.dense_mlp = MLP(c, len(c.dense_layers), rngs)
        elif c.is_moe if sparse is None else sparse:
            # under transformers' name: Mixtral's `block_sparse_moe`, Qwen3-MoE's `mlp`
            setattr(self, "block_sparse_moe" if c.model_type == "mixtral" else "mlp", SparseMLP(c, n, rngs))
        else:
            self.mlp = MLP(c, n, rngs, fused=fused)

    def layer(self, x, positions, inv_freq, kv_fn, *, return_router_logits: bool = False, experts=None,
              return_experts: bool = False):
        """One layer on a per-layer view of the parameters. kv_fn(k, v) -> (k_all, v_all, mask, extra);
        `mask` may instead be a function q -> attention output (the decode fast paths).
        Returns (x, extra), followed by the router logits [b, t, E] with `return_router_logits` and
        the chosen expert ids int32 [b, t, k] with `return_experts` (sparse layers only).
        `experts` int [b, t, k]: router replay of these experts (`SparseMLP.choose`)."""
        mlp = self.block_sparse_moe if hasattr(self, "block_sparse_moe") else self.mlp
        return _layer(self.input_layernorm, self.self_attn, self.post_attention_layernorm, mlp, x, positions,
                      inv_freq, kv_fn, return_router_logits=return_router_logits, experts=experts,
                      return_experts=return_experts)


def _layer(input_layernorm, self_attn, post_attention_layernorm, mlp, x, positions, inv_freq, kv_fn, *,
           return_router_logits: bool = False, experts=None, return_experts: bool = False):
    """`DecoderLayers.layer` on its parts (one layer's modules); a dense `mlp` returns no router
    outputs whatever the flags ask."""
    h = input_layernorm(x)
    q, k, v = self_attn.qkv(h, positions, inv_freq)
    k_all, v_all, mask, extra = kv_fn(k, v)
    o = mask(q) if callable(mask) else attend(q, k_all, v_all, mask)
    x = x + self_attn.out(o)
    x = sharding.constrain(x, ("batch", "length", "embed"))
    if isinstance(mlp, SparseMLP) and (return_router_logits or return_experts or experts is not None):
        y, *router = _as_tuple(mlp(post_attention_layernorm(x), return_router_logits=return_router_logits,
                                   experts=experts, return_experts=return_experts))
        return (sharding.constrain(x + y, ("batch", "length", "embed")), extra, *router)
    x = x + mlp(post_attention_layernorm(x))
    return sharding.constrain(x, ("batch", "length", "embed")), extra


def _as_tuple(x) -> tuple:
    return x if isinstance(x, tuple) else (x,)


_REMAT = {
    "full": None,
    "dots": jax.checkpoint_policies.checkpoint_dots,
    "dots_no_batch": jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims,
}


def segment_positions(segment_ids):
    """Positions restarting at 0 in every segment: token i of row b gets the number of earlier
    tokens of row b with its segment id; padding (id 0) gets 0. segment_ids int[b, t] (a packed
    row's attention mask: 1, 2, 3, ... per packed sequence, 0 padding; a 0/1 mask is one segment).
    Returns int32[b, t]. Exact for any order of ids (a stable sort per row, no Python loop)."""
    seg = jnp.asarray(segment_ids).astype(jnp.int32)
    t = seg.shape[-1]
    order = jnp.argsort(seg, axis=-1, stable=True)  # each id's tokens together, in row order
    ranked = jnp.take_along_axis(seg, order, axis=-1)
    idx = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), seg.shape)
    first = jnp.concatenate([jnp.ones_like(ranked[..., :1], jnp.bool_), ranked[..., 1:] != ranked[..., :-1]], -1)
    start = jax.lax.cummax(jnp.where(first, idx, 0), axis=seg.ndim - 1)  # rank of the id's first token
    pos = jnp.put_along_axis(jnp.zeros_like(seg), order, idx - start, axis=-1, inplace=False)
    return jnp.where(seg != 0, pos, 0)


def default_positions(attention_mask):
    """Positions when the caller gives none. int32[b, t]. Real tokens: `segment_positions` (for a
    0/1 mask, cumsum(mask) - 1: left-padded rows count from their first real token); padding:
    max(number of real tokens up to it - 1, 0), as before packing existed."""
    real = (attention_mask != 0).astype(jnp.int32)
    padding = jnp.maximum(jnp.cumsum(real, axis=-1) - 1, 0)
    return jnp.where(real != 0, segment_positions(attention_mask), padding)


def causal_padding_mask(attention_mask):
    """bool[b, t, t]: query i sees key j when j <= i, key j is a real token (id != 0) and, for a
    real query, key j has its segment id (a packed row's mask holds segment ids 1, 2, ...; a 0/1
    mask is one segment). A padding query sees the real keys up to it, as it did before packing
    (its output is never read by a real token)."""
    t = attention_mask.shape[-1]
    seg = attention_mask.astype(jnp.int32)
    causal = jnp.tril(jnp.ones((t, t), dtype=jnp.bool_))
    same = (seg[:, :, None] == seg[:, None, :]) | (seg[:, :, None] == 0)
    return causal[None] & same & (seg != 0)[:, None, :]


def layer_segments(kinds: tuple) -> list[tuple[int, int, tuple]]:
    """How the stacked layout runs layers of different kinds (e.g. dense / sparse MLPs): a list of
    (first layer, repeats, pattern), each one lax.scan of `repeats` iterations whose body runs the
    layers of `pattern` (a tuple of kinds) in order; together they cover the layers in order.
    Of the two plans, runs of one kind (e.g. dense layers first, then sparse ones) and the whole
    stack as repeats of its shortest period (e.g. dense, sparse, dense, sparse, ...), the one that
    traces fewer layer bodies."""
    kinds = tuple(kinds)
    n = len(kinds)
    runs, start = [], 0
    for i in range(1, n + 1):
        if i == n or kinds[i] != kinds[start]:
            runs.append((start, i - start, (kinds[start],)))
            start = i
    period = next(p for p in range(1, n + 1) if n % p == 0 and kinds == kinds[:p] * (n // p))
    periodic = [(0, n // period, kinds[:period])]
    return min(runs, periodic, key=lambda plan: (sum(len(pattern) for _, _, pattern in plan), len(plan)))


LAYER_LAYOUTS = ("stacked", "per_layer", "per_layer_fused")


def _check_layout(layer_layout: str) -> str:
    if layer_layout not in LAYER_LAYOUTS:
        raise ValueError(f"layer_layout must be one of {LAYER_LAYOUTS}, got {layer_layout!r}")
    return layer_layout


class Transformer(nnx.Module):
    """Embedding, the decoder layers and the final norm (Hugging Face's `model.*`).

    layer_layout "stacked" (training, checkpoints): `layers` is one `DecoderLayers` whose params
    have a leading `layers` axis, run under `lax.scan`. "per_layer" (the rollout engine's decode
    layout): `layers` is an `nnx.List` of one-layer `DecoderLayers`, run as an unrolled Python
    loop (no remat; compile time grows with depth).
    """

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, layer_layout: str = "stacked"):
        c = config
        self.config = c
        self.embed_tokens = nnx.Dict(
            embedding=_param(rngs, (c.vocab_size, c.hidden_size), ("vocab", "embed"), c.param_dtype))
        if _check_layout(layer_layout) == "stacked":
            self.layers = DecoderLayers(c, rngs)
        else:
            fused, sparse = layer_layout == "per_layer_fused", set(c.sparse_layers)
            self.layers = nnx.List([DecoderLayers(c, rngs, stacked=False, fused=fused, sparse=i in sparse)
                                    for i in range(c.num_hidden_layers)])
        self.norm = RMSNorm((c.hidden_size,), ("embed",), c.rms_norm_eps, c.param_dtype)

    @property
    def layer_layout(self) -> str:
        if isinstance(self.layers, DecoderLayers):
            return "stacked"
        return "per_layer_fused" if hasattr(self.layers[0].self_attn, "qkv_proj") else "per_layer"

    def embed(self, input_ids):
        x = jnp.take(self.embed_tokens["embedding"][...], input_ids, axis=0).astype(self.config.dtype)
        return sharding.constrain(x, ("batch", "length", "embed"))

    def _scan(self, x, positions, kv_fn, carry_extra, remat: bool, unroll: int | bool = 1,
              router: bool = False, experts=None, record: bool = False):
        """Runs the layers (lax.scan when stacked, a Python loop when per layer).
        kv_fn(layer_index, carry_extra, k, v) -> (k_all, v_all, mask, carry_extra); the index is a
        traced int32 when stacked, a Python int when per layer. Returns (hidden, carry_extra),
        followed by every sparse layer's router logits fp32 [S, b, t, E] with `router` and the
        chosen expert ids int32 [S, b, t, k] with `record` (MoE models; the scan's per-layer
        outputs; S = len(config.sparse_layers), all layers unless some are dense).
        `experts` int [S, b, t, k]: router replay of these experts in every sparse layer."""
        inv_freq = rope_inv_freq(self.config)
        flags = dict(return_router_logits=router, return_experts=record)
        if self.layer_layout != "stacked":
            outs, slot, sparse_layers = [], 0, set(self.config.sparse_layers)
            for i, layer in enumerate(self.layers):
                sparse = i in sparse_layers
                out = layer.layer(x, positions, inv_freq, lambda k, v, i=i, e=carry_extra: kv_fn(i, e, k, v),
                                  experts=None if experts is None or not sparse else experts[slot], **flags)
                x, carry_extra = out[:2]
                if sparse:
                    outs.append(out[2:])
                    slot += 1
            return (self.norm(x), carry_extra, *(jnp.stack(ys) for ys in zip(*outs)))
        if self.config.mixed_layers:
            return self._scan_mixed(x, positions, kv_fn, carry_extra, remat, unroll, inv_freq, flags, experts)
        graphdef, params = nnx.split(self.layers)

        def body(carry, xs):
            h, extra = carry
            i, p, given = xs
            layer = nnx.merge(graphdef, p)
            out = layer.layer(h, positions, inv_freq, lambda k, v: kv_fn(i, extra, k, v), experts=given, **flags)
            return out[:2], out[2:]

        if remat and self.config.remat != "none":
            body = jax.checkpoint(body, policy=_REMAT[self.config.remat], prevent_cse=False)
        n = self.config.num_hidden_layers
        (x, carry_extra), ys = jax.lax.scan(body, (x, carry_extra), (jnp.arange(n), params, experts),
                                            unroll=unroll)
        return (self.norm(x), carry_extra, *ys)

    def _scan_mixed(self, x, positions, kv_fn, carry_extra, remat, unroll, inv_freq, flags, experts):
        """`_scan` of stacked layers with dense and sparse MLPs (`config.mixed_layers`): for each
        segment of `layer_segments`, one lax.scan over its repeats, whose body runs the segment's
        pattern of layers (attention and norms sliced from the all-layer stacks, each MLP from
        its kind's stack). `unroll` counts layers, as in `_scan`: unroll // len(pattern)
        iterations, at least one. The sparse layers' outputs come back in layer order."""
        c = self.config
        sparse = set(c.sparse_layers)
        kinds = tuple(i in sparse for i in range(c.num_hidden_layers))
        common = {name: nnx.split(getattr(self.layers, name))
                  for name in ("input_layernorm", "self_attn", "post_attention_layernorm")}
        mlps = {True: nnx.split(self.layers.mlp), False: nnx.split(self.layers.dense_mlp)}
        ys_all = []
        for start, reps, pattern in layer_segments(kinds):
            p = len(pattern)
            before = {kind: sum(k == kind for k in kinds[:start]) for kind in (True, False)}
            counts = {kind: pattern.count(kind) for kind in (True, False)}

            def cut(tree, first, per):  # rows first .. first + reps * per, as [reps, per, ...]
                return jax.tree.map(lambda a: a[first:first + reps * per].reshape((reps, per) + a.shape[1:]), tree)

            xs_common = {name: cut(state, start, p) for name, (_, state) in common.items()}
            xs_mlp = {kind: cut(mlps[kind][1], before[kind], counts[kind]) for kind in (True, False) if counts[kind]}
            xs_given = None if experts is None or not counts[True] else cut(experts, before[True], counts[True])

            def body(carry, xs, start=start, pattern=pattern):
                h, extra = carry
                r, parts, mlp_parts, given = xs
                outs, seen = [], {True: 0, False: 0}
                for j, kind in enumerate(pattern):
                    i = start + r * len(pattern) + j
                    mods = [nnx.merge(common[name][0], jax.tree.map(lambda a, j=j: a[j], parts[name]))
                            for name in ("input_layernorm", "self_attn", "post_attention_layernorm")]
                    mlp = nnx.merge(mlps[kind][0], jax.tree.map(lambda a, s=seen[kind]: a[s], mlp_parts[kind]))
                    g = None if given is None or not kind else given[seen[True]]
                    seen[kind] += 1
                    out = _layer(*mods, mlp, h, positions, inv_freq, lambda k, v, i=i, e=extra: kv_fn(i, e, k, v),
                                 experts=g, **flags)
                    h, extra = out[:2]
                    if kind:
                        outs.append(out[2:])
                return (h, extra), tuple(jnp.stack(ys) for ys in zip(*outs))

            if remat and c.remat != "none":
                body = jax.checkpoint(body, policy=_REMAT[c.remat], prevent_cse=False)
            (x, carry_extra), ys = jax.lax.scan(body, (x, carry_extra),
                                                (jnp.arange(reps), xs_common, xs_mlp, xs_given),
                                                unroll=max(1, min(int(unroll) // p, reps)))
            if ys:
                ys_all.append(tuple(y.reshape((-1,) + y.shape[2:]) for y in ys))
        return (self.norm(x), carry_extra, *(jnp.concatenate(ys) for ys in zip(*ys_all)))

    def _check_router(self, what: str) -> None:
        if not self.config.is_moe:
            raise ValueError(f"{what} needs a mixture-of-experts model; "
                             f"model_type {self.config.model_type!r} has no router")

    def __call__(self, input_ids, *, attention_mask=None, positions=None, packed: bool | int = False,
                 router_logits: bool = False, routed_experts=None):
        """Final hidden states [b, t, e] of a full causal forward (training / scoring).

        attention_mask int[b, t]: 0 padding, else a segment id; a token sees the earlier-or-equal
        tokens of its own segment. A 0/1 mask is one sequence per row. `packed=True` (the
        caller's promise, static: the model cannot look at values under jit) says rows may hold
        several sequences (ids 1, 2, 3, ..., each sequence one contiguous run, ids distinct within
        a row); positions then should restart per sequence (`segment_positions`, the default
        when None). xla and splash mask by segment id whatever `packed` says; cudnn and rolled
        rotate rows when not packed and mask by each row's runs (cuDNN's packed layout) when packed.
        An int `packed` is also the most sequences any row holds (static): cuDNN's packed layout
        keeps softmax statistics per (row, sequence slot), so `True` (up to t sequences per row)
        costs t times the memory of one row's statistics, [b * t, heads, t] floats per layer; the
        packing passes give their rows-per-pack bound. A row with more sequences than `packed`
        would lose the extra ones: the caller must not pass a smaller bound.

        With `config.train_attention` cudnn/rolled, each row's real tokens must be one contiguous
        run (any left and right padding) unless packed; hidden states at padding positions are
        then zero. With xla and splash, hidden states at padding positions are unspecified (never
        read by real tokens).

        When the active sharding rules split the sequence (`mesh.context` > 1 under the train
        rules), attention runs context-parallel (`_context_parallel`: all-to-all under
        shard_map, the same kernel kind on whole sequences, masked by segment ids as above).

        `router_logits` (static; MoE models only): return (hidden, every sparse layer's router
        logits fp32 [S, b, t, E], S = len(config.sparse_layers)) in the input's token order,
        padding positions included (mask them with `attention_mask != 0`); the same program
        otherwise (the logits are the layer scan's per-layer output, under the same remat).

        `routed_experts` (MoE models): router replay (R3). int [b, t, S, k], the expert ids every
        sparse layer uses for each token instead of its own top-k (the gate weights recomputed
        from this forward's router logits: `replay_route`); a token whose ids are negative keeps
        its own.
        """
        if router_logits:
            self._check_router("router_logits=True")
        if routed_experts is not None:
            self._check_router("routed_experts (router replay)")
        if attention_mask is None:
            attention_mask = jnp.ones(input_ids.shape, jnp.int32)
        if positions is None:
            positions = default_positions(attention_mask)
        c = self.config
        impl = _train_attention_impl(c)
        unroll = self._unroll(c.layer_unroll)

        given = routed_experts

        def layers(x, pos, kv_fn):  # -> (hidden, router logits or None)
            experts = None if given is None else jnp.moveaxis(jnp.asarray(given), 2, 0)  # [S, b, t, k]
            out = self._scan(x, pos, kv_fn, (), remat=True, unroll=unroll, router=router_logits,
                             experts=experts)
            return out[0], (out[2] if router_logits else None)

        def done(h, logits=None):
            return (h, logits) if router_logits else h
        if context_parts() > 1:  # the rules split the sequence: attention all-to-all over `context`
            segments = attention_mask.astype(jnp.int32)
            runs = 1 if not packed else None if packed is True else int(packed)  # sequences per row
            attention = functools.partial(context_attention, functools.partial(_local_attention, impl, runs),
                                          segments)
            h, lg = layers(self.embed(input_ids), positions, lambda i, e, k, v: (k, v, attention(k, v), e))
            if impl in ("cudnn", "rolled"):  # as on their own paths: zero at padding
                h = jnp.where(segments[..., None] != 0, h, 0).astype(h.dtype)
            return done(h, lg)
        if impl == "splash":
            segments = attention_mask.astype(jnp.int32)
            h, lg = layers(self.embed(input_ids), positions, lambda i, e, k, v: (k, v, _splash(segments, k, v), e))
            return done(h, lg)
        if impl == "xla":
            mask = causal_padding_mask(attention_mask)
            h, lg = layers(self.embed(input_ids), positions, lambda i, e, k, v: (k, v, mask, e))
            return done(h, lg)
        real = attention_mask.astype(jnp.bool_)
        if packed:
            runs = _segment_runs(attention_mask, None if packed is True else int(packed))
            attention = functools.partial(_packed_attention, impl, *runs, real)
            h, lg = layers(self.embed(input_ids), positions, lambda i, e, k, v: (k, v, attention(k, v), e))
            return done(jnp.where(real[..., None], h, 0).astype(h.dtype), lg)
        t = real.shape[1]
        start = jnp.argmax(real, axis=1).astype(jnp.int32)  # first real token (0 for empty rows)
        lengths = real.sum(axis=1, dtype=jnp.int32)
        fwd = (jnp.arange(t, dtype=jnp.int32)[None, :] + start[:, None]) % t  # rotate left by start
        back = (jnp.arange(t, dtype=jnp.int32)[None, :] - start[:, None]) % t

        def rot(x, idx):
            return jnp.take_along_axis(x, idx.reshape(idx.shape + (1,) * (x.ndim - 2)), axis=1)

        attention = functools.partial(_flash_attention, impl, lengths)
        if given is not None:  # the replayed experts follow their tokens
            given = rot(jnp.asarray(given), fwd)
        h, lg = layers(self.embed(rot(input_ids, fwd)), rot(positions, fwd),
                       lambda i, e, k, v: (k, v, attention(k, v), e))
        h = jnp.where(real[..., None], rot(h, back), 0).astype(h.dtype)
        return done(h, None if lg is None else jax.vmap(lambda x: rot(x, back))(lg))

    def prefill(self, input_ids, *, attention_mask=None, positions=None, record_experts: bool = False):
        """Full forward that also returns the cache. Returns (hidden [b, t, e], KVCache of t tokens
        in the model's layer layout: [L, b, t, kvh, d] stacked, or L arrays [b, t, kvh, d]), and with
        `record_experts` (MoE models, router replay) every sparse layer's chosen expert ids int32
        [S, b, t, k] third (S = len(config.sparse_layers))."""
        if record_experts:
            self._check_router("record_experts=True")
        c = self.config
        b, t = input_ids.shape
        if attention_mask is None:
            attention_mask = jnp.ones(input_ids.shape, jnp.int32)
        if positions is None:
            positions = default_positions(attention_mask)
        if _train_attention_impl(c) == "splash":
            segments = attention_mask.astype(jnp.int32)
            mask = lambda k, v: _splash(segments, k, v)  # noqa: E731
        else:
            dense = causal_padding_mask(attention_mask)
            mask = lambda k, v: dense  # noqa: E731
        if self.layer_layout != "stacked":
            def kv_fn(i, cache, k, v):
                return k, v, mask(k, v), KVCache(cache.k + (k.astype(c.dtype),), cache.v + (v.astype(c.dtype),))

            return self._scan(self.embed(input_ids), positions, kv_fn, KVCache((), ()), remat=False,
                              record=record_experts)
        shape = (c.num_hidden_layers, b, t, c.num_key_value_heads, c.head_dim)
        cache = KVCache(jnp.zeros(shape, c.dtype), jnp.zeros(shape, c.dtype))

        def kv_fn(i, cache, k, v):
            cache = KVCache(cache.k.at[i].set(k), cache.v.at[i].set(v))
            return k, v, mask(k, v), cache

        return self._scan(self.embed(input_ids), positions, kv_fn, cache, remat=False,
                          unroll=self._unroll(c.layer_unroll), record=record_experts)

    def _unroll(self, u: int) -> int:
        return int(u) if int(u) > 0 else self.config.num_hidden_layers

    def decode(self, input_ids, *, positions, cache: KVCache, cache_index, record_experts: bool = False):
        """Append tokens to a cache and attend to it.

        input_ids, positions int32[b, t]; cache in the model's layer layout ([L, b, s, kvh, d]
        stacked, a tuple of L [b, s, kvh, d] per layer); cache_index int32[b] is where row b's
        first new token is written. Query j of row b sees cache slots <= cache_index[b] + j.
        Returns (hidden [b, t, e], updated KVCache), and with `record_experts` (MoE models) every
        sparse layer's chosen expert ids int32 [S, b, t, k] third.
        """
        if record_experts:
            self._check_router("record_experts=True")
        per_layer = self.layer_layout != "stacked"
        if cache.per_layer != per_layer:
            raise ValueError(f"decode: the KV cache is {'per layer' if cache.per_layer else 'stacked'}"
                             f" but the model's layers are {self.layer_layout}; build the cache in "
                             f"the model's layout")
        k0 = cache.k[0] if per_layer else jax.ShapeDtypeStruct(cache.k.shape[1:], cache.k.dtype)
        b, t = input_ids.shape
        s = k0.shape[1]  # one layer's cache is [b, s, kvh, d]
        write = cache_index[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]  # [b, t]
        mask = jnp.arange(s, dtype=jnp.int32)[None, None, :] <= write[:, :, None]  # [b, t, s]
        rows = jnp.arange(b, dtype=jnp.int32)[:, None]
        impl = _decode_attention_impl(self.config, t, k0.dtype, k0.shape[-1], s)
        kv_lengths = jnp.minimum(cache_index + 1, s).astype(jnp.int32)  # t == 1: slots <= write
        attention = functools.partial(_decode_attention, impl, mask, kv_lengths)

        compute = self.config.dtype
        if impl == "triton":  # reads an fp8 cache itself
            read = lambda x: x  # noqa: E731
        else:
            read = functools.partial(_from_cache, dtype=compute)

        if per_layer:
            def kv_fn(i, cache, k, v):
                # each layer's cache is its own (donated) buffer: scatter the new tokens in place
                # and let attention read it where it lies
                k_i = cache.k[i].at[rows, write].set(to_cache(k, cache.k[i].dtype), mode="drop")
                v_i = cache.v[i].at[rows, write].set(to_cache(v, cache.v[i].dtype), mode="drop")
                new = KVCache(_replace(cache.k, i, k_i), _replace(cache.v, i, v_i))
                k_r, v_r = read(k_i), read(v_i)
                return k_r, v_r, attention(k_r, v_r), new

            return self._scan(self.embed(input_ids), positions, kv_fn, cache, remat=False,
                              record=record_experts)

        def kv_fn(i, cache, k, v):
            # in-place scatter of the new tokens into the carried cache (only b * t rows move)
            k_all = cache.k.at[i, rows, write].set(to_cache(k, cache.k.dtype), mode="drop")
            v_all = cache.v.at[i, rows, write].set(to_cache(v, cache.v.dtype), mode="drop")
            k_i = read(jax.lax.dynamic_index_in_dim(k_all, i, 0, keepdims=False))
            v_i = read(jax.lax.dynamic_index_in_dim(v_all, i, 0, keepdims=False))
            return k_i, v_i, attention(k_i, v_i), KVCache(k_all, v_all)

        unroll = self._unroll(self.config.decode_unroll)
        return self._scan(self.embed(input_ids), positions, kv_fn, cache, remat=False, unroll=unroll,
                          record=record_experts)


def _replace(xs: tuple, i: int, x) -> tuple:
    return xs[:i] + (x,) + xs[i + 1:]


def _train_attention_impl(config: ModelConfig) -> str:
    """The full-forward attention `config.train_attention` resolves to."""
    impl = config.train_attention
    if impl == "auto":
        if _pallas_ok(config.dtype, config.head_dim):
            return "splash"
        return "cudnn" if _cudnn_ok(config.dtype, config.head_dim) else "xla"
    return impl


def _splash(segment_ids, k, v):
    """The `mask` argument of `DecoderLayers.layer` for the splash path: q -> causal attention
    within segments (segment ids = the attention mask)."""
    return lambda q: _kernels.splash_causal(q, k, v, segment_ids).astype(q.dtype)


def _local_attention(impl, max_runs, segment_ids, q, k, v):
    """One device's attention over whole sequences for a head slice (the context-parallel path,
    `_context_parallel`): causal within segment ids (0 padding), by the kind `impl`. cudnn and
    rolled mask by each row's runs of equal ids (their packed layout; an unpacked row is one run),
    at most `max_runs` per row (None: the row length)."""
    if impl == "splash":
        return _kernels._splash_local(q, k, v, segment_ids, interpret=_kernels.target_platform() != "tpu")
    if impl in ("cudnn", "rolled"):
        offsets, lengths = _segment_runs(segment_ids, max_runs)
        return _packed_attention(impl, offsets, lengths, segment_ids != 0, k, v)(q)
    return attend(q, k, v, causal_padding_mask(segment_ids))


def _flash_attention(impl, lengths, k, v):
    """The `mask` argument of `DecoderLayers.layer` for a rotated full forward: q -> causal
    attention over each row's first `lengths` tokens (cuDNN flash, or XLA for "rolled")."""
    def run(q):
        out = jax.nn.dot_product_attention(
            q, k.astype(q.dtype), v.astype(q.dtype), is_causal=True, query_seq_lengths=lengths,
            key_value_seq_lengths=lengths, implementation="cudnn" if impl == "cudnn" else "xla")
        return out.astype(q.dtype)
    return run


def _segment_runs(segment_ids, max_runs: int | None = None):
    """Each row's runs of equal non-zero ids, in cuDNN's packed layout: (offsets int32[b, n + 1],
    lengths int32[b, n]); run r of row b covers tokens [offsets[b, r], offsets[b, r] + lengths[b, r]),
    unused entries are -1. n = `max_runs` (static; None: t, the most a row can hold)."""
    seg = segment_ids.astype(jnp.int32)
    b, t = seg.shape
    n = t if max_runs is None else max(1, min(int(max_runs), t))
    edge = jnp.zeros((b, 1), jnp.int32)
    prev = jnp.concatenate([edge, seg[:, :-1]], axis=1)
    nxt = jnp.concatenate([seg[:, 1:], edge], axis=1)
    first = jax.vmap(lambda r: jnp.nonzero(r, size=n, fill_value=-1)[0])((seg != 0) & (seg != prev))
    last = jax.vmap(lambda r: jnp.nonzero(r, size=n, fill_value=-1)[0])((seg != 0) & (seg != nxt))
    lengths = jnp.where(first >= 0, last - first + 1, -1).astype(jnp.int32)
    offsets = jnp.concatenate([first.astype(jnp.int32), jnp.full((b, 1), -1, jnp.int32)], axis=1)
    return offsets, lengths


def _runs_mask(offsets, lengths, t: int):
    """bool[b, t, t] from `_segment_runs`: query i sees key j <= i of its own run (what cuDNN's
    packed layout computes; the "rolled" path's XLA stand-in for it)."""
    idx = jnp.arange(t, dtype=jnp.int32)
    start = offsets[:, :-1, None]
    inside = (start >= 0) & (idx >= start) & (idx < start + lengths[:, :, None])  # [b, runs, t]
    same = jnp.einsum("bri,brj->bij", inside.astype(jnp.int32), inside.astype(jnp.int32)) > 0
    return same & jnp.tril(jnp.ones((t, t), jnp.bool_))[None]


@jax.custom_vjp
def _zero_cotangent_at_padding(x, real):
    """Identity on x [b, t, ...]; its gradient is zeroed at padding tokens (real bool[b, t]).
    cuDNN's packed-layout backward returns NaN dq/dk/dv at tokens outside every run (seen on the
    H200, JAX 0.11.2); a NaN there would reach the weight gradients through the projections."""
    return x


def _zero_cotangent_fwd(x, real):
    return x, real


def _zero_cotangent_bwd(real, g):
    return jnp.where(real.reshape(real.shape + (1,) * (g.ndim - 2)), g, jnp.zeros_like(g)), None


_zero_cotangent_at_padding.defvjp(_zero_cotangent_fwd, _zero_cotangent_bwd)


@functools.lru_cache(maxsize=1)
def _cudnn_packed_gqa_ok() -> bool:
    """Whether this JAX scales cuDNN's packed kv offsets by the keys' own per-token stride. Older
    JAX (jax-ml/jax#39521, e.g. 0.10.2) used the queries' stride, so with fewer kv heads than
    query heads the keys of every segment but the first were read from the wrong tokens, silently;
    there the packed path repeats k/v to the query heads (JAX 0.11.2 on the H200 has the fix: the
    packed path without the repeat matched XLA's segment mask, forward and gradients). Probed on
    tiny concrete arrays."""
    from jax._src.cudnn import fused_attention_stablehlo as cudnn

    with jax.ensure_compile_time_eval():
        q, k = jnp.zeros((1, 4, 2, 8)), jnp.zeros((1, 4, 1, 8))  # 2 query heads, 1 kv head
        offsets, lengths = jnp.asarray([[0, 2, -1]], jnp.int32), jnp.asarray([[2, 2]], jnp.int32)
        _, _, _, kv_offsets = cudnn._fix_seqlen_offsets(lengths, lengths, offsets, offsets, q, k)
        return int(kv_offsets.reshape(-1)[1]) == 2 * 1 * 8  # segment 2 starts 2 tokens x 1 head x 8 in


def _packed_attention(impl, offsets, lengths, real, k, v):
    """The `mask` argument of `DecoderLayers.layer` for packed rows under cudnn/rolled: q ->
    causal attention within each run of equal segment ids; zero at padding. cudnn: cuDNN flash
    attention's packed layout (per-row run offsets and lengths; the private
    `jax._src.cudnn.fused_attention_stablehlo` API, which `jax.nn.dot_product_attention` does not
    expose); rolled: XLA attention with the same runs as a dense mask (its CPU stand-in)."""
    def run(q):
        kq, vq = k.astype(q.dtype), v.astype(q.dtype)
        if impl == "cudnn":
            from jax._src.cudnn import fused_attention_stablehlo as cudnn

            q, kq, vq = (_zero_cotangent_at_padding(x, real) for x in (q, kq, vq))
            if kq.shape[2] != q.shape[2] and not _cudnn_packed_gqa_ok():
                g = q.shape[2] // kq.shape[2]  # query head j uses kv head j // g, as in `attend`
                kq, vq = jnp.repeat(kq, g, axis=2), jnp.repeat(vq, g, axis=2)
            out = cudnn.dot_product_attention(
                q, kq, vq, q_seqlen=lengths, kv_seqlen=lengths, q_offsets=offsets, kv_offsets=offsets,
                scale=1.0 / math.sqrt(q.shape[-1]), mask_type=cudnn.MaskType.PADDING_CAUSAL)
        else:
            mask = _runs_mask(offsets, lengths, q.shape[1])[:, None]
            out = jax.nn.dot_product_attention(q, kq, vq, mask=mask, implementation="xla")
        return jnp.where(real[:, :, None, None], out, 0).astype(q.dtype)
    return run


def _decode_attention(impl, mask, kv_lengths, k_i, v_i):
    """The `mask` argument of `DecoderLayers.layer` for one layer's cache [b, s, kvh, d]: the bool
    mask itself (einsum) or a function q -> attention output (the decode fast paths)."""
    if impl == "reduce":
        return lambda q: attend_one(q, k_i, v_i, kv_lengths)
    if impl == "cudnn":
        return lambda q: _attend_one_cudnn(q, k_i, v_i, kv_lengths).astype(q.dtype)
    if impl == "pallas":
        return lambda q: _kernels.decode_attention(q, k_i, v_i, kv_lengths).astype(q.dtype)
    if impl == "triton":
        return lambda q: _kernels.triton_decode_attention(q, k_i, v_i, kv_lengths).astype(q.dtype)
    return mask


def unstack_layers(params: dict, sparse_layers: tuple[int, ...] | None = None) -> dict:
    """A pure param dict (`nnx.to_pure_dict` layout, `CausalLM` or `ValueModel`) with stacked
    layers -> the same weights in the per-layer layout (`params["model"]["layers"]` becomes
    `{i: layer i's params}`). Slices, so it copies; run it inside a jit (fused with a cast).
    A model with dense and sparse layers (a `dense_mlp` stack) needs `sparse_layers`
    (`config.sparse_layers`): which layer each row of the two MLP stacks belongs to."""
    layers = dict(params["model"]["layers"])
    n = layers["input_layernorm"]["scale"].shape[0]
    owner = {}  # layer -> (stack name, row)
    if "dense_mlp" in layers:
        if sparse_layers is None:
            raise ValueError("unstack_layers: these stacked layers have dense and sparse MLPs "
                             "(`dense_mlp` and `mlp`); pass sparse_layers=config.sparse_layers")
        sparse = tuple(sparse_layers)
        dense = tuple(i for i in range(n) if i not in set(sparse))
        rows = {"mlp": layers["mlp"]["gate"]["kernel"].shape[0],
                "dense_mlp": jax.tree.leaves(layers["dense_mlp"])[0].shape[0]}
        if (len(sparse), len(dense)) != (rows["mlp"], rows["dense_mlp"]):
            raise ValueError(f"unstack_layers: sparse_layers={list(sparse)} gives {len(sparse)} sparse and "
                             f"{len(dense)} dense layers of {n}, but the stacks hold {rows['mlp']} and "
                             f"{rows['dense_mlp']}")
        owner = {i: ("mlp", r) for r, i in enumerate(sparse)} | {i: ("dense_mlp", r) for r, i in enumerate(dense)}
        mlps = {name: layers.pop(name) for name in ("mlp", "dense_mlp")}
    per = {}
    for i in range(n):
        per[i] = jax.tree.map(lambda x, i=i: x[i], layers)
        if owner:
            name, r = owner[i]
            per[i]["mlp"] = jax.tree.map(lambda x, r=r: x[r], mlps[name])
    return {**params, "model": {**params["model"], "layers": per}}


def _fuse_layer(layer: dict) -> dict:
    """One layer's q/k/v -> `qkv_proj` and gate/up -> `gate_up_proj`; also a stacked layer dict
    (leading [L] axis on every leaf: the axes are counted from the end). A sparse MLP's experts
    are left as they are (only attention is fused)."""
    attn, mlp = dict(layer["self_attn"]), dict(layer.get("mlp", {}))
    q, k, v = attn.pop("q_proj"), attn.pop("k_proj"), attn.pop("v_proj")
    kvh = k["kernel"].shape[-2]

    def group(x):  # [..., h, d] -> [..., kvh, g, d]
        return x.reshape(x.shape[:-2] + (kvh, -1) + x.shape[-1:])

    qkv = {"kernel": jnp.concatenate([group(q["kernel"]), k["kernel"][..., None, :], v["kernel"][..., None, :]],
                                     axis=-2)}
    if "bias" in q:
        qkv["bias"] = jnp.concatenate([group(q["bias"]), k["bias"][..., None, :], v["bias"][..., None, :]], axis=-2)
    if "gate_proj" not in mlp:  # a sparse MLP (or Mixtral's block_sparse_moe): experts stay as they are
        return {**layer, "self_attn": {"qkv_proj": qkv, **attn}}
    gate, up = mlp.pop("gate_proj"), mlp.pop("up_proj")
    return {**layer, "self_attn": {"qkv_proj": qkv, **attn},
            "mlp": {"gate_up_proj": {"kernel": jnp.stack([gate["kernel"], up["kernel"]], axis=-2)}, **mlp}}


def _unfuse_layer(layer: dict) -> dict:
    attn, mlp = dict(layer["self_attn"]), dict(layer.get("mlp", {}))
    qkv = attn.pop("qkv_proj")
    g = qkv["kernel"].shape[2] - 2

    def heads(x):  # [..., kvh, g, d] -> [..., h, d]
        return x.reshape(x.shape[:-3] + (-1, x.shape[-1]))

    kern = qkv["kernel"]
    out = {"q_proj": {"kernel": heads(kern[:, :, :g])}, "k_proj": {"kernel": kern[:, :, g]},
           "v_proj": {"kernel": kern[:, :, g + 1]}}
    if "bias" in qkv:
        bias = qkv["bias"]
        out["q_proj"]["bias"], out["k_proj"]["bias"], out["v_proj"]["bias"] = heads(bias[:, :g]), bias[:, g], bias[:, g + 1]
    if "gate_up_proj" not in mlp:  # a sparse MLP: never fused
        return {**layer, "self_attn": {**out, **attn}}
    gate_up = mlp.pop("gate_up_proj")["kernel"]
    return {**layer, "self_attn": {**out, **attn},
            "mlp": {"gate_proj": {"kernel": gate_up[:, 0]}, "up_proj": {"kernel": gate_up[:, 1]}, **mlp}}


def params_layout(params: dict) -> str:
    """The layer layout of a pure param dict: "stacked", "per_layer" or "per_layer_fused"."""
    layers = params["model"]["layers"]
    if "self_attn" in layers:
        return "stacked"
    return "per_layer_fused" if "qkv_proj" in layers[0]["self_attn"] else "per_layer"


def convert_layers(params: dict, layout: str, sparse_layers: tuple[int, ...] | None = None) -> dict:
    """A pure param dict in any layer layout -> the same weights in `layout` (copies: run it inside
    a jit, fused with a cast). per_layer_fused concatenates each layer's q/k/v kernels (and biases)
    into `qkv_proj` [e, kvh, g + 2, d] (kv head j: its g query heads, its key, its value) and
    stacks gate/up into `gate_up_proj` [e, 2, f]. `sparse_layers`: as `unstack_layers`."""
    source = params_layout(params)
    if source == _check_layout(layout):
        return params
    mixed = source == "stacked" and "dense_mlp" in params["model"]["layers"]
    if source == "stacked" and layout == "per_layer_fused" and not mixed:
        # fuse the stacked arrays, then slice the layers: one multi-output copy per weight
        return unstack_layers({**params, "model": {**params["model"],
                                                   "layers": _fuse_layer(params["model"]["layers"])}})
    if source == "stacked":
        params = unstack_layers(params, sparse_layers)
    elif source == "per_layer_fused":
        layers = params["model"]["layers"]
        params = {**params, "model": {**params["model"],
                                      "layers": {i: _unfuse_layer(layers[i]) for i in range(len(layers))}}}
    if layout == "stacked":
        return stack_layers(params)
    if layout == "per_layer_fused":
        layers = params["model"]["layers"]
        return {**params, "model": {**params["model"],
                                    "layers": {i: _fuse_layer(layers[i]) for i in range(len(layers))}}}
    return params


def stack_layers(params: dict) -> dict:
    """The inverse of `unstack_layers` (per-layer pure dict -> stacked). Layers whose `mlp` differ
    in kind (dense and sparse) stack the sparse ones' as `mlp`, the dense ones' as `dense_mlp`."""
    per = params["model"]["layers"]
    layers = [per[i] for i in range(len(per))]
    sparse = [i for i, layer in enumerate(layers) if "experts" in layer.get("mlp", {})]
    if 0 < len(sparse) < len(layers):
        common = [{k: v for k, v in layer.items() if k != "mlp"} for layer in layers]
        stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *common)
        stacked["mlp"] = jax.tree.map(lambda *xs: jnp.stack(xs), *(layers[i]["mlp"] for i in sparse))
        stacked["dense_mlp"] = jax.tree.map(lambda *xs: jnp.stack(xs),
                                            *(layer["mlp"] for i, layer in enumerate(layers) if i not in sparse))
    else:
        stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *layers)
    return {**params, "model": {**params["model"], "layers": stacked}}


class CausalLM(nnx.Module):
    """Decoder with a language-model head. `model(input_ids)` -> logits [b, t, vocab].
    `layer_layout`: see `Transformer` ("per_layer" is the rollout engine's decode layout)."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, layer_layout: str = "stacked"):
        self.config = config
        self.lora_spec = None  # a models.LoraSpec once `add_lora` gave it adapters
        self.model = Transformer(config, rngs=rngs, layer_layout=layer_layout)
        if not config.tie_word_embeddings:
            self.lm_head = nnx.Dict(kernel=_param(
                rngs, (config.hidden_size, config.vocab_size), ("embed", "vocab"), config.param_dtype))

    def unembed(self) -> tuple[jax.Array, str]:
        """(weight, layout) mapping final hidden states to logits, as stored: the tied embedding
        [vocab, embed] ("ve") or the LM head [embed, vocab] ("ev"); no transposed copy."""
        if self.config.tie_word_embeddings:
            return self.model.embed_tokens["embedding"][...], "ve"
        return self.lm_head["kernel"][...], "ev"

    def unembed_matrix(self) -> jax.Array:
        """[embed, vocab] matrix mapping final hidden states to logits."""
        w, layout = self.unembed()
        return w.T if layout == "ve" else w

    def logits(self, hidden):
        # contract with the matrix as stored (a tied [vocab, embed] embedding is not transposed)
        w, layout = self.unembed()
        spec = "...e,ve->...v" if layout == "ve" else "...e,ev->...v"
        out = jnp.einsum(spec, hidden, w.astype(hidden.dtype), preferred_element_type=jnp.float32)
        return sharding.constrain(out, ("batch", "length", "vocab")) if out.ndim == 3 else out

    def hidden_states(self, input_ids, *, attention_mask=None, positions=None, packed: bool | int = False,
                      router_logits: bool = False, routed_experts=None):
        """Final hidden states [b, t, e] (and the router logits [L, b, t, E] with `router_logits`,
        MoE models); arguments as `Transformer.__call__` (`routed_experts`: router replay)."""
        return self.model(input_ids, attention_mask=attention_mask, positions=positions, packed=packed,
                          router_logits=router_logits, routed_experts=routed_experts)

    def __call__(self, input_ids, *, attention_mask=None, positions=None, packed: bool | int = False):
        """Logits (fp32) [b, t, vocab]. attention_mask: 0 padding, else segment ids (several
        sequences per row need `packed=True`; see `Transformer.__call__`)."""
        return self.logits(self.hidden_states(input_ids, attention_mask=attention_mask, positions=positions,
                                              packed=packed))

    def prefill(self, input_ids, *, attention_mask=None, positions=None, record_experts: bool = False):
        return self.model.prefill(input_ids, attention_mask=attention_mask, positions=positions,
                                  record_experts=record_experts)

    def decode(self, input_ids, *, positions, cache, cache_index, record_experts: bool = False):
        return self.model.decode(input_ids, positions=positions, cache=cache, cache_index=cache_index,
                                 record_experts=record_experts)


class ValueModel(nnx.Module):
    """Decoder with a scalar head per token (critic / reward model). `model(ids)` -> [b, t] fp32.

    Matches Hugging Face's `*ForTokenClassification` with `num_labels=1` (`score.weight/bias`).
    """

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, layer_layout: str = "stacked"):
        self.config = config
        self.lora_spec = None  # a models.LoraSpec once `add_lora` gave it adapters
        self.model = Transformer(config, rngs=rngs, layer_layout=layer_layout)
        self.score = nnx.Dict(
            kernel=_param(rngs, (config.hidden_size, 1), ("embed", None), config.param_dtype),
            bias=_zeros((1,), (None,), config.param_dtype))

    def __call__(self, input_ids, *, attention_mask=None, positions=None, packed: bool | int = False):
        """Values (fp32) [b, t]; arguments as `Transformer.__call__`."""
        h = self.model(input_ids, attention_mask=attention_mask, positions=positions, packed=packed)
        w = self.score["kernel"][...].astype(h.dtype)
        out = jnp.einsum("bte,eo->bto", h, w, preferred_element_type=jnp.float32)
        return out[..., 0] + self.score["bias"][...].astype(jnp.float32)[0]


def init_model(config: ModelConfig, *, seed: int = 0, value_head: bool = False,
               layer_layout: str = "stacked") -> Any:
    """A randomly initialised CausalLM (or ValueModel). The two layer layouts draw different
    random weights for one seed; convert a model's weights with `unstack_layers` instead."""
    cls = ValueModel if value_head else CausalLM
    return cls(config, rngs=nnx.Rngs(params=seed), layer_layout=layer_layout)


def abstract_model(config: ModelConfig, *, value_head: bool = False, layer_layout: str = "stacked"):
    """The model with ShapeDtypeStructs instead of arrays (nothing allocated)."""
    cls = ValueModel if value_head else CausalLM
    return nnx.eval_shape(lambda: cls(config, rngs=nnx.Rngs(params=0), layer_layout=layer_layout))


def count_params(model_or_state) -> int:
    state = nnx.state(model_or_state, nnx.Param) if isinstance(model_or_state, nnx.Module) else model_or_state
    return int(sum(math.prod(x.shape) for x in jax.tree.leaves(state)))
