"""LoRA adapters on the decoder's linear projections: y = x·W + (α/r)·(x·A)·B.

`add_lora(model, spec)` puts two `nnx.LoRAParam` arrays next to each target's `kernel` (in the
same `nnx.Dict`): `lora_a` [layers, *in, r] and `lora_b` [layers, r, *out], where `*in` / `*out`
are the kernel's own input / output dimensions (q_proj's kernel is [e, heads, head_dim], so its
`lora_b` is [r, heads, head_dim]). Each adapter carries the logical axes of the kernel dimensions
it shares (`layers`, `embed`, `heads`, `mlp`, ...; the rank dimension is unsharded), so the
`sharding` rules place adapters like their base weights. `nnx.LoRAParam` is a subclass of
`nnx.Param`: `nnx.split(model, nnx.LoRAParam, ...)` separates the trainable adapters from the
frozen base. A is drawn uniform(±1/sqrt(fan_in)) and B starts at zero (PEFT's default), so a
fresh adapter leaves the model's outputs exactly unchanged.

`merge_lora` folds the adapters into the base kernels (W + (α/r)·A·B per target, batched over
layers, cast fused) for the rollout engine and the merged Hugging Face export; the decoder's
forward adds the low-rank term itself (`lora_delta`). The PEFT-format files live in
`_peft.py`. Dropout on the adapter input is not implemented (`LoraSpec` rejects it).
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

# projection name -> (its module attribute in DecoderLayers, number of input dims of its kernel)
LORA_TARGETS = {
    "q_proj": ("self_attn", 1), "k_proj": ("self_attn", 1), "v_proj": ("self_attn", 1),
    "o_proj": ("self_attn", 2), "gate_proj": ("mlp", 1), "up_proj": ("mlp", 1),
    "down_proj": ("mlp", 1),
}


def resolve_targets(target_modules: str | Sequence[str]) -> tuple[str, ...]:
    """verl / PEFT `target_modules`: "all-linear" (every projection of the decoder layers; not
    the LM head) or names out of `LORA_TARGETS`. Returns them in canonical order."""
    names = [target_modules] if isinstance(target_modules, str) else list(target_modules)
    if "all-linear" in names:
        if len(names) > 1:
            raise ValueError(f"target_modules={names}: 'all-linear' stands alone")
        return tuple(LORA_TARGETS)
    if not names:
        raise ValueError(f"target_modules is empty; use 'all-linear' or names out of {list(LORA_TARGETS)}")
    unknown = sorted(set(names) - set(LORA_TARGETS))
    if unknown:
        raise ValueError(f"target_modules: unknown module(s) {unknown}; choose 'all-linear' or names "
                         f"out of {list(LORA_TARGETS)}")
    return tuple(n for n in LORA_TARGETS if n in names)


@dataclasses.dataclass(frozen=True)
class LoraSpec:
    """rank r, alpha α (the update is scaled by α/r, as in verl and PEFT), target modules."""

    rank: int
    alpha: float
    target_modules: tuple[str, ...] = tuple(LORA_TARGETS)
    dropout: float = 0.0

    def __post_init__(self):
        if int(self.rank) < 1:
            raise ValueError(f"LoRA rank must be >= 1, got {self.rank}")
        if not self.alpha > 0:
            raise ValueError(f"LoRA alpha must be > 0, got {self.alpha}")
        if self.dropout != 0.0:
            raise ValueError(f"LoRA dropout={self.dropout}: adapter dropout is not implemented; use 0.0")
        object.__setattr__(self, "target_modules", resolve_targets(self.target_modules))

    @property
    def scale(self) -> float:
        return float(self.alpha) / int(self.rank)


def lora_delta(p, x, n_in: int, scale: float | None):
    """The adapter term (α/r)·(x·A)·B of a projection dict `p` for input x [..., *in]; 0 when `p`
    has no adapter. Contracts x's last n_in dims with A's input dims."""
    if scale is None or "lora_a" not in p:
        return 0
    a = p["lora_a"][...].astype(x.dtype)
    b = p["lora_b"][...].astype(x.dtype)
    h = jnp.tensordot(x, a, axes=n_in)  # [..., r]
    return jnp.tensordot(h, b, axes=1) * jnp.asarray(scale, x.dtype)


def _adapter(shape, axes, *, fan_in_dims: int, rank: int, key, dtype):
    """(lora_a, lora_b) values and axes for a kernel of `shape` with `axes` (leading `layers` axis
    optional)."""
    lead = 1 if axes and axes[0] == "layers" else 0
    in_shape, out_shape = shape[lead:lead + fan_in_dims], shape[lead + fan_in_dims:]
    in_axes, out_axes = axes[lead:lead + fan_in_dims], axes[lead + fan_in_dims:]
    bound = 1.0 / math.sqrt(math.prod(in_shape))
    a = jax.random.uniform(key, shape[:lead] + in_shape + (rank,), jnp.float32, -bound, bound)
    b = jnp.zeros(shape[:lead] + (rank,) + out_shape, jnp.float32)
    return ((a.astype(dtype), tuple(axes[:lead]) + tuple(in_axes) + (None,)),
            (b, tuple(axes[:lead]) + (None,) + tuple(out_axes)))


def _layer_modules(model):
    """The DecoderLayers modules of a CausalLM / ValueModel (one stacked, or one per layer)."""
    layers = model.model.layers
    return [layers] if hasattr(layers, "self_attn") else list(layers)


def add_lora(model, spec: LoraSpec, *, seed: int = 0, mesh=None, rules: Any = None):
    """Adds LoRA adapters (in place) to `model` (CausalLM / ValueModel, either layer layout) and
    returns it. With `mesh`, every adapter is placed by the `sharding` rules (default: the
    training rules) from its logical axes, like the kernel it adapts."""
    if model.lora_spec is not None:
        raise ValueError("add_lora: the model already has LoRA adapters")
    mlp_targets = [n for n in spec.target_modules if LORA_TARGETS[n][0] == "mlp"]
    if model.config.is_moe and mlp_targets:
        raise ValueError(f"add_lora: target_modules {mlp_targets} are MLP projections, which a mixture-of-"
                         f"experts model ({model.config.model_type}) holds per expert; LoRA on experts is "
                         f"not supported yet: target only q_proj, k_proj, v_proj, o_proj")
    key = jax.random.key(seed)
    for li, layer in enumerate(_layer_modules(model)):
        for name in spec.target_modules:
            owner_name, n_in = LORA_TARGETS[name]
            owner = getattr(layer, owner_name)
            p = getattr(owner, name)
            kernel = p["kernel"]
            axes = tuple(kernel.get_metadata().get("logical_axes") or (None,) * kernel.ndim)
            key, sub = jax.random.split(jax.random.fold_in(key, li))
            (a, a_axes), (b, b_axes) = _adapter(tuple(kernel.shape), axes, fan_in_dims=n_in,
                                                rank=spec.rank, key=sub, dtype=kernel.dtype)
            p["lora_a"] = nnx.LoRAParam(_place(a, a_axes, mesh, rules), logical_axes=a_axes)
            p["lora_b"] = nnx.LoRAParam(_place(b, b_axes, mesh, rules), logical_axes=b_axes)
            owner.lora_scale = spec.scale
    model.lora_spec = spec
    return model


def _place(x, axes, mesh, rules):
    if mesh is None:
        return x
    import sharding

    rules = sharding.TRAIN_RULES if rules is None else rules
    return jax.device_put(x, sharding.logical_sharding(mesh, axes, rules, x.shape))


def merged_model(model, dtype=None):
    """A model without adapters whose weights are `model`'s merged ones (W + (α/r)·A·B), on the
    same shardings; `model` itself when it has no adapters. dtype: also cast the weights."""
    if model.lora_spec is None:
        return model
    from ._decoder import ValueModel, abstract_model

    graphdef, adapters, base = split_lora(model)
    config = model.config if dtype is None else model.config.replace(param_dtype=dtype)
    plain = abstract_model(config, value_head=isinstance(model, ValueModel),
                           layer_layout=model.model.layer_layout)
    plain_graphdef, plain_state = nnx.split(plain)
    shardings = jax.tree.map(lambda x: x.sharding, nnx.to_pure_dict(base))
    merged = jax.jit(lambda b, a: merge_lora(b, a, model.lora_spec.scale, dtype),
                     out_shardings=shardings)(nnx.to_pure_dict(base), nnx.to_pure_dict(adapters))
    nnx.replace_by_pure_dict(plain_state, merged)
    return nnx.merge(plain_graphdef, plain_state)


def _merge_kernel(kernel, a, b, scale, dtype):
    """W + scale·A·B with any leading batch (layers) dims: A [*lead, *in, r], B [*lead, r, *out]."""
    lead = a.ndim + b.ndim - kernel.ndim - 2  # a.ndim = lead + n_in + 1, b.ndim = lead + 1 + n_out
    r = a.shape[-1]
    a2 = a.reshape(a.shape[:lead] + (-1, r)).astype(jnp.float32)
    b2 = b.reshape(b.shape[:lead] + (r, -1)).astype(jnp.float32)
    delta = jnp.matmul(a2, b2).reshape(kernel.shape)
    return (kernel.astype(jnp.float32) + scale * delta).astype(dtype)


def merge_lora(base: dict, adapters: dict, scale: float, dtype=None) -> dict:
    """Pure param dicts: the base weights (no adapters) and the adapters (`lora_a`/`lora_b` next
    to where each `kernel` sits) -> base-structured weights with every adapted kernel replaced by
    W + scale·A·B (computed in fp32). dtype: cast every floating leaf to it (None keeps each
    leaf's own). Jit it: one fused program, no host round trip."""
    def cast(x):
        return x.astype(dtype) if dtype is not None and jnp.issubdtype(x.dtype, jnp.floating) else x

    def walk(b, a):
        if not isinstance(b, dict):
            return cast(b)
        out = {}
        for k, v in b.items():
            sub = a.get(k, {}) if isinstance(a, dict) else {}
            if k == "kernel" and isinstance(a, dict) and "lora_a" in a:
                out[k] = _merge_kernel(v, a["lora_a"], a["lora_b"], scale,
                                       dtype if dtype is not None else v.dtype)
            else:
                out[k] = walk(v, sub)
        return out

    return walk(base, adapters)


def split_lora(model):
    """(graphdef, adapters State, base State) of a model with adapters."""
    return nnx.split(model, nnx.LoRAParam, ...)

