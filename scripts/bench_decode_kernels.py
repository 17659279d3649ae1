"""Decode kernels alone, on one GPU: one-query attention over a KV cache (cuDNN vs the Pallas
Triton kernel under several tile plans) and the skinny decode GEMMs (one dot vs split-K).

    python scripts/bench_decode_kernels.py --out $OUT/kernels.json          # 1.5B shapes, batch 64/256/512
    python scripts/bench_decode_kernels.py --tiny                           # CPU smoke run (interpret mode)

Shapes are the Qwen2.5-1.5B decode step's (28 layers; 12 query heads, 2 kv heads, head_dim 128;
hidden 1536, intermediate 8960). What is timed: a jitted function that runs the kernel once per
layer on `--layers` distinct arrays (so caches and weights come from HBM, not L2), called
`--iters` times after two untimed calls. On a GPU, `ms` = the device time of all kernels of those
calls (a `jax.profiler` trace, summed by `scripts/trace_summary.py`) / (iters x layers): kernel
time only, so host dispatch and launch gaps are excluded (the full decode step's gaps are
measured by `bench_rollout.py --trace`); `wall_ms` = the median call / layers, host included.
Elsewhere `ms` = `wall_ms`.
- attention: bf16 caches [b, s, 2, 128], each row's length drawn uniformly from
  [s - 2 * (s - mean), s] around `--mean-context`; `kv_gbs` = K and V bytes of the rows' lengths /
  time; `max_err` = max |out - fp32 reference| over real rows.
- gemm: x [b, k] bf16 @ w [k, n] bf16 -> bf16; split S computes S partial products over k / S
  as one batched dot (fp32) and sums them; `w_gbs` = weight bytes / time. Compiled with cuBLAS
  (`xla_gpu_enable_triton_gemm=false`, the engine's decode option) and with XLA's default.
Prints one JSON object per line; `--out` writes the list.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_llm.metrics import perfetto_trace
from jaxrl_llm.models import _kernels
from jaxrl_llm.models._decoder import attend_one

GEMMS = {"qkv": (1536, 2048), "o": (1536, 1536), "gate_up": (1536, 17920), "down": (8960, 1536)}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batches", nargs="+", type=int, default=[64, 256, 512])
    p.add_argument("--cache-len", type=int, default=768)
    p.add_argument("--mean-context", type=float, default=704.5)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--parts", nargs="+", default=["attention", "gemm"], choices=["attention", "gemm"])
    p.add_argument("--splits", nargs="+", type=int, default=[1, 2, 4, 8])
    p.add_argument("--blocks", nargs="+", type=int, default=[32, 64, 128])
    p.add_argument("--warps", nargs="+", type=int, default=[4, 8])
    p.add_argument("--stages", nargs="+", type=int, default=[2, 3])
    p.add_argument("--gemm-splits", nargs="+", type=int, default=[1, 2, 3, 4, 6])
    p.add_argument("--tiny", action="store_true", help="small shapes, few plans (CPU smoke run)")
    p.add_argument("--out", default=None)
    return p.parse_args(argv)


def _time(fn, args, iters: int, per: int) -> dict:
    """{"ms": device kernel ms (GPU) or wall ms, "wall_ms"} of one warm call, divided by per."""
    for _ in range(2):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t)
    wall = statistics.median(times) * 1e3 / per
    if jax.default_backend() != "gpu":
        return {"ms": wall, "wall_ms": wall}
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import trace_summary

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "t.json.gz")
        perfetto_trace(lambda: [jax.block_until_ready(fn(*args)) for _ in range(iters)], path)
        summary = trace_summary.summarize(trace_summary.load_events(path), top=5)
    return {"ms": summary["kernel_ms"] / (iters * per), "wall_ms": wall,
            "kernels": [k["name"][:60] for k in summary["top_kernels"][:3]]}


def _guarded(run, kernel) -> dict:
    """run(kernel), or the error of a plan Triton cannot compile (e.g. shared memory), reported."""
    try:
        return run(kernel)
    except Exception as e:  # noqa: BLE001 - the sweep goes on; the record says what failed
        return {"error": f"{type(e).__name__}: {str(e)[:300]}"}


def bench_attention(args, b: int, emit) -> None:
    s, kvh, g, d, n = args.cache_len, 2, 6, 128, args.layers
    if args.tiny:
        s, kvh, g, d = 64, 2, 3, 32
    key = jax.random.PRNGKey(b)
    kq, kk, kv, kl = jax.random.split(key, 4)
    q = jax.random.normal(kq, (n, b, 1, kvh * g, d), jnp.float32).astype(jnp.bfloat16)
    ks = jax.random.normal(kk, (n, b, s, kvh, d), jnp.float32).astype(jnp.bfloat16)
    vs = jax.random.normal(kv, (n, b, s, kvh, d), jnp.float32).astype(jnp.bfloat16)
    ks, vs = list(ks), list(vs)  # one array per layer, as the per-layer engine keeps them
    mean = min(args.mean_context, s) if not args.tiny else s * 0.75
    low = max(1, int(round(2 * mean - s)))
    lengths = jax.random.randint(kl, (b,), low, s + 1, jnp.int32)
    kv_bytes = float(np.asarray(lengths, np.int64).sum()) * kvh * d * 2 * 2
    ref = np.asarray(attend_one(q[0].astype(jnp.float32), ks[0].astype(jnp.float32),
                                vs[0].astype(jnp.float32), lengths), np.float32)

    def run(kernel):
        @jax.jit
        def f(q, ks, vs, lengths):
            return [kernel(q[i], ks[i], vs[i], lengths) for i in range(n)]
        t = _time(f, (q, ks, vs, lengths), args.iters, n)
        err = float(np.abs(np.asarray(f(q, ks, vs, lengths)[0], np.float32) - ref).max())
        return {**t, "kv_gbs": kv_bytes / t["ms"] / 1e6, "max_err": err}

    base = {"part": "attention", "batch": b, "cache_len": s, "mean_context": float(np.mean(lengths))}
    if jax.default_backend() == "gpu":
        emit({**base, "kernel": "cudnn", **run(lambda q, k, v, lens: jax.nn.dot_product_attention(
            q, k, v, key_value_seq_lengths=lens, implementation="cudnn"))})
    emit({**base, "kernel": "triton_default", "plan": _kernels.triton_decode_plan(b, kvh, s),
          **_guarded(run, _kernels.triton_decode_attention)})
    plans = itertools.product(args.splits, args.blocks, args.warps, args.stages)
    if args.tiny:
        plans = [(1, 16, 4, 2), (2, 16, 4, 2)]
    for splits, block, warps, stages in plans:
        if s % splits or (s // splits) % block:
            continue
        plan = {"splits": splits, "block": block, "num_warps": warps, "num_stages": stages}
        rec = _guarded(run, lambda q, k, v, lens, plan=plan: _kernels.triton_decode_attention(
            q, k, v, lens, plan=plan))
        emit({**base, "kernel": "triton", "plan": plan, **rec})


def _split_dot(x, w, splits: int):
    if splits == 1:
        return x @ w
    k = x.shape[-1]
    xs = x.reshape(x.shape[0], splits, k // splits)
    ws = w.reshape(splits, k // splits, w.shape[-1])
    parts = jnp.einsum("bsk,skn->sbn", xs, ws, preferred_element_type=jnp.float32)
    return parts.sum(axis=0).astype(x.dtype)


def bench_gemm(args, b: int, emit) -> None:
    n = args.layers
    shapes = {"tiny": (64, 96)} if args.tiny else GEMMS
    for name, (k, m) in shapes.items():
        key = jax.random.PRNGKey(k * m + b)
        # distinct inputs and weights per layer: XLA merges dots that share an operand
        xs = [jax.random.normal(jax.random.fold_in(key, 1000 + i), (b, k), jnp.float32).astype(jnp.bfloat16)
              for i in range(n)]
        ws = [jax.random.normal(jax.random.fold_in(key, i), (k, m), jnp.float32).astype(jnp.bfloat16) * 0.02
              for i in range(n)]
        ref = np.asarray(xs[0].astype(jnp.float32) @ ws[0].astype(jnp.float32))
        for splits in args.gemm_splits:
            if k % splits:
                continue
            for backend, opts in (("cublas", {"xla_gpu_enable_triton_gemm": False}), ("xla_default", {})):
                if jax.default_backend() != "gpu":
                    if backend != "xla_default":
                        continue
                    opts = {}

                def f(xs, ws, splits=splits):
                    return [_split_dot(x, w, splits) for x, w in zip(xs, ws)]
                compiled = jax.jit(f).lower(xs, ws).compile(compiler_options=opts or None)
                t = _time(compiled, (xs, ws), args.iters, n)
                err = float(np.abs(np.asarray(compiled(xs, ws)[0], np.float32) - ref).max())
                emit({"part": "gemm", "gemm": name, "batch": b, "k": k, "n": m, "splits": splits,
                      "backend": backend, **t, "w_gbs": k * m * 2 / t["ms"] / 1e6, "max_err": err})


def main(argv=None):
    args = parse_args(argv)
    if args.tiny:
        args.batches, args.layers, args.iters, args.gemm_splits = [4], 2, 2, [1, 2]
    records = []

    def emit(rec):
        records.append(rec)
        print(json.dumps(rec), flush=True)

    for b in args.batches:
        if "attention" in args.parts:
            bench_attention(args, b, emit)
        if "gemm" in args.parts:
            bench_gemm(args, b, emit)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": str(jax.devices()[0].device_kind), "jax": jax.__version__, "records": records}, f, indent=1)
    return records


if __name__ == "__main__":
    main()
