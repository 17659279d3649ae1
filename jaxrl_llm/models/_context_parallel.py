"""Context-parallel attention for the training passes (the `context` mesh axis).

When the active sharding rules split the `length` dim of activations (the train rules put it on
the mesh axis `context`), every device holds one contiguous 1/n of each sequence. Everything in a
decoder layer but attention works token by token and runs sharded under jit as it is; attention
mixes tokens, so `context_attention` runs it the DeepSpeed-Ulysses way, under `shard_map`:

1. an all-to-all over `context` turns q, k, v from [b, t/n, heads, d] (all of the device's heads,
   a slice of the sequence) into [b, t, heads/n, d] (the whole sequence, a slice of the heads);
2. the ordinary single-device attention of the configured kind runs on that, with the whole
   sequence's segment ids (the attention mask: padding 0, packed sequences 1, 2, ...), so
   causality, padding and packed segments are masked exactly as without the axis;
3. a second all-to-all turns the output back into [b, t/n, heads, d].

Rotary positions are applied before (step 1) from the global positions the caller passes, and
each head sees all of its keys, so the result equals the unsharded one up to summation order.

Limits: the sequence length must be a multiple of the context size, and each tensor shard's
query heads must be divisible by it (kv heads fewer than that are repeated to the query heads
first: more all-to-all traffic, same result). Memory per device of attention is that of the
configured kernel on the whole sequence for heads/n heads (splash and cuDNN: linear in t; the
`xla` fallback materialises [t, t] scores, fine on CPU tests, not for long sequences).

This module decides nothing about mesh axes; it reads them from `sharding`'s active rules.
"""
from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

import sharding

_Q_AXES = ("batch", "length", "heads", "head_dim")
_KV_AXES = ("batch", "length", "kv_heads", "head_dim")


def context_parts() -> int:
    """How many devices the active rules split the sequence (`length`) dim over; 1 outside
    `sharding.use_rules` or when the rules leave it whole (rollout rules, mesh context 1)."""
    mesh, rules = sharding.current_mesh(), sharding.current_rules()
    if mesh is None:
        return 1
    return sharding.logical_axis_size(mesh, "length", rules)


def context_attention(local_attention: Callable, segment_ids, k, v):
    """The `mask` argument of `DecoderLayers.layer` on a context-parallel mesh: q -> attention
    output. q [b, t, h, d]; k, v [b, t, kvh, d] (the sequence dim split by the active rules);
    segment_ids int32[b, t]; local_attention(segment_ids [b', t], q [b', t, h', d], k, v
    [b', t, kvh', d]) -> [b', t, h', d] is the single-device attention run on each device's
    head slice of the whole sequence."""
    return lambda q: _ulysses(local_attention, segment_ids, q, k, v)


def _ulysses(local_attention, segment_ids, q, k, v):
    mesh, rules = sharding.current_mesh(), sharding.current_rules()
    n = context_parts()
    q_spec = sharding.logical_to_spec(_Q_AXES, rules, mesh)
    kv_spec = sharding.logical_to_spec(_KV_AXES, rules, mesh)
    axis = q_spec[1]  # the mesh axis (or axes) the sequence is split over
    _check_shapes(mesh, q_spec, kv_spec, q.shape, k.shape, n)
    seg_spec = PartitionSpec(q_spec[0], None)  # every device needs its rows' whole sequence

    def local(q, k, v, seg):
        h, kvh = q.shape[2], k.shape[2]
        if kvh % n:  # fewer kv heads than context shards: give every query head its own copy
            k, v = jnp.repeat(k, h // kvh, axis=2), jnp.repeat(v, h // kvh, axis=2)

        def to_heads(x):  # [b, t/n, heads, d] -> [b, t, heads/n, d]
            return jax.lax.all_to_all(x, axis, split_axis=2, concat_axis=1, tiled=True)

        out = local_attention(seg, to_heads(q), to_heads(k), to_heads(v))
        return jax.lax.all_to_all(out.astype(q.dtype), axis, split_axis=1, concat_axis=2, tiled=True)

    fn = jax.shard_map(local, mesh=mesh, in_specs=(q_spec, kv_spec, kv_spec, seg_spec), out_specs=q_spec,
                       check_vma=False)
    return fn(q, k, v, segment_ids.astype(jnp.int32))


def _parts(mesh, entry) -> int:
    if entry is None:
        return 1
    names = (entry,) if isinstance(entry, str) else tuple(entry)
    size = 1
    for name in names:
        size *= mesh.shape[name]
    return size


def _check_shapes(mesh, q_spec, kv_spec, q_shape, k_shape, n: int) -> None:
    """Clear errors for what would otherwise be a shape error from inside shard_map."""
    b, t, h, _ = q_shape
    kvh = k_shape[2]
    rows = _parts(mesh, q_spec[0])
    if b % rows:
        raise ValueError(f"context-parallel attention: {b} rows do not split over the {rows} data-parallel "
                         f"devices (mesh.data x mesh.fsdp); make the micro-batch a multiple of {rows}")
    if t % n:
        raise ValueError(f"context-parallel attention: sequence length {t} is not a multiple of mesh.context="
                         f"{n}; pad the sequences (data.max_prompt_length + data.max_response_length, or "
                         f"the pack length) to a multiple of {n}")
    h_local, kvh_local = h // _parts(mesh, q_spec[2]), kvh // _parts(mesh, kv_spec[2])
    if h_local % n:
        raise ValueError(f"context-parallel attention: {h_local} query heads per tensor shard do not split "
                         f"over mesh.context={n}; choose mesh.context (x mesh.tensor) dividing "
                         f"num_attention_heads={h}")
    if kvh_local % n and h_local % kvh_local:
        raise ValueError(f"context-parallel attention: {kvh_local} kv heads per tensor shard do not divide "
                         f"its {h_local} query heads")
