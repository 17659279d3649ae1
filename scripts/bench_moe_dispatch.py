"""Times the MoE expert dispatch (`models._decoder.grouped_experts`: sort by expert +
`jax.lax.ragged_dot`) for one layer, forward and forward+backward, against dense matmuls of the
same active FLOPs (what a perfect grouped matmul would cost).

    python scripts/bench_moe_dispatch.py --tokens 8192 --embed 2048 --ffn 768 --experts 128 --top-k 8
(the defaults are one Qwen3-30B-A3B layer's MLP shapes). Prints one JSON line per measurement."""
from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np


def timed(fn, *args, reps=10):
    out = fn(*args)
    jax.block_until_ready(out)
    t0 = time.perf_counter()
    for _ in range(reps):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / reps


def main():
    from jaxrl_llm.models._decoder import grouped_experts, route

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--embed", type=int, default=2048)
    p.add_argument("--ffn", type=int, default=768)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--dtype", default="bfloat16")
    args = p.parse_args()
    T, e, f, E, k = args.tokens, args.embed, args.ffn, args.experts, args.top_k
    dt = jnp.dtype(args.dtype)
    keys = jax.random.split(jax.random.key(0), 5)
    x = jax.random.normal(keys[0], (T, e), dt)
    router = jax.random.normal(keys[1], (e, E), dt) / e ** 0.5
    kern = (jax.random.normal(keys[2], (E, e, f), dt) / e ** 0.5,
            jax.random.normal(keys[3], (E, e, f), dt) / e ** 0.5,
            jax.random.normal(keys[4], (E, f, e), dt) / f ** 0.5)

    def moe(x, kern):
        w, ids = route(x @ router, k, True)
        return jnp.einsum("tke,tk->te", grouped_experts(x, ids, kern), w.astype(x.dtype))

    def dense(x, kern):  # the same active FLOPs as one [T*k, e] x [e, f] grouped matmul set
        xs = jnp.repeat(x, k, axis=0)
        g, u, d = (w[0] for w in kern)
        return (jax.nn.silu(xs @ g) * (xs @ u)) @ d

    flops = 2 * T * k * e * f * 3
    for name, fn in (("ragged_dot", moe), ("dense_same_flops", dense)):
        fwd = jax.jit(fn)
        bwd = jax.jit(jax.grad(lambda x, kern: jnp.sum(fn(x, kern).astype(jnp.float32) ** 2), argnums=(0, 1)))
        tf, tb = timed(fwd, x, kern), timed(bwd, x, kern)
        print(json.dumps(dict(impl=name, backend=jax.default_backend(), device=jax.devices()[0].device_kind,
                              tokens=T, embed=e, ffn=f, experts=E, top_k=k, dtype=args.dtype,
                              fwd_ms=round(tf * 1e3, 3), fwd_bwd_ms=round(tb * 1e3, 3),
                              fwd_tflops=round(flops / tf / 1e12, 1),
                              fwd_bwd_tflops=round(3 * flops / tb / 1e12, 1))), flush=True)


if __name__ == "__main__":
    np.set_printoptions(precision=3)
    main()
