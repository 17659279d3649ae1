"""`Engine`: a JetStream-API generation engine over our Flax decoder, with KV cache and weight sync.

It implements JetStream 0.2.2's `Engine` methods (prefill, insert, generate, init_decode_state,
load_params, ...) and the newer extras (bulk_insert, prefill_multisampling, free_resource,
per-token log-probs) *without importing jetstream*: `rollout.jetstream_adapter` wraps it for
JetStream's orchestrator and gRPC server. The RL path (`rollout.RolloutDriver`) drives the same
compiled pieces with an on-device multi-step loop.

Conventions:
- `max_target_length` is the total length (prompt + generated) of a slot, i.e. the KV cache length
  (MaxText's meaning). It must exceed `max_prefill_length`.
- Prompts are padded to a length bucket (16, 32, 64, ... up to `max_prefill_length`), so prefill
  compiles once per bucket, never per prompt length.
- Prefill caches all but a prompt's last token; the first `generate` after `insert` feeds that
  token and samples the first new token (JetStream 0.2.2 returns no token from prefill).
- Weights live as a plain dict of arrays (`nnx.State.to_pure_dict()` layout) on the rollout
  shardings; `update_params` reshards (or shares, zero-copy) the trainer's.
- Layer layout (`layer_layout`): "per_layer" keeps every layer's weights and KV cache in separate
  arrays and runs the layers as an unrolled loop, so a decode step reads them in place (the stacked
  layout slices layer i out of `[L, ...]` arrays inside the layer scan: copies on every step).
  "stacked" keeps the trainer's `[L, ...]` arrays, so a colocated trainer with the same dtype and
  sharding can share its buffers (zero-copy sync). "auto" picks stacked exactly when that sharing
  is possible for the params given at construction, else per_layer.
"""
from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

import sharding
from jaxrl_llm import models
from jaxrl_llm.models import LAYER_LAYOUTS, CausalLM, KVCache, ModelConfig, abstract_model, to_dtype
from jaxrl_llm.models._quant import check_quantization

from ._sampling import SamplingParams, sample
from ._state import DecodeState, Prefix, ResultTokens
from ._weights import WeightSync, resolve_layout

# JetStream's padding buckets (token_utils.pad_tokens); max_prefill_length must be one of them.
PROGRAM_NAMES = ("prefill", "insert", "generate", "decode_loop", "weight_sync")  # Engine.lower's
PREFILL_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)
_PREFIX_AXES = ("layers", None, "cache_length", "kv_heads", "head_dim")
# batch_invariant: every prefill / append call computes exactly this many rows (padded), so a row's
# numbers come from the same compiled program whatever its batch-mates (docs/rollout.md)
BATCH_INVARIANT_ROWS = 4


def prefill_bucket(n: int) -> int:
    """The smallest of `PREFILL_BUCKETS` that holds `n` tokens (e.g. a `max_prefill_length`)."""
    for b in PREFILL_BUCKETS:
        if b >= n:
            return b
    raise ValueError(f"{n} tokens exceed the largest prefill bucket, {PREFILL_BUCKETS[-1]}")


def _next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def default_compiler_options(platform: str, layout: str, quantization: str) -> tuple[dict, dict]:
    """The engine's XLA options when none are given: (decode programs, prompt-shaped programs).
    On GPU, cuBLAS instead of Triton GEMMs for the per_layer_fused decode (measured faster,
    docs/benchmarks.md §3; int8 keeps Triton, which fuses the int8 -> bf16 weight convert into
    the GEMM: cuBLAS measured slower for int8 on an H200) and for every fp8 program (Triton's fp8 GEMM autotuning did not finish
    compiling the prefill in 280 s on an H200; cuBLASLt's fp8 matmul compiles in about 20 s)."""
    if platform != "gpu":
        return {}, {}
    cublas = {"xla_gpu_enable_triton_gemm": False}
    decode = cublas if (layout == "per_layer_fused" and quantization != "int8") or quantization == "fp8" else {}
    return dict(decode), (dict(cublas) if quantization == "fp8" else {})


def _as_model(model_or_pair) -> tuple[ModelConfig, Any]:
    """(config, pure param dict) from a CausalLM or a (graphdef, state, ...) tuple."""
    if isinstance(model_or_pair, nnx.Module):
        model = model_or_pair
    elif isinstance(model_or_pair, (tuple, list)) and len(model_or_pair) >= 2:
        model = nnx.merge(*model_or_pair)
    else:
        raise TypeError("Engine.from_model takes a CausalLM or a (graphdef, params, ...) tuple, got "
                        f"{type(model_or_pair).__name__}")
    if not isinstance(model, CausalLM):
        raise TypeError(f"the rollout engine needs a CausalLM (a language-model head), got "
                        f"{type(model).__name__}")
    return model.config, nnx.to_pure_dict(nnx.state(model, nnx.Param))


# nnx.State tree -> the tree of its pure dict (the same leaves in the same order), so converting
# the trainer's State on every sync is one flatten + unflatten instead of `nnx.to_pure_dict`'s walk
# (~0.2 ms of the 1.5B sync's host time on the H200 host, docs/benchmarks.md §2)
_PURE_TREES: dict = {}


def _pure(params) -> Any:
    if isinstance(params, nnx.Module):
        params = nnx.state(params, nnx.Param)
    if not isinstance(params, nnx.State):
        return params
    leaves, tree = jax.tree.flatten(params)
    pure_tree = _PURE_TREES.get(tree)
    if pure_tree is not None:
        return jax.tree.unflatten(pure_tree, leaves)
    pure = nnx.to_pure_dict(params)
    pure_leaves, pure_tree = jax.tree.flatten(pure)
    if len(pure_leaves) == len(leaves) and all(a is b for a, b in zip(pure_leaves, leaves)):
        if len(_PURE_TREES) >= 64:  # a bound, for processes that build many models
            _PURE_TREES.clear()
        _PURE_TREES[tree] = pure_tree
    return pure


def _default_mesh(pure_params) -> jax.sharding.Mesh:
    """The params' own mesh if they carry one with our axes, else a 1-device mesh on their device."""
    leaf = jax.tree.leaves(pure_params)[0]
    s = getattr(leaf, "sharding", None)
    if isinstance(s, NamedSharding) and tuple(s.mesh.axis_names) == sharding.MESH_AXES:
        return s.mesh
    device = next(iter(s.device_set)) if s is not None else jax.devices()[0]
    return sharding.make_mesh((1, 1, 1), devices=[device])


def _log_softmax_at(logits, tokens, temperature):
    """log_softmax(logits / T)[token] as the trainer's log-prob pass computes it (the chosen
    scaled logit minus `logsumexp`; T = 1 for greedy rows): `sample`'s own log-prob comes from
    its chunked sums and differs from it in the last bits. logits f32[b, v] -> f32[b]."""
    scaled = logits.astype(jnp.float32) / jnp.where(temperature <= 0.0, 1.0, temperature)[:, None]
    picked = jnp.take_along_axis(scaled, tokens[:, None], axis=-1)[:, 0]
    return picked - jax.nn.logsumexp(scaled, axis=-1)


def _is_abstract(pure) -> bool:
    leaves = jax.tree.leaves(pure)
    return bool(leaves) and all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)


class Engine:
    """Generation engine (JetStream `Engine` API) over a `CausalLM`. Build with `from_model` or
    `from_pretrained`; see the module docstring for the conventions.

    layer_layout: "auto" (default) | "stacked" | "per_layer" — how the engine holds the layers'
    weights and KV cache. per_layer: L separate arrays per layer parameter and per cache (K, V),
    the decode layers unrolled, every read in place (the fast decode). stacked: the trainer's
    `[L, ...]` arrays under a `lax.scan`; the only layout that can share a colocated trainer's
    buffers (zero-copy `update_params`). auto: stacked when every given param already has the
    engine's dtype and stacked sharding (so sharing happens), else per_layer_fused on GPU and
    per_layer elsewhere (the fused layout is measured faster on GPU only) — a sync that must
    copy anyway (e.g. fp32 trainer -> bf16 rollout, or fsdp -> tensor) splits the layers during
    that one copy, at no extra cost. Params given as `jax.ShapeDtypeStruct`s (with shardings)
    make an abstract engine for ahead-of-time compiles (`lower`): nothing is allocated, and
    "auto" decides as it would for arrays of those dtypes and shardings.
    per_layer_fused: per_layer with each layer's q/k/v projections as one `qkv_proj` matmul and
    gate/up as one `gate_up_proj` (fewer, larger decode matmuls; the fusion happens in the sync's
    copy); what auto picks on GPU when the sync copies.
    decode_compiler_options: XLA options for the decode programs only (`generate`, the decode
    loop). None: {"xla_gpu_enable_triton_gemm": False} (cuBLAS for the skinny decode matmuls)
    on GPU for per_layer_fused (measured faster, docs/benchmarks.md §3) and for fp8, else none
    (`default_compiler_options`); {} turns that off.
    prefill_compiler_options: XLA options for the programs that run prompt-shaped matmuls
    (`prefill`, `extend`, `append_rows`). None: {"xla_gpu_enable_triton_gemm": False} for fp8 on
    GPU, else none (`default_compiler_options` says why); {} turns that off.
    kv_cache_dtype: "auto" (default: the engine's dtype) | "fp8" — the decode state's keys and
    values stored as e4m3 (unscaled, saturated at +-448: `models.to_cache`), half of bf16's
    bytes; attention reads them back in `dtype` (the Triton decode kernel converts in registers;
    the other paths upcast the layer's cache first). Prefill's own cache stays in `dtype` until
    it is inserted. Not on TPU's Pallas decode kernel (the XLA path runs there).
    `engine.kv_cache_dtype` is the resolved dtype (e.g. bfloat16 or float8_e4m3fn).
    record_experts (MoE models, router replay): prefill and the decode steps also record the
    experts every layer chose for each token they feed: `Prefix.experts` and the decode loop's
    `out["experts"]` (`expert_ids` describes both; `rollout.RolloutDriver` collects them).
    batch_invariant: a request's per-token results (logits, log-probs, sampled tokens) do not
    depend on which requests share its prefill or decode calls or on its slot: `prefill_batch`
    and `append_rows` run in calls of exactly BATCH_INVARIANT_ROWS rows (padded), decode already
    runs every slot at one shape, and the reported log-prob is the trainer's formula
    (log_softmax(logits / T)[token] via logsumexp) on the step's logits. Costs more, smaller
    prefill calls (docs/rollout.md "Batch-invariant decoding"); off by default.
    `engine.layer_layout` is the resolved layout;
    `engine.params` is in it (per_layer: `params["model"]["layers"] == {i: layer i}`), and
    `update_params` takes either layout.
    quantization: "none" (default) | "fp8" | "int8" — the dense projections' weights in the
    engine (`jaxrl_llm.models._quant`: per-output-channel scales, quantized inside the sync
    program; embedding, LM head, norms and MoE experts stay in `dtype`); "auto" then never
    picks stacked (a quantized sync always copies). `engine.params` then holds the quantized
    tree ({"kernel", "scale"} per projection); `update_params` takes the trainer's params in any
    layout or that tree.
    """

    def __init__(self, config: ModelConfig, params: Any, *, mesh=None, rules="rollout",
                 max_concurrent_decodes: int, max_prefill_length: int, max_target_length: int,
                 dtype=None, temperature: float = 1.0, top_k: int = -1, top_p: float = 1.0,
                 seed: int = 0, stop_token_ids=(), pad_token_id: int = 0, tokenizer=None,
                 layer_layout: str = "auto", decode_compiler_options: dict | None = None,
                 record_experts: bool = False, batch_invariant: bool = False,
                 quantization: str = "none", prefill_compiler_options: dict | None = None,
                 kv_cache_dtype: str = "auto"):
        self._check_sizes(max_concurrent_decodes, max_prefill_length, max_target_length)
        if record_experts and not config.is_moe:
            raise ValueError(f"record_experts=True (router replay) needs a mixture-of-experts model; "
                             f"model_type {config.model_type!r} has no router")
        self.record_experts = bool(record_experts)
        if config.is_moe:  # a warning on GPU where XLA computes every expert for every token
            models.warn_if_experts_expanded(config.num_experts, config.hidden_size, config.moe_intermediate_size,
                                            config.num_experts_per_tok)
        if dtype is not None:
            dtype = to_dtype(dtype)
            config = config.replace(dtype=dtype, param_dtype=dtype)
        check_quantization(quantization)
        # the trainer's trees (what a sync takes); under quantization the engine's own differ
        source_config = config if config.quantization == "none" else config.replace(quantization="none")
        config = source_config if quantization == "none" else source_config.replace(quantization=quantization)
        self.config = config
        self.quantization = quantization
        self.kv_cache_dtype = models.kv_cache_dtype(kv_cache_dtype, config.dtype)  # validates the name
        self.sampling = SamplingParams(temperature, top_k, top_p)
        self.stop_token_ids = tuple(int(t) for t in stop_token_ids)
        self.pad_token_id = int(pad_token_id)
        self.tokenizer = tokenizer
        self.seed = int(seed)
        self.batch_invariant = bool(batch_invariant)
        self._slots = int(max_concurrent_decodes)
        self._max_prefill = int(max_prefill_length)
        self._max_target = int(max_target_length)
        self._buckets = tuple(b for b in PREFILL_BUCKETS if b <= self._max_prefill)
        self._rules = sharding.get_rules(rules) if isinstance(rules, str) else rules
        pure = _pure(params)
        self._mesh = mesh if mesh is not None else _default_mesh(pure)
        self._graphdefs, self._layout_shardings = {}, {}
        for layout in LAYER_LAYOUTS:
            graphdef, abstract = nnx.split(abstract_model(source_config, layer_layout=layout), nnx.Param)
            self._graphdefs[layout] = graphdef
            self._layout_shardings[layout] = nnx.to_pure_dict(
                sharding.state_shardings(abstract, self._mesh, self._rules))
        self._layout = resolve_layout(layer_layout, pure, self._layout_shardings, config.param_dtype,
                                      self._mesh.devices.flat[0].platform, quantized=quantization != "none")
        self._graphdef = self._graphdefs[self._layout]
        self._param_shardings = self._layout_shardings[self._layout]
        if quantization != "none":  # the engine's own tree: quantized projections
            graphdef, abstract = nnx.split(abstract_model(config, layer_layout=self._layout), nnx.Param)
            self._graphdef = graphdef
            self._param_shardings = nnx.to_pure_dict(sharding.state_shardings(abstract, self._mesh, self._rules))
        decode_default, prefill_default = default_compiler_options(
            self._mesh.devices.flat[0].platform, self._layout, quantization)
        self._decode_options = dict(decode_default if decode_compiler_options is None else decode_compiler_options)
        self._prefill_options = dict(prefill_default if prefill_compiler_options is None else prefill_compiler_options)
        self._sync = WeightSync(self._layout, self._layout_shardings, config.param_dtype, self._mesh,
                                quantization, self._param_shardings, source_config.sparse_layers)
        self._state_shardings = self._decode_state_shardings()
        self._replicated = NamedSharding(self._mesh, PartitionSpec())
        self._prefix_shardings = self._prefix_sharding_tree()
        self._stop = jnp.asarray(self.stop_token_ids or (-1,), jnp.int32)
        self._base_key = jax.random.key(self.seed)
        self._request_counter = 0
        self._params = None
        self._params_fresh = False  # made by our own relayout sync (WeightSync may write into them)
        self._params_shared = False  # the last sync copied nothing (the trainer's own buffers)
        self._build_compiled()
        if _is_abstract(pure):  # ahead-of-time compiles: shapes and shardings only, no weights
            self._params = self._abstract_params()
        else:
            self.update_params(pure)

    # ---------------------------------------------------------------- construction
    @staticmethod
    def _check_sizes(slots, max_prefill, max_target):
        if int(slots) < 1:
            raise ValueError(f"max_concurrent_decodes must be >= 1, got {slots}")
        if int(max_prefill) not in PREFILL_BUCKETS:
            raise ValueError(f"max_prefill_length={max_prefill} must be one of JetStream's padding "
                             f"buckets {PREFILL_BUCKETS}")
        if int(max_target) <= int(max_prefill):
            raise ValueError(f"max_target_length={max_target} (prompt + generated tokens, the KV "
                             f"cache length) must exceed max_prefill_length={max_prefill}")

    @classmethod
    def from_model(cls, model_or_graphdef_and_params, *, mesh=None, rules="rollout",
                   max_concurrent_decodes: int, max_prefill_length: int, max_target_length: int,
                   dtype=None, temperature: float = 1.0, top_k: int = -1, top_p: float = 1.0,
                   seed: int = 0, stop_token_ids=(), pad_token_id: int = 0, tokenizer=None,
                   layer_layout: str = "auto", decode_compiler_options: dict | None = None,
                   record_experts: bool = False, batch_invariant: bool = False,
                   quantization: str = "none", prefill_compiler_options: dict | None = None,
                   kv_cache_dtype: str = "auto") -> "Engine":
        """An engine over an in-memory CausalLM (or `(graphdef, params, ...)` from `nnx.split`).

        mesh None: the params' own mesh when they are `NamedSharding`-placed on a
        (data, fsdp, tensor) mesh (colocated trainer), else a 1-device mesh on their device.
        rules: "rollout" (default), "train" (shares the trainer's buffers when dtype matches) or a
        rules table. dtype None keeps the model's dtypes; otherwise params, compute and KV cache
        use it. layer_layout: see the class docstring ("auto" shares the model's buffers when it
        can, else splits the layers for the fast decode).
        """
        config, pure = _as_model(model_or_graphdef_and_params)
        return cls(config, pure, mesh=mesh, rules=rules,
                   max_concurrent_decodes=max_concurrent_decodes,
                   max_prefill_length=max_prefill_length, max_target_length=max_target_length,
                   dtype=dtype, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                   stop_token_ids=stop_token_ids, pad_token_id=pad_token_id, tokenizer=tokenizer,
                   layer_layout=layer_layout, decode_compiler_options=decode_compiler_options,
                   record_experts=record_experts, batch_invariant=batch_invariant,
                   quantization=quantization, prefill_compiler_options=prefill_compiler_options,
                   kv_cache_dtype=kv_cache_dtype)

    @classmethod
    def from_pretrained(cls, path: str, *, max_concurrent_decodes: int, max_prefill_length: int,
                        max_target_length: int, dtype=jnp.bfloat16, temperature: float = 1.0,
                        top_k: int = -1, top_p: float = 1.0, seed: int = 0, mesh=None,
                        rules="rollout", layer_layout: str = "per_layer",
                        batch_invariant: bool = False, quantization: str = "none",
                        kv_cache_dtype: str = "auto") -> "Engine":
        """An engine over a Hugging Face folder (config.json + safetensors [+ tokenizer]).

        Stop tokens and pad id come from the folder's tokenizer (eos ids) when it has one, else
        from config.json. layer_layout defaults to "per_layer" (the fast decode): nothing else
        holds the loaded weights, so keeping them stacked for sharing buys nothing (the split
        briefly holds both copies; pass "stacked" when that peak does not fit).
        """
        import os

        from jaxrl_llm.models import from_pretrained, load_tokenizer

        model = from_pretrained(path, dtype, param_dtype=dtype)
        tokenizer = None
        if os.path.exists(os.path.join(path, "tokenizer.json")) or os.path.exists(
                os.path.join(path, "jaxrl_char_tokenizer.json")):
            tokenizer = load_tokenizer(path)
        eos = model.config.eos_token_id
        stop = getattr(tokenizer, "eos_token_ids", None) or (
            () if eos is None else (eos,) if isinstance(eos, int) else tuple(eos))
        pad = getattr(tokenizer, "pad_token_id", None)
        pad = pad if pad is not None else (model.config.pad_token_id or (stop[0] if stop else 0))
        return cls.from_model(model, mesh=mesh, rules=rules,
                              max_concurrent_decodes=max_concurrent_decodes,
                              max_prefill_length=max_prefill_length,
                              max_target_length=max_target_length, dtype=dtype,
                              temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                              stop_token_ids=stop, pad_token_id=pad, tokenizer=tokenizer,
                              layer_layout=layer_layout, batch_invariant=batch_invariant,
                              quantization=quantization, kv_cache_dtype=kv_cache_dtype)

    @property
    def _per_layer(self) -> bool:
        return self._layout != "stacked"  # per_layer or per_layer_fused: a cache per layer

    def _cache_tree(self, make_one, axes) -> KVCache:
        """A KVCache of `make_one(axes)` in the engine's layout (one per layer, or one stacked)."""
        if self._per_layer:
            n = self.config.num_hidden_layers
            return KVCache(tuple(make_one(axes[1:]) for _ in range(n)),
                           tuple(make_one(axes[1:]) for _ in range(n)))
        return KVCache(make_one(axes), make_one(axes))

    def _decode_state_shardings(self) -> DecodeState:
        c = self.config
        shape = (c.num_hidden_layers, self._slots, self._max_target, c.num_key_value_heads, c.head_dim)
        # checks divisibility once, on the stacked shape (the per-layer shape is its tail)
        sharding.logical_sharding(self._mesh, KVCache.LOGICAL_AXES, self._rules, shape,
                                  name="KV cache (max_concurrent_decodes is its batch)")
        cache = self._cache_tree(lambda axes: sharding.logical_sharding(self._mesh, axes, self._rules),
                                 KVCache.LOGICAL_AXES)
        rep = NamedSharding(self._mesh, PartitionSpec())
        return DecodeState(cache, *([rep] * 10))

    def _prefix_sharding_tree(self) -> Prefix:
        cache = self._cache_tree(lambda axes: sharding.logical_sharding(self._mesh, axes, self._rules),
                                 _PREFIX_AXES)
        return Prefix(cache, self._replicated, self._replicated,
                      self._replicated if self.record_experts else None)

    @property
    def expert_ids(self) -> tuple[tuple[int, int], Any]:
        """((layers, k), dtype) of the recorded expert ids (`record_experts`): `Prefix.experts` is
        [p, bucket, layers, k] (the cached prompt tokens; -1 past them), the decode loop's
        `out["experts"]` [rows, steps, layers, k] (step g: the token that step fed, i.e. the prompt's
        last token at g = 0, else response token g - 1). `layers` counts the sparse layers only
        (`config.sparse_layers`: all of them unless some layers are dense)."""
        c = self.config
        return (len(c.sparse_layers), c.num_experts_per_tok), models.expert_index_dtype(c.num_experts)

    # ---------------------------------------------------------------- compiled pieces
    def _build_compiled(self):
        st = self._state_shardings
        pre = {"compiler_options": self._prefill_options} if self._prefill_options else {}
        self._prefill_jit = jax.jit(self._prefill_core, out_shardings=self._prefix_shardings, **pre)
        self._insert_jit = jax.jit(self._insert_core, donate_argnums=(0,), out_shardings=st)
        opts = {"compiler_options": self._decode_options} if self._decode_options else {}
        self._generate_jit = jax.jit(self._generate_core, donate_argnums=(1,),
                                     out_shardings=(st, self._replicated, self._replicated), **opts)
        self._loop_jit = jax.jit(self._loop_core, donate_argnums=(1, 2),
                                 out_shardings=(st, None, self._replicated), **opts)
        self._extend_jit = jax.jit(self._extend_core, static_argnums=(4,), out_shardings=self._prefix_shardings,
                                   **pre)
        self._append_jit = jax.jit(self._append_core, donate_argnums=(1,),
                                   out_shardings=(st, self._replicated if self.record_experts else None), **pre)
        self._init_jit = jax.jit(self._init_core, out_shardings=st)
        self._join_jit = jax.jit(self._join_core, static_argnums=(1,), out_shardings=self._prefix_shardings)
        self._free_jit = jax.jit(self._free_core, donate_argnums=(0,), out_shardings=st)
        self._set_generated_jit = jax.jit(self._set_generated_core, donate_argnums=(0,), out_shardings=st)

    def _run(self, fn, *args):
        """Calls a jitted piece with the rollout rules active (activation constraints)."""
        with sharding.use_rules(self._mesh, self._rules):
            return fn(*args)

    def _model(self, params) -> CausalLM:
        return nnx.merge(self._graphdef, params)

    def _prefill_core(self, params, tokens, true_lengths):
        """tokens int32[p, bucket] right-padded; true_lengths int32[p] >= 1."""
        cached = true_lengths - 1
        mask = (jnp.arange(tokens.shape[1])[None, :] < cached[:, None]).astype(jnp.int32)
        out = self._model(params).prefill(tokens, attention_mask=mask, record_experts=self.record_experts)
        cache, experts = out[1], None
        if self.record_experts:  # [L, p, bucket, k] -> [p, bucket, L, k]; -1 past the cached tokens
            experts = jnp.where(mask[:, :, None, None] > 0, jnp.moveaxis(out[2], 0, 2), -1)
            experts = experts.astype(self.expert_ids[1])
        last = jnp.take_along_axis(tokens, cached[:, None], axis=1)[:, 0]
        return Prefix(cache, cached.astype(jnp.int32), last.astype(jnp.int32), experts)

    def _init_core(self):
        c, n = self.config, self._slots
        shape = (c.num_hidden_layers, n, self._max_target, c.num_key_value_heads, c.head_dim)
        zi = jnp.zeros((n,), jnp.int32)
        return DecodeState(
            cache=self._cache_tree(lambda axes: jnp.zeros(shape[-len(axes):], self.kv_cache_dtype),
                                   KVCache.LOGICAL_AXES),
            tokens=zi, lengths=zi, generated=zi, max_new=zi, active=jnp.zeros((n,), jnp.bool_),
            row=zi, keys=jax.random.split(jax.random.key(0), n),
            temperature=jnp.ones((n,), jnp.float32), top_k=zi - 1, top_p=jnp.ones((n,), jnp.float32))

    def _insert_core(self, state: DecodeState, prefix: Prefix, src, dst, rows, max_new,
                     temperature, top_k, top_p, key):
        """Copies prefix rows `src` into slots `dst` (int32[m]; dst >= slots is ignored)."""
        def put_cache(buf, val):  # one layer's [slots, s, kvh, d] <- prefix [p, bucket, kvh, d]
            return buf.at[dst, :val.shape[1]].set(models.to_cache(val[src], buf.dtype), mode="drop")

        def put_stacked(buf, val):  # [L, slots, s, kvh, d] <- [L, p, bucket, kvh, d]
            return buf.at[:, dst, :val.shape[2]].set(models.to_cache(val[:, src], buf.dtype), mode="drop")

        if self._per_layer:
            cache = KVCache(tuple(map(put_cache, state.cache.k, prefix.cache.k)),
                            tuple(map(put_cache, state.cache.v, prefix.cache.v)))
        else:
            cache = KVCache(put_stacked(state.cache.k, prefix.cache.k),
                            put_stacked(state.cache.v, prefix.cache.v))
        return self._arm(state, cache, dst, prefix.tokens[src], prefix.lengths[src], rows, max_new,
                         temperature, top_k, top_p, key)

    def _arm(self, state, cache, dst, tokens, lengths, rows, max_new, temperature, top_k, top_p,
             key) -> DecodeState:
        """Starts a request in slots `dst` (int32[m], >= slots ignored): `tokens` pending,
        `lengths` tokens cached, nothing generated. `key`: one typed key (slot i's stream is
        fold_in(key, rows[i])) or raw key data uint32[m, k] (each row's own key). Sampling
        parameters are scalars or [m]."""
        def put(buf, val):
            return buf.at[dst].set(val, mode="drop")

        m = dst.shape[0]
        if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
            keys = jax.vmap(jax.random.fold_in, in_axes=(None, 0))(key, rows)
        else:
            keys = jax.random.wrap_key_data(key)
        return DecodeState(
            cache=cache,
            tokens=put(state.tokens, tokens),
            lengths=put(state.lengths, lengths),
            generated=put(state.generated, jnp.zeros((m,), jnp.int32)),
            max_new=put(state.max_new, max_new),
            active=put(state.active, jnp.ones((m,), jnp.bool_)),
            row=put(state.row, rows),
            keys=put(state.keys, keys),
            temperature=put(state.temperature, jnp.broadcast_to(temperature, (m,)).astype(jnp.float32)),
            top_k=put(state.top_k, jnp.broadcast_to(top_k, (m,)).astype(jnp.int32)),
            top_p=put(state.top_p, jnp.broadcast_to(top_p, (m,)).astype(jnp.float32)))

    def _extend_cache(self, params, cache: KVCache, tokens, start, record: bool = False):
        """Chunked prefill: appends tokens int32[m, t] to cache rows [m, s] at positions
        start[i], start[i] + 1, ... (int32[m]); writes past s are dropped. Every token is written,
        so entries past a row's real tokens hold padding (never read: a query at position q only
        sees cache slots <= q, and decoding overwrites slot q before reading it). `record`:
        returns (cache, the experts of every fed token [m, t, L, k]), else the cache."""
        positions = start[:, None] + jnp.arange(tokens.shape[1], dtype=jnp.int32)[None, :]
        out = self._model(params).decode(tokens, positions=positions, cache=cache,
                                         cache_index=start, record_experts=record)
        if record:  # [L, m, t, k] -> [m, t, L, k]
            return out[1], jnp.moveaxis(out[2], 0, 2).astype(self.expert_ids[1])
        return out[1]

    def _extend_core(self, params, prefix: Prefix, tokens, true_lengths, length: int) -> Prefix:
        """`prefix` (p rows) followed by tokens int32[p, bucket] (true_lengths int32[p] >= 1, the
        first one being each row's pending token) -> a Prefix with a `length`-token cache; with
        `record_experts`, its experts are the prefix's followed by those of the newly cached tokens
        (-1 past them)."""
        def resize(x, axis, fill=0):  # the cache_length axis to `length` (`fill` after the old entries)
            x = jax.lax.slice_in_dim(x, 0, min(x.shape[axis], length), axis=axis)
            pad = [(0, 0)] * x.ndim
            pad[axis] = (0, length - x.shape[axis])
            return jnp.pad(x, pad, constant_values=fill)

        axis = 1 if self._per_layer else 2
        cache = jax.tree.map(lambda x: resize(x, axis), prefix.cache)
        experts = None
        if self.record_experts:
            cache, fed = self._extend_cache(params, cache, tokens, prefix.lengths, record=True)
            p, t = tokens.shape
            old = (jnp.full((p, length) + fed.shape[2:], -1, fed.dtype) if prefix.experts is None
                   else resize(prefix.experts.astype(fed.dtype), 1, fill=-1))
            j = jnp.arange(t, dtype=jnp.int32)[None, :]
            at = jnp.where(j < (true_lengths - 1)[:, None], prefix.lengths[:, None] + j, length)  # else dropped
            experts = old.at[jnp.arange(p)[:, None], at].set(fed, mode="drop")
        else:
            cache = self._extend_cache(params, cache, tokens, prefix.lengths)
        last = jnp.take_along_axis(tokens, (true_lengths - 1)[:, None], axis=1)[:, 0]
        return Prefix(cache, (prefix.lengths + true_lengths - 1).astype(jnp.int32),
                      last.astype(jnp.int32), experts)

    def _append_core(self, params, state: DecodeState, tokens, true_lengths, dst, rows, max_new,
                     temperature, top_k, top_p, key) -> DecodeState:
        """Appends tokens int32[m, bucket] to slots `dst` (int32[m]; >= slots ignored) at each
        slot's current length and re-arms them; the other slots are untouched."""
        idx = jnp.clip(dst, 0, self._slots - 1)
        start = state.lengths[idx]
        if self._per_layer:
            sub = jax.tree.map(lambda x: jnp.take(x, idx, axis=0), state.cache)
        else:
            sub = jax.tree.map(lambda x: jnp.take(x, idx, axis=1), state.cache)
        experts = None
        if self.record_experts:  # the cached tokens' (all but each row's last); -1 past them
            sub, experts = self._extend_cache(params, sub, tokens, start, record=True)
            cached = jnp.arange(tokens.shape[1])[None, :] < (true_lengths - 1)[:, None]
            experts = jnp.where(cached[:, :, None, None], experts, -1).astype(experts.dtype)
        else:
            sub = self._extend_cache(params, sub, tokens, start)
        if self._per_layer:
            cache = jax.tree.map(lambda buf, val: buf.at[dst].set(val, mode="drop"), state.cache, sub)
        else:
            cache = jax.tree.map(lambda buf, val: buf.at[:, dst].set(val, mode="drop"), state.cache, sub)
        last = jnp.take_along_axis(tokens, (true_lengths - 1)[:, None], axis=1)[:, 0]
        return self._arm(state, cache, dst, last, start + true_lengths - 1, rows, max_new,
                         temperature, top_k, top_p, key), experts

    def _step(self, params, state: DecodeState, forced=None):
        """One decode step for all slots. Returns (state, tokens, log_probs, valid, generated,
        experts): the experts each layer chose for the fed tokens [slots, L, k] with
        `record_experts`, else None. `forced` (int32[slots], batch_invariant engines): a slot's
        token where >= 0 instead of the sampled one (teacher forcing, `RolloutDriver.teacher_force`);
        its log-prob is then that token's."""
        model = self._model(params)
        out = model.decode(state.tokens[:, None], positions=state.lengths[:, None], cache=state.cache,
                           cache_index=state.lengths, record_experts=self.record_experts)
        hidden, cache = out[:2]
        experts = jnp.moveaxis(out[2][:, :, 0], 0, 1) if self.record_experts else None
        logits = model.logits(hidden[:, 0])
        keys = jax.vmap(jax.random.fold_in)(state.keys, state.generated)
        tok, logp = sample(logits, keys, state.temperature, state.top_k, state.top_p)
        if forced is not None:
            tok = jnp.where(forced >= 0, forced, tok)
        if self.batch_invariant:  # the trainer's formula (`algos.token_log_probs_*`), bit for bit
            logp = _log_softmax_at(logits, tok, state.temperature)
        act = state.active
        generated = state.generated + act.astype(jnp.int32)
        lengths = state.lengths + act.astype(jnp.int32)
        stop = jnp.any(tok[:, None] == self._stop[None, :], axis=-1)
        done = act & (stop | (generated >= state.max_new) | (lengths >= self._max_target))
        new = dataclasses.replace(state, cache=cache, tokens=jnp.where(act, tok, state.tokens),
                                  lengths=lengths, generated=generated, active=act & ~done)
        return new, tok, logp, act, generated, experts

    def _generate_core(self, params, state):
        state, tok, logp, valid, generated, _ = self._step(params, state)
        data = jnp.stack([tok, valid.astype(jnp.int32), generated], axis=-1)
        return state, data, logp[:, None]

    def _loop_core(self, params, state, out, num_steps, min_free):
        """Up to `num_steps` decode steps on device; stops early when no slot is active or at least
        `min_free` slots are free. Writes each valid token into `out` at (row, step of the row),
        and with `record_experts` the experts of the token each step fed into `out["experts"]`.
        `out["forced"]` (int32 like `out["tokens"]`, batch_invariant engines): the token each row
        takes at each step where >= 0, instead of sampling (teacher forcing)."""
        rows_cap, steps_cap = out["tokens"].shape

        def cond(c):
            i, st, _ = c
            n_free = jnp.sum(~st.active)
            return (i < num_steps) & jnp.any(st.active) & (n_free < min_free)

        def body(c):
            i, st, o = c
            forced = None
            if "forced" in o:
                forced = o["forced"][jnp.clip(st.row, 0, rows_cap - 1), jnp.clip(st.generated, 0, steps_cap - 1)]
            new, tok, logp, valid, generated, experts = self._step(params, st, forced)
            r = jnp.where(valid, st.row, rows_cap)
            o = {**o, "tokens": o["tokens"].at[r, st.generated].set(tok, mode="drop"),
                 "log_probs": o["log_probs"].at[r, st.generated].set(logp, mode="drop"),
                 "lengths": o["lengths"].at[r].set(generated, mode="drop")}
            if "experts" in o:
                o["experts"] = o["experts"].at[r, st.generated].set(experts.astype(o["experts"].dtype),
                                                                     mode="drop")
            return i + 1, new, o

        steps, state, out = jax.lax.while_loop(cond, body, (jnp.int32(0), state, out))
        return state, out, steps

    def _set_generated_core(self, state, dst, generated):
        return dataclasses.replace(state, generated=state.generated.at[dst].set(generated, mode="drop"))

    def _free_core(self, state, slot):
        return dataclasses.replace(state, active=state.active.at[slot].set(False))

    # ---------------------------------------------------------------- ahead-of-time compiles
    def _abstract_params(self):
        graphdef, abstract = nnx.split(abstract_model(self.config, layer_layout=self._layout), nnx.Param)
        return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                            nnx.to_pure_dict(abstract), self._param_shardings)

    def lower(self, *, prefill_rows: int, insert_rows: int, out_rows: int, out_tokens: int,
              sync_from=None, programs=None) -> dict:
        """The engine's programs lowered for its mesh over abstract inputs (nothing allocated):
        "prefill" (`prefill_rows` prompts at max_prefill_length), "insert" (`insert_rows` of them
        into the slots), "generate" (one decode step of every slot) and "decode_loop" (the RL
        driver's multi-step loop writing into [out_rows, out_tokens] buffers; a `batch_invariant`
        engine's prefill is always BATCH_INVARIANT_ROWS prompts). The weights are the
        engine's `params` (abstract on an abstract engine). `sync_from`: abstract trainer params
        (a pure dict with shardings on the same devices) adds "weight_sync", the one program
        `update_params` runs for them (cast + reshard, or cast + relayout), or None when
        `update_params` would share them (zero copy, see `shares_weights`). `programs`: the names to
        lower (None: all; tracing each costs seconds). Returns {name: jax.stages.Lowered | None}."""
        wanted = set(PROGRAM_NAMES if programs is None else programs)
        if self.batch_invariant:  # the only prefill shape this engine runs (`_prefill_fixed_rows`)
            prefill_rows = BATCH_INVARIANT_ROWS
        unknown = wanted - set(PROGRAM_NAMES)
        if unknown:
            raise ValueError(f"Engine.lower: unknown programs {sorted(unknown)}; choose from {PROGRAM_NAMES}")

        def sds(shape, dtype, shardings=None):
            return jax.ShapeDtypeStruct(shape, dtype, sharding=shardings or self._replicated)

        params = jax.tree.map(lambda x, s: sds(x.shape, x.dtype, s), self._params, self._param_shardings)
        with sharding.use_rules(self._mesh, self._rules):
            state = jax.tree.map(lambda x, s: sds(x.shape, x.dtype, s), jax.eval_shape(self._init_core),
                                 self._state_shardings)

            def prefix():  # what prefill hands to insert
                return jax.tree.map(lambda x, s: sds(x.shape, x.dtype, s), jax.eval_shape(
                    self._prefill_core, params, sds((prefill_rows, self._max_prefill), jnp.int32),
                    sds((prefill_rows,), jnp.int32)), self._prefix_shardings)

            i32 = functools.partial(sds, dtype=jnp.int32)
            m = insert_rows
            out = {"tokens": i32((out_rows, out_tokens)), "lengths": i32((out_rows,)),
                   "log_probs": sds((out_rows, out_tokens), jnp.float32)}
            if self.record_experts:
                (layers, k), dtype = self.expert_ids
                out["experts"] = sds((out_rows, out_tokens, layers, k), dtype)
            if self.batch_invariant:  # the RL driver's buffers carry the teacher-forced tokens
                out["forced"] = i32((out_rows, out_tokens))
            lower = {
                "prefill": lambda: self._prefill_jit.lower(params, i32((prefill_rows, self._max_prefill)),
                                                           i32((prefill_rows,))),
                "insert": lambda: self._insert_jit.lower(
                    state, prefix(), i32((m,)), i32((m,)), i32((m,)), i32((m,)), sds((), jnp.float32),
                    i32(()), sds((), jnp.float32), jax.ShapeDtypeStruct((), jax.random.key(0).dtype,
                                                                        sharding=self._replicated)),
                "generate": lambda: self._generate_jit.lower(params, state),
                "decode_loop": lambda: self._loop_jit.lower(params, state, out, i32(()), i32(())),
                "weight_sync": lambda: self._lower_sync(sync_from),
            }
            if sync_from is None:
                wanted.discard("weight_sync")
            return {name: fn() for name, fn in lower.items() if name in wanted}

    def shares_weights(self, source) -> bool:
        """Whether `update_params(source)` would keep `source`'s buffers (zero copy, nothing runs)
        for trainer params like `source` (a State, pure dict or CausalLM of arrays or of
        ShapeDtypeStructs with shardings)."""
        return self._sync.shares(_pure(source))

    def _lower_sync(self, source):
        return self._sync.lower(_pure(source))

    # ---------------------------------------------------------------- weights
    @property
    def params(self):
        """The engine's weights: a plain dict of arrays (`nnx.State.to_pure_dict()` layout) in the
        engine's `layer_layout` (per_layer: `params["model"]["layers"][i]` is layer i's dict)."""
        return self._params

    @property
    def layer_layout(self) -> str:
        """"stacked", "per_layer" or "per_layer_fused": how the engine holds its weights and KV cache."""
        return self._layout

    def update_params(self, params) -> dict:
        """Takes new weights (the trainer's Param `nnx.State`, a pure dict or a CausalLM), in the
        stacked layout or the per-layer one (e.g. `engine.params` itself).

        Same layout as the engine's: leaves already on the rollout sharding with the engine's
        dtype are used as they are (0 bytes copied, same device buffers); others go through one
        `sharding.reshard` with the cast fused. Other layout: one jitted program casts, relayouts
        and splits (or stacks) the layers, writing every engine byte once (params on other devices
        are first moved there in their own layout). The KV cache is not touched. Returns
        {"bytes_moved" (bytes written into new engine buffers), "bytes_total" (the engine's
        weight bytes), "zero_copy", "num_copied" (new engine arrays), "donated" (a relayout wrote
        into the engine's previous weights: this engine's own sync made them and nothing outside
        it held any part of them, e.g. no `p = engine.params` kept; their arrays are deleted),
        "time_s"}.
        """
        t0 = time.perf_counter()
        pure = _pure(params)
        layout = self._sync.layout(pure)  # a tree that fits neither layout fails here, our weights intact
        # drop our old copies before making new ones (peak memory), or have a relayout write into
        # them when our own sync made them and nothing else holds them (no buffer freed or made)
        owned = {"params": self._params}  # our only reference: the sync can tell who else holds them
        self._params = None
        donate = owned if self._params_fresh and self._sync.may_donate(owned, layout) else None
        del owned  # unless donated, freed here, before the new weights are made
        new, stats = self._sync(pure, donate=donate)
        del donate
        jax.block_until_ready(new)
        self._params, self._params_fresh = new, stats["fresh"]
        self._params_shared = stats["num_copied"] == 0
        return {"bytes_moved": int(stats["bytes_moved"]), "bytes_total": int(stats["bytes_total"]),
                "zero_copy": stats["num_copied"] == 0, "num_copied": int(stats["num_copied"]),
                "donated": bool(stats["donated"]), "time_s": time.perf_counter() - t0}

    def release_params(self) -> int:
        """Drops the engine's weights when the last `update_params` copied any (relayout, cast or
        reshard: buffers this engine holds alone), so their device memory is freed (a server's
        `sleep`); shared zero-copy weights are the trainer's and stay. Returns the bytes of the
        weights dropped (0 when kept; when a sync copied only some leaves, the shared ones stay
        alive with the trainer but are counted); `update_params` must come before generating again."""
        if self._params is None or self._params_shared or _is_abstract(self._params):
            return 0
        nbytes = sum(x.nbytes for x in jax.tree.leaves(self._params))
        self._params, self._params_fresh = None, False
        return nbytes

    def check_params(self, params=None):
        """Raises a clear error when the weights were freed (e.g. donated by the trainer's step)."""
        params = self._params if params is None else params
        if any(getattr(x, "is_deleted", lambda: False)() for x in jax.tree.leaves(params)):
            raise RuntimeError("the engine's weights were deleted (a shared buffer was donated by "
                               "the trainer's update?); call engine.update_params(new_params) "
                               "before generating")

    # ---------------------------------------------------------------- JetStream API
    def load_params(self, *args, **kwargs):
        return self._params

    def init_decode_state(self, *args, **kwargs) -> DecodeState:
        return self._run(self._init_jit)

    def bucket_for(self, length: int) -> int:
        """The padding bucket of a prompt of `length` tokens (error if over max_prefill_length)."""
        if length < 1:
            raise ValueError("a prompt needs at least one token")
        if length > self._max_prefill:
            raise ValueError(f"prompt of {length} tokens is longer than max_prefill_length="
                             f"{self._max_prefill}; truncate it or build the engine with a larger "
                             f"max_prefill_length")
        return next(b for b in self._buckets if b >= length)

    def call_rows(self, n: int) -> int:
        """Rows of a prefill or append call for n prompts (the server's and the RL driver's): a
        power of two (at least 4: few shapes to compile), or with `batch_invariant`, which computes
        any call as calls of BATCH_INVARIANT_ROWS rows, the multiple of those (no call of padding
        rows only)."""
        if self.batch_invariant:
            return -(-n // BATCH_INVARIANT_ROWS) * BATCH_INVARIANT_ROWS
        return _next_pow2(max(n, 4))

    def prefill_batch(self, params, tokens: np.ndarray, true_lengths: np.ndarray) -> Prefix:
        """Prefills p prompts at once. tokens int32[p, bucket] right-padded, true_lengths int32[p].
        batch_invariant: in calls of exactly BATCH_INVARIANT_ROWS rows, whatever p (see there)."""
        self.check_params(params)
        if self.batch_invariant:
            return self._prefill_fixed_rows(params, np.asarray(tokens, np.int32),
                                            np.asarray(true_lengths, np.int32))
        return self._run(self._prefill_jit, params, jnp.asarray(tokens, jnp.int32),
                         jnp.asarray(true_lengths, jnp.int32))

    def _prefill_fixed_rows(self, params, tokens: np.ndarray, true_lengths: np.ndarray) -> Prefix:
        """`prefill_batch` as calls of the one [BATCH_INVARIANT_ROWS, bucket] program (rows padded
        with one-token prompts), their rows joined into one p-row Prefix: a prompt's cache is
        computed by the same program, at the same shape, alone or among any others."""
        p, r = tokens.shape[0], BATCH_INVARIANT_ROWS
        n = -(-p // r) * r
        padded = np.full((n, tokens.shape[1]), self.pad_token_id, np.int32)
        padded[:p] = tokens
        lengths = np.ones(n, np.int32)
        lengths[:p] = true_lengths
        parts = [self._run(self._prefill_jit, params, jnp.asarray(padded[lo:lo + r]),
                           jnp.asarray(lengths[lo:lo + r])) for lo in range(0, n, r)]
        if n == p == r:  # one call, no padding rows: its prefix as it is
            return parts[0]
        return self._run(self._join_jit, parts, p)

    def _join_core(self, parts: list, p: int) -> Prefix:
        """The first p rows of the prefixes `parts`, concatenated (a copy: no arithmetic)."""
        axis = 0 if self._per_layer else 1

        def join(axis, *xs):
            return jax.lax.slice_in_dim(jnp.concatenate(xs, axis=axis), 0, p, axis=axis)

        cache = jax.tree.map(functools.partial(join, axis), *[q.cache for q in parts])
        experts = None if parts[0].experts is None else join(0, *[q.experts for q in parts])  # record_experts
        return Prefix(cache, join(0, *[q.lengths for q in parts]), join(0, *[q.tokens for q in parts]), experts)

    def prefill(self, *, params, existing_prefix=None, padded_tokens, true_length: int,
                sampler=None, rng=None) -> Prefix:
        """JetStream prefill of one prompt (1-D tokens padded to a bucket).

        existing_prefix: a one-row `Prefix` (its cache holds `lengths` tokens, `tokens` is its
        pending last token). Then `padded_tokens[:true_length]` is the rest of the sequence from
        index `existing_prefix.lengths` on, i.e. starting with that pending token; only those
        tokens are computed (chunked prefill over the cached ones) and the result caches the
        existing tokens plus all new ones but the last, which is pending: inserting it and
        decoding equals a full prefill of the whole sequence. Its cache is padded to a bucket of
        the total length (at most max_target_length).
        """
        if existing_prefix is not None:
            return self._prefill_after(params, existing_prefix, padded_tokens, true_length)
        true_length = int(true_length)
        bucket = self.bucket_for(true_length)
        toks = np.asarray(padded_tokens, np.int32).reshape(-1)[:true_length]
        padded = np.full((1, bucket), self.pad_token_id, np.int32)
        padded[0, :true_length] = toks
        return self.prefill_batch(params, padded, np.asarray([true_length], np.int32))

    def _prefill_after(self, params, prefix: Prefix, padded_tokens, true_length: int) -> Prefix:
        """`prefill` with an existing prefix (see there)."""
        if not isinstance(prefix, Prefix):
            raise TypeError(f"existing_prefix must be a rollout.Prefix, got {type(prefix).__name__}")
        lengths, pending = np.asarray(prefix.lengths), np.asarray(prefix.tokens)
        if lengths.shape != (1,):
            raise ValueError(f"existing_prefix must hold one prompt, got {lengths.shape[0]} rows")
        true_length = int(true_length)
        bucket = self.bucket_for(true_length)
        toks = np.asarray(padded_tokens, np.int32).reshape(-1)[:true_length]
        if toks.size != true_length:
            raise ValueError(f"padded_tokens has {toks.size} tokens, fewer than true_length={true_length}")
        if toks[0] != pending[0]:
            raise ValueError(f"the new tokens must start at the existing prefix's pending token "
                             f"(sequence index {int(lengths[0])}, token {int(pending[0])}), got "
                             f"{int(toks[0])}; pass the sequence from index existing.lengths on")
        total = int(lengths[0]) + true_length
        if total > self._max_target:
            raise ValueError(f"existing prefix ({int(lengths[0])} cached tokens) + {true_length} new "
                             f"tokens exceeds max_target_length={self._max_target}")
        length = min(next((b for b in PREFILL_BUCKETS if b >= total), self._max_target), self._max_target)
        padded = np.full((1, bucket), self.pad_token_id, np.int32)
        padded[0, :true_length] = toks
        self.check_params(params)
        return self._run(self._extend_jit, params, prefix, jnp.asarray(padded),
                         jnp.asarray([true_length], jnp.int32), length)

    def prefill_multisampling(self, *, params, existing_prefix=None, padded_tokens,
                              true_length: int, num_samples: int = 1, **kw) -> Prefix:
        """Prefill once for `num_samples` samples: `bulk_insert` the prefix into that many slots."""
        del num_samples
        return self.prefill(params=params, existing_prefix=existing_prefix,
                            padded_tokens=padded_tokens, true_length=true_length)

    def insert(self, prefix: Prefix, decode_state: DecodeState, slot: int) -> DecodeState:
        return self.bulk_insert(prefix, decode_state, [slot])

    def bulk_insert(self, prefix: Prefix, decode_state: DecodeState, slots) -> DecodeState:
        """Inserts prefix row 0 into each slot of `slots` (one request, several samples), with the
        engine's default sampling parameters; each gets its own PRNG stream."""
        slots = [int(s) for s in slots]
        bad = [s for s in slots if not 0 <= s < self._slots]
        if bad:
            raise ValueError(f"slots {bad} out of range [0, {self._slots})")
        m = len(slots)
        rows = np.arange(self._request_counter, self._request_counter + m, dtype=np.int32)
        self._request_counter += m
        max_new = self._max_target - (np.asarray(prefix.lengths)[0] + 1)
        sp = self.sampling
        return self.insert_rows(decode_state, prefix, src=np.zeros(m, np.int32),
                                dst=np.asarray(slots, np.int32), rows=rows,
                                max_new=np.full(m, max_new, np.int32), sampling=sp,
                                key=self._base_key)

    def insert_rows(self, state, prefix, *, src, dst, rows, max_new, sampling, key=None,
                    row_keys=None) -> DecodeState:
        """Prefix rows `src` into slots `dst` (numpy int32[m]; a dst >= max_concurrent_decodes is
        padding and ignored); pads m to a power of two.

        rows int32[m]: each slot's `row` (the driver's output row); max_new int32[m].
        sampling: one SamplingParams for all rows, or a sequence of m (one per row).
        key: a typed PRNG key; slot i samples step t with fold_in(fold_in(key, rows[i]), t) (the
        driver's streams). row_keys: instead of key, raw key data uint32[m, k]
        (`jax.random.key_data` of each row's own, already folded key).
        """
        args = self._row_args(len(dst), rows, max_new, sampling, key, row_keys)
        return self._run(self._insert_jit, state, prefix, self._pad_rows(src, 0, len(dst)),
                         self._pad_rows(dst, self._slots, len(dst)), *args)

    def append_rows(self, state, *, tokens, true_lengths, dst, rows, max_new, sampling, key=None,
                    row_keys=None, with_experts: bool = False):
        """Prefix reuse on parked slots: appends tokens[i, :true_lengths[i]] to slot dst[i]'s KV
        cache at the slot's current length and re-arms the slot for a new request.

        A parked slot is an inactive slot whose cache still holds a sequence's first `lengths`
        tokens, its last token pending (what a finished request leaves). tokens int32[m, bucket]
        (numpy, right-padded; a prefill bucket) is the rest of the new sequence from index
        `lengths` on, i.e. starting with the pending token. Afterwards the slot has
        lengths = old + true_length - 1, tokens = the last new token, generated 0 and the given
        max_new / sampling / key (as `insert_rows`), active; other slots are untouched. Prefill
        work is proportional to the new tokens. Compiles once per (power-of-two m, bucket).
        with_experts: returns (state, experts): with `record_experts` the experts of the tokens
        the rows cache, [m, bucket, layers, k] (-1 from each row's last token on), else None.
        """
        tokens = np.asarray(tokens, np.int32)
        m = len(dst)
        if tokens.ndim != 2 or tokens.shape[0] != m or tokens.shape[1] not in self._buckets:
            raise ValueError(f"append_rows: tokens must be int32[{m}, bucket] with bucket one of "
                             f"{self._buckets}, got shape {tokens.shape}")
        if self.batch_invariant and m != BATCH_INVARIANT_ROWS:
            state, experts = self._append_fixed_rows(state, tokens, true_lengths, dst, rows, max_new,
                                                     sampling, key, row_keys)
            return (state, experts) if with_experts else state
        mp = _next_pow2(m)
        padded = np.full((mp, tokens.shape[1]), self.pad_token_id, np.int32)
        padded[:m] = tokens
        self.check_params()
        args = self._row_args(m, rows, max_new, sampling, key, row_keys)
        state, experts = self._run(self._append_jit, self._params, state, jnp.asarray(padded),
                                   self._pad_rows(true_lengths, 1, m), self._pad_rows(dst, self._slots, m),
                                   *args)
        if not with_experts:
            return state
        return state, (None if experts is None else experts[:m])

    def _append_fixed_rows(self, state, tokens, true_lengths, dst, rows, max_new, sampling, key,
                           row_keys) -> tuple:
        """(state, experts or None): `append_rows` (batch_invariant) as calls of exactly BATCH_INVARIANT_ROWS rows, padded with
        rows for slot `max_concurrent_decodes` (ignored), so each row's extension is computed by
        the same program at the same shape whatever its batch-mates."""
        m, r = len(dst), BATCH_INVARIANT_ROWS
        n = -(-m // r) * r

        def pad(x, fill):
            x = np.asarray(x).reshape(m, *np.shape(x)[1:])
            return np.concatenate([x, np.repeat(np.asarray(fill, x.dtype)[None], n - m, axis=0)])

        tokens = pad(tokens, np.full(tokens.shape[1], self.pad_token_id, np.int32))
        true_lengths, dst = pad(true_lengths, 1), pad(dst, self._slots)
        rows, max_new = pad(rows, 0), pad(max_new, 0)
        if row_keys is not None:
            row_keys = pad(np.asarray(row_keys, np.uint32), np.asarray(row_keys, np.uint32)[0])
        if not isinstance(sampling, SamplingParams):
            sampling = list(sampling)
            sampling += sampling[:1] * (n - m)
        parts = []
        for lo in range(0, n, r):
            part = slice(lo, lo + r)
            state, experts = self.append_rows(
                state, tokens=tokens[part], true_lengths=true_lengths[part], dst=dst[part],
                rows=rows[part], max_new=max_new[part], key=key,
                sampling=sampling if isinstance(sampling, SamplingParams) else sampling[part],
                row_keys=None if row_keys is None else row_keys[part], with_experts=True)
            parts.append(experts)
        return state, (None if parts[0] is None else jnp.concatenate(parts)[:m])

    @staticmethod
    def _pad_rows(x, fill, m):
        """int32[m] -> int32[next_pow2(m)] padded with `fill`."""
        x = np.asarray(x, np.int32).reshape(-1)
        if x.size != m:
            raise ValueError(f"expected {m} per-row values, got {x.size}")
        return jnp.asarray(np.concatenate([x, np.full(_next_pow2(m) - m, fill, np.int32)]))

    def _row_args(self, m, rows, max_new, sampling, key, row_keys) -> tuple:
        """(rows, max_new, temperature, top_k, top_p, key) padded to next_pow2(m) for `_arm`."""
        mp = _next_pow2(m)
        if (key is None) == (row_keys is None):
            raise ValueError("pass exactly one of key (a typed PRNG key) and row_keys (uint32[m, k])")
        if row_keys is not None:
            data = np.asarray(row_keys, np.uint32)
            if data.ndim != 2 or data.shape[0] != m:
                raise ValueError(f"row_keys must be uint32[{m}, k], got shape {data.shape}")
            key = jnp.asarray(np.concatenate([data, np.repeat(data[:1], mp - m, axis=0)]))
        if isinstance(sampling, SamplingParams):
            temp, top_k, top_p = (jnp.float32(sampling.temperature), jnp.int32(sampling.top_k),
                                  jnp.float32(sampling.top_p))
        else:
            sampling = list(sampling)
            if len(sampling) != m or not all(isinstance(s, SamplingParams) for s in sampling):
                raise ValueError(f"sampling must be a SamplingParams or {m} of them (one per row)")
            sampling += [sampling[0]] * (mp - m)
            temp = jnp.asarray([s.temperature for s in sampling], jnp.float32)
            top_k = jnp.asarray([s.top_k for s in sampling], jnp.int32)
            top_p = jnp.asarray([s.top_p for s in sampling], jnp.float32)
        return (self._pad_rows(rows, 0, m), self._pad_rows(max_new, 0, m), temp, top_k, top_p, key)

    def generate(self, params, decode_state: DecodeState) -> tuple[DecodeState, ResultTokens]:
        """One decode step for every slot. Free slots produce tokens with validity 0."""
        state, data, logp = self._run(self._generate_jit, params, decode_state)
        return state, ResultTokens(data=data, log_prob=logp)

    def decode_loop(self, params, state, out, num_steps: int, min_free: int):
        """The RL driver's multi-step loop (see `_loop_core`). Returns (state, out, steps)."""
        return self._run(self._loop_jit, params, state, out, jnp.int32(num_steps), jnp.int32(min_free))

    def set_generated(self, state: DecodeState, dst, generated) -> DecodeState:
        """Sets slots `dst`' generated-token counts (int[m] each, numpy): the step their next
        token samples with (fold_in(key, generated)) and the index it is written at. A request
        resumed after k tokens (its prefix re-prefilled) continues its key stream this way."""
        m = len(dst)
        return self._run(self._set_generated_jit, state, self._pad_rows(dst, self._slots, m),
                         self._pad_rows(generated, 0, m))

    def free_resource(self, decode_state: DecodeState, slot: int) -> DecodeState:
        """Marks `slot` free (its cache is simply overwritten by the next insert)."""
        return self._run(self._free_jit, decode_state, jnp.int32(slot))

    def get_prefix_destination_sharding(self) -> Prefix:
        return self._prefix_shardings

    def get_tokenizer(self):
        return self.tokenizer

    def build_tokenizer(self, metadata=None):
        return self.tokenizer

    @property
    def max_concurrent_decodes(self) -> int:
        return self._slots

    @property
    def samples_per_slot(self) -> int:
        return 1

    @property
    def max_prefill_length(self) -> int:
        return self._max_prefill

    @property
    def max_target_length(self) -> int:
        return self._max_target

    @property
    def prefill_buckets(self) -> tuple[int, ...]:
        return self._buckets

    @property
    def mesh(self):
        return self._mesh

    @property
    def colocated_cpus(self):
        return None

    @property
    def param_shardings(self):
        return self._param_shardings

    def kv_cache_bytes(self) -> int:
        """Bytes of the decode state's K and V (the same in both layer layouts)."""
        c = self.config
        n = c.num_hidden_layers * self._slots * self._max_target * c.num_key_value_heads * c.head_dim
        return 2 * n * self.kv_cache_dtype.itemsize
