"""Pallas TPU attention kernels over the decoder's layouts: splash attention for the full forward
(training, log-probs, prefill scoring) and a one-query decode kernel over the engine's KV cache.

Both take the model's own layouts (`q [b, t, h, d]`, keys/values `[b, s, kvh, d]`) and run under
`shard_map` when a `sharding.use_rules` mesh is active: every device runs the kernel on its rows
(the batch axes) and its heads (the tensor axis), which is where attention needs no
communication. Which mesh axes those are comes from the logical names, via `sharding`.

Off TPU the kernels run in Pallas interpret mode (slow, for tests of their numerics on CPU).
Choosing a kernel is `_decoder.py`'s business (`ModelConfig.attention`, `.decode_attention`).
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

import sharding

_LANES = 128
_MASK = -0.7 * float(np.finfo(np.float32).max)


def target_platform() -> str:
    """The platform the code being traced will run on: the active mesh's devices (an AOT
    compile for a TPU topology on a CPU host says "tpu"), else JAX's default backend."""
    mesh = sharding.current_mesh()
    if mesh is not None:
        return mesh.devices.flat[0].platform
    return jax.default_backend()


def _per_shard(fn, arrays_axes, out_axes, whole=()):
    """fn over the active mesh with `shard_map` (specs from the logical axes), or fn itself when
    no mesh is active. arrays_axes: logical axes of each positional argument."""
    mesh, rules = sharding.current_mesh(), sharding.current_rules()
    if mesh is None or mesh.size == 1:
        return fn
    for axis in whole:  # dims each device's kernel must see whole (a split would be silently wrong)
        parts = sharding.logical_axis_size(mesh, axis, rules)
        if parts > 1:
            raise ValueError(f"the Pallas attention kernels need the {axis!r} dim whole on each device, "
                             f"but the sharding rules split it into {parts} parts; map {axis!r} to None")
    specs = tuple(sharding.logical_to_spec(a, rules, mesh) for a in arrays_axes)
    return jax.shard_map(fn, mesh=mesh, in_specs=specs, out_specs=sharding.logical_to_spec(out_axes, rules, mesh),
                         check_vma=False)


# ------------------------------------------------------------------ training: splash attention
@functools.lru_cache(maxsize=64)
def _splash_kernel(heads: int, length: int, block: int, interpret: bool):
    from jax.experimental.pallas.ops.tpu import splash_attention as splash

    mask = splash.MultiHeadMask([splash.CausalMask((length, length))] * heads)
    sizes = splash.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block,
                              block_q_dkv=block, block_kv_dkv=block, block_kv_dkv_compute=block,
                              block_q_dq=block, block_kv_dq=block)
    with jax.ensure_compile_time_eval():  # concrete mask tables, safe to cache across traces
        return splash.make_splash_mha(mask, block_sizes=sizes, head_shards=1, q_seq_shards=1,
                                      interpret=interpret)


def _splash_local(q, k, v, segment_ids, *, interpret: bool):
    from jax.experimental.pallas.ops.tpu import splash_attention as splash

    b, t, h, d = q.shape
    tp = -(-t // _LANES) * _LANES  # pad the sequence to whole blocks (segment 0: padding)
    block = next(n for n in (512, 256, _LANES) if tp % n == 0)
    pad = [(0, 0), (0, tp - t), (0, 0), (0, 0)]
    scale = 1.0 / math.sqrt(d)
    qh = jnp.pad(q * jnp.asarray(scale, q.dtype), pad).transpose(0, 2, 1, 3)  # [b, h, tp, d]
    kh = jnp.pad(k, pad).transpose(0, 2, 1, 3).astype(q.dtype)
    vh = jnp.pad(v, pad).transpose(0, 2, 1, 3).astype(q.dtype)
    seg = jnp.pad(segment_ids.astype(jnp.int32), [(0, 0), (0, tp - t)])
    kernel = _splash_kernel(h, tp, block, interpret)
    out = jax.vmap(lambda q1, k1, v1, s1: kernel(q1, k1, v1, segment_ids=splash.SegmentIds(s1, s1)))(
        qh, kh, vh, seg)
    return out.transpose(0, 2, 1, 3)[:, :t].astype(q.dtype)


def splash_causal(q, k, v, segment_ids, *, interpret: bool | None = None):
    """Causal attention where query i sees key j <= i of the same segment, on the Pallas splash
    kernel. q [b, t, h, d]; k, v [b, t, kvh, d]; segment_ids int32[b, t].

    With segment ids = the attention mask (1 real, 0 padding) a real token sees exactly the real
    tokens up to it: the padding mask of `causal_padding_mask`, for any padding pattern. (Padding
    queries see padding keys; their outputs are never read by real tokens.)"""
    interpret = target_platform() != "tpu" if interpret is None else interpret
    fn = _per_shard(functools.partial(_splash_local, interpret=interpret),
                    (("batch", "length", "heads", "head_dim"),
                     ("batch", "length", "kv_heads", "head_dim"),
                     ("batch", "length", "kv_heads", "head_dim"), ("batch", "length")),
                    ("batch", "length", "heads", "head_dim"), whole=("length", "head_dim"))
    return fn(q, k, v, segment_ids)


# ------------------------------------------------------------------ decode: one query per row
def _decode_kernel(lengths_ref, q_ref, k_ref, v_ref, o_ref, m_ref, l_ref, acc_ref, *, block: int):
    """Grid (row, cache block). q [1, kvh, g, d] (pre-scaled); k, v [1, block, kvh, d] (or
    [1, block, d] for one kv head): online softmax over the row's first lengths[row] cache slots
    (blocks past them are skipped and not fetched)."""
    row, j = pl.program_id(0), pl.program_id(1)
    kvh = q_ref.shape[1]

    @pl.when(j == 0)
    def _init():
        m_ref[...] = jnp.full(m_ref.shape, _MASK, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    length = lengths_ref[row]

    @pl.when(j * block < length)
    def _block():
        k = k_ref[0].astype(jnp.float32)  # [block, kvh, d] or [block, d]
        v = v_ref[0].astype(jnp.float32)
        slot = j * block + jax.lax.broadcasted_iota(jnp.int32, (1, block), 1)
        for hk in range(kvh):  # kv heads are few per device: a static loop of 2-D matmuls
            k_h, v_h = (k, v) if k.ndim == 2 else (k[:, hk, :], v[:, hk, :])
            q = q_ref[0, hk].astype(jnp.float32)  # [g, d]
            s = jax.lax.dot_general(q, k_h, (((1,), (1,)), ((), ())),
                                    preferred_element_type=jnp.float32)  # [g, block]
            s = jnp.where(slot < length, s, _MASK)
            m_prev, l_prev = m_ref[hk], l_ref[hk]  # [g, 1]
            m_new = jnp.maximum(m_prev, s.max(axis=-1, keepdims=True))
            p = jnp.exp(s - m_new)
            alpha = jnp.exp(m_prev - m_new)
            l_ref[hk] = alpha * l_prev + p.sum(axis=-1, keepdims=True)
            m_ref[hk] = m_new
            acc_ref[hk] = alpha * acc_ref[hk] + jax.lax.dot_general(
                p, v_h, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)

    @pl.when(j == pl.num_programs(1) - 1)
    def _done():
        o_ref[0] = (acc_ref[...] / jnp.maximum(l_ref[...], 1e-30)).astype(o_ref.dtype)


def _cache_block(s: int) -> int:
    for block in (512, 256, 128):
        if s % block == 0:
            return block
    return s


def _decode_local(q, k_cache, v_cache, kv_lengths, *, interpret: bool):
    b, _, h, d = q.shape
    s, kvh = k_cache.shape[1], k_cache.shape[2]
    g = h // kvh
    block = _cache_block(s)
    qg = (q.astype(jnp.float32) / math.sqrt(d)).reshape(b, kvh, g, d)
    # The cache is read where it lies: [b, s, kvh, d] blocks of whole rows of kv heads (the TPU
    # tiles the (kvh, d) minor dims). One kv head per device: [b, s, d], which is how the TPU lays
    # out a size-1 head axis, so neither view copies the cache.
    kv_block = (1, block, kvh, d) if kvh > 1 else (1, block, d)
    if kvh == 1:
        k_cache, v_cache = k_cache.reshape(b, s, d), v_cache.reshape(b, s, d)

    def kv_map(row, j, lengths):  # past the row's length: keep the last needed block (no fetch)
        last = jnp.maximum(lengths[row] - 1, 0) // block
        return (row, jnp.minimum(j, last)) + (0,) * (len(kv_block) - 2)

    def q_map(row, j, lengths):
        return row, 0, 0, 0

    spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1, grid=(b, s // block),
        in_specs=[pl.BlockSpec((1, kvh, g, d), q_map), pl.BlockSpec(kv_block, kv_map),
                  pl.BlockSpec(kv_block, kv_map)],
        out_specs=pl.BlockSpec((1, kvh, g, d), q_map),
        scratch_shapes=[pltpu.VMEM((kvh, g, 1), jnp.float32), pltpu.VMEM((kvh, g, 1), jnp.float32),
                        pltpu.VMEM((kvh, g, d), jnp.float32)])
    out = pl.pallas_call(
        functools.partial(_decode_kernel, block=block), grid_spec=spec,
        out_shape=jax.ShapeDtypeStruct((b, kvh, g, d), q.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        interpret=interpret, name="jaxrl_decode_attention",
    )(kv_lengths.astype(jnp.int32), qg, k_cache, v_cache)
    return out.reshape(b, 1, h, d)


def decode_attention(q, k_cache, v_cache, kv_lengths, *, interpret: bool | None = None):
    """One new query per row over a cache, as `attend_one` computes it, on a Pallas kernel that
    reads the cache in place (no copy or transpose) and stops at each row's length.
    q [b, 1, h, d]; caches [b, s, kvh, d]; kv_lengths int32[b] (row b sees slots < kv_lengths[b])."""
    interpret = target_platform() != "tpu" if interpret is None else interpret
    fn = _per_shard(functools.partial(_decode_local, interpret=interpret),
                    (("batch", None, "heads", "head_dim"),
                     ("cache_batch", "cache_length", "kv_heads", "head_dim"),
                     ("cache_batch", "cache_length", "kv_heads", "head_dim"), ("cache_batch",)),
                    ("batch", None, "heads", "head_dim"), whole=("cache_length", "head_dim"))
    return fn(q, k_cache, v_cache, kv_lengths)


# ------------------------------------------------------------------ decode on GPU: Pallas Triton
def _triton_decode_kernel(len_ref, q_ref, k_ref, v_ref, o_ref, *lse_ref, g: int, rows: int,
                          block: int, chunk: int, scale: float):
    """Grid (row, kv head, split). q [g, d] (the kv head's query heads); k, v [s, d] (this row's
    slots of this kv head, read in place from [b, s, kvh, d]); online softmax over the split's
    slots [split * chunk, min((split + 1) * chunk, length)). With one split, o [g, d] is the
    normalised output; with several, o is the split's normalised output (fp32) and lse its
    log-sum-exp, which `_merge_splits` combines."""
    from jax.experimental.pallas import triton as plgpu

    split = pl.program_id(2)
    length = len_ref[()]
    start = split * chunk
    end = jnp.minimum(start + chunk, length)
    head = jax.lax.broadcasted_iota(jnp.int32, (rows,), 0) < g  # the tile has rows >= g (dot >= 16)
    q = plgpu.load(q_ref.at[pl.ds(0, rows), :], mask=head[:, None], other=0.0)
    # an fp8 cache (rollout.kv_cache_dtype): its bytes are loaded and converted to q's dtype here
    dot_dtype = q_ref.dtype if k_ref.dtype == jnp.float8_e4m3fn else k_ref.dtype
    q = (q.astype(jnp.float32) * scale).astype(dot_dtype)

    def body(i, carry):
        o, m, l = carry
        first = start + i * block
        slot = first + jax.lax.broadcasted_iota(jnp.int32, (block,), 0)
        valid = slot < end
        k = plgpu.load(k_ref.at[pl.ds(first, block), :], mask=valid[:, None], other=0.0).astype(dot_dtype)
        s = plgpu.dot(q, k, trans_b=True)  # [rows, block], fp32
        s = jnp.where(valid[None, :], s, _MASK)
        m_new = jnp.maximum(m, s.max(axis=-1))
        p = jnp.exp(s - m_new[:, None])
        alpha = jnp.exp(m - m_new)
        v = plgpu.load(v_ref.at[pl.ds(first, block), :], mask=valid[:, None], other=0.0).astype(dot_dtype)
        o = alpha[:, None] * o + plgpu.dot(p.astype(dot_dtype), v)
        return o, m_new, alpha * l + p.sum(axis=-1)

    d = q_ref.shape[-1]
    init = (jnp.zeros((rows, d), jnp.float32), jnp.full((rows,), _MASK, jnp.float32),
            jnp.zeros((rows,), jnp.float32))
    o, m, l = jax.lax.fori_loop(0, pl.cdiv(jnp.maximum(end - start, 0), block), body, init)
    plgpu.store(o_ref.at[pl.ds(0, rows), :], (o / jnp.maximum(l, 1e-30)[:, None]).astype(o_ref.dtype),
                mask=head[:, None])
    if lse_ref:
        lse = jnp.where(l > 0, m + jnp.log(jnp.maximum(l, 1e-30)), _MASK)
        plgpu.store(lse_ref[0].at[pl.ds(0, rows)], lse, mask=head)


def triton_decode_plan(b: int, kvh: int, s: int, **overrides) -> dict:
    """Tile sizes of the Triton decode kernel for b rows, kvh kv heads and s cache slots.
    splits (of each row's slots, run as separate programs and merged): doubled while rows x kv
    heads x splits is under one program per SM of an H200 (132) and each split keeps at least
    512 slots (so short caches are never split: at 768 slots, batch 64 to 512, one split measured
    fastest); block (slots per loop step): the largest of (64, 32, 16) dividing s / splits; pipeline
    stages: 3 under two programs per SM, else 2 (measured best at batch 64, and at 256 and 512,
    with block 64: `scripts/bench_decode_kernels.py`).
    overrides: any of block, splits, num_warps, num_stages (the benchmark's sweep)."""
    splits = overrides.get("splits")
    if splits is None:
        splits = 1
        while b * kvh * splits < 132 and s % (2 * splits) == 0 and s // (2 * splits) >= 512:
            splits *= 2
    if s % splits:
        raise ValueError(f"triton decode: cache length {s} is not a multiple of splits={splits}")
    chunk = s // splits
    block = overrides.get("block") or next((n for n in (64, 32, 16) if chunk % n == 0), None)
    if block is None or chunk % block:
        raise ValueError(f"decode_attention='triton' needs each split of the cache ({s} slots / {splits}) "
                         f"to be a multiple of 16 slots" + (f" and of block={block}" if block else ""))
    # few programs (under two per SM): a deeper pipeline keeps more loads in flight per program
    stages = 3 if b * kvh * splits < 2 * 132 else 2
    return {"block": block, "splits": splits, "num_warps": overrides.get("num_warps") or 4,
            "num_stages": overrides.get("num_stages") or stages}


def _merge_splits(o, lse):
    """o [b, kvh, splits, g, d] fp32 normalised per split, lse [b, kvh, splits, g] -> [b, kvh, g, d]."""
    w = jax.nn.softmax(lse, axis=2)
    return jnp.sum(o * w[..., None], axis=2)


def _triton_decode_local(q, k_cache, v_cache, kv_lengths, *, interpret: bool, plan: dict | None):
    from jax.experimental.pallas import triton as plgpu

    b, _, h, d = q.shape
    s, kvh = k_cache.shape[1], k_cache.shape[2]
    g = h // kvh
    plan = triton_decode_plan(b, kvh, s, **(plan or {}))
    block, splits = plan["block"], plan["splits"]
    rows = max(16, pl.next_power_of_2(g))
    qg = q.reshape(b, kvh, g, d)  # a view: each kv head's g query heads are adjacent
    kv_spec = pl.BlockSpec((None, s, None, d), lambda r, hk, sp: (r, 0, hk, 0))
    in_specs = [pl.BlockSpec((None,), lambda r, hk, sp: (r,)),
                pl.BlockSpec((None, None, g, d), lambda r, hk, sp: (r, hk, 0, 0)), kv_spec, kv_spec]
    kernel = functools.partial(_triton_decode_kernel, g=g, rows=rows, block=block, chunk=s // splits,
                               scale=1.0 / math.sqrt(d))
    if splits == 1:  # the normalised output itself
        out_specs = [pl.BlockSpec((None, None, g, d), lambda r, hk, sp: (r, hk, 0, 0))]
        out_shape = [jax.ShapeDtypeStruct((b, kvh, g, d), q.dtype)]
    else:  # each split's output and log-sum-exp, merged below
        out_specs = [pl.BlockSpec((None, None, None, g, d), lambda r, hk, sp: (r, hk, sp, 0, 0)),
                     pl.BlockSpec((None, None, None, g), lambda r, hk, sp: (r, hk, sp, 0))]
        out_shape = [jax.ShapeDtypeStruct((b, kvh, splits, g, d), jnp.float32),
                     jax.ShapeDtypeStruct((b, kvh, splits, g), jnp.float32)]
    outs = pl.pallas_call(
        kernel, grid=(b, kvh, splits), in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=plan["num_warps"], num_stages=plan["num_stages"]),
        interpret=interpret, name="jaxrl_triton_decode" + ("_split" if splits > 1 else ""),
    )(kv_lengths.astype(jnp.int32), qg, k_cache, v_cache)
    out = outs[0] if splits == 1 else _merge_splits(*outs).astype(q.dtype)
    return out.reshape(b, 1, h, d)


def triton_decode_attention(q, k_cache, v_cache, kv_lengths, *, interpret: bool | None = None,
                            plan: dict | None = None):
    """`decode_attention` on a Pallas Triton kernel for GPUs: each (row, kv head) program reads
    that head's slots of the cache in place ([b, s, kvh, d], no copy or transpose), up to the
    row's length, with the kv head's query heads as one tile, so each cache byte is read once.
    plan: overrides of `triton_decode_plan` (block, splits, num_warps, num_stages). Pallas
    interpret mode off GPU."""
    interpret = target_platform() != "gpu" if interpret is None else interpret
    fn = _per_shard(functools.partial(_triton_decode_local, interpret=interpret, plan=plan),
                    (("batch", None, "heads", "head_dim"),
                     ("cache_batch", "cache_length", "kv_heads", "head_dim"),
                     ("cache_batch", "cache_length", "kv_heads", "head_dim"), ("cache_batch",)),
                    ("batch", None, "heads", "head_dim"), whole=("cache_length", "head_dim"))
    return fn(q, k_cache, v_cache, kv_lengths)
