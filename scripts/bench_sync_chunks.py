"""Weight-sync timing per layer layout and layers per sync program (GPU), as JSON lines.

    python scripts/bench_sync_chunks.py          # Qwen2.5-1.5B shape with q/k/v biases, fp32 -> bf16
    SIZE=tiny python scripts/bench_sync_chunks.py

For `per_layer` and `per_layer_fused` and `rollout._weights.SYNC_LAYERS_PER_PROGRAM` in
0 (one program), 2, 4, 7, 14, and `per_layer_fused` at 7 with and without `SYNC_DONATE` (the
sync writing into the engine's previous weights; `CASES=donate`: only these, twice, interleaved):
the median of 30 `Engine.update_params` of the stacked fp32 params (`update_params_ms`, and
`multiple` of the byte-copy limit (fp32 read + bf16 written) / 4.3 TB/s), of the sync without the
engine's bookkeeping and without donation (`sync_block_ms`), the medians of update_params' phases
(`phases_ms`: params to a pure dict, dropping the old engine arrays (freed unless donated),
enqueueing the sync's programs, waiting for them), and for 0 and 4 the traced kernel time per
sync (`kernel_ms`, top kernels); `equal_to_undonated`: the engine's weights then equal one sync into
new buffers. First (`PROBE=0`: not), what enqueueing one program costs the host by its number of
outputs. Uses the engine's private sync object.
"""
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import rollout
from jaxrl_llm.metrics import perfetto_trace
from jaxrl_llm.models import QWEN25_SHAPES, ModelConfig, init_model
from rollout import _weights as W

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import trace_summary  # noqa: E402 - scripts/trace_summary.py, a sibling script

LAYOUTS = ("per_layer", "per_layer_fused")
LAYERS_PER_PROGRAM = (0, 2, 4, 7, 14)
TRACED = (0, 4)


def median_ms(fn, n: int = 30) -> float:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times)) * 1e3


def kernel_summary(engine, state, path: str) -> dict:
    """Traced kernel time per sync (5 syncs) and the top kernels, or why there is none."""
    perfetto_trace(lambda: [engine.update_params(state) for _ in range(5)], path)
    try:
        t = trace_summary.summarize(trace_summary.load_events(path), per=5, top=6)
        return {"kernel_ms": t["kernel_ms"],
                "top": [(x["name"][:40], round(x["ms"], 4), x["calls"]) for x in t["top_kernels"]]}
    except ValueError as e:  # e.g. a CPU trace has no device tracks
        return {"trace": str(e)}
    finally:
        os.remove(path)


def phases_ms(engine, state, n: int = 30) -> dict:
    """Medians of `Engine.update_params`' steps, done one by one as it does them."""
    times = {"pure": [], "drop_old": [], "enqueue": [], "wait": []}
    for _ in range(n):
        t0 = time.perf_counter()
        pure = rollout._engine._pure(state)
        t1 = time.perf_counter()
        owned = {"params": engine._params}
        engine._params = None
        donate = owned if engine._params_fresh and engine._sync.may_donate(owned, engine._sync.layout(pure)) else None
        del owned
        t2 = time.perf_counter()
        new, stats = engine._sync(pure, donate=donate)
        del donate
        t3 = time.perf_counter()
        jax.block_until_ready(new)
        t4 = time.perf_counter()
        engine._params, engine._params_fresh = new, stats["fresh"]
        del new  # the engine holds the only reference: the next drop_old frees (or donates) them
        for k, a, b in (("pure", t0, t1), ("drop_old", t1, t2), ("enqueue", t2, t3), ("wait", t3, t4)):
            times[k].append(b - a)
    return {k: round(float(np.median(v)) * 1e3, 4) for k, v in times.items()}


def dispatch_probe() -> list[dict]:
    """What enqueueing one program costs the host by its number of outputs (slices of one 256 MiB
    bf16 array, 1 MiB or 1 KiB each): median ms to return (`enqueue_ms`) and to finish (`done_ms`)."""
    x = jnp.ones((256, 512, 1024), jnp.bfloat16)
    out = []
    for rows in (512, 1):
        for n in (1, 16, 64, 256):
            f = jax.jit(lambda x, n=n, rows=rows: [x[i, :rows] + 1 for i in range(n)])
            jax.block_until_ready(f(x))
            enqueue, done = [], []
            for _ in range(30):
                t0 = time.perf_counter()
                y = f(x)
                t1 = time.perf_counter()
                jax.block_until_ready(y)
                enqueue.append(t1 - t0)
                done.append(time.perf_counter() - t0)
                del y
            out.append({"probe_outputs": n, "output_kib": rows * 2, "enqueue_ms": float(np.median(enqueue)) * 1e3,
                        "done_ms": float(np.median(done)) * 1e3})
    return out


def measure(model, state, layout: str, k: int, out_dir: str, donate: bool = True) -> dict:
    """One layout at `k` layers per sync program (the engine is freed on return)."""
    W.SYNC_LAYERS_PER_PROGRAM, W.SYNC_DONATE = k, donate
    pure = nnx.to_pure_dict(state)
    engine = rollout.Engine.from_model(model, max_concurrent_decodes=8, max_prefill_length=16,
                                       max_target_length=32, dtype="bfloat16", layer_layout=layout)
    src = sum(x.nbytes for x in jax.tree.leaves(pure))
    dst = sum(x.nbytes for x in jax.tree.leaves(engine.params))
    limit = (src + dst) / 4.3e12 * 1e3
    for _ in range(3):
        engine.update_params(state)
    r = {"layout": engine.layer_layout, "k": k, "donate": donate, "programs": len(engine._sync._parts),
         "leaves": len(jax.tree.leaves(engine.params)), "limit_ms": limit}
    r["donated"] = engine.update_params(state)["donated"]
    r["update_params_ms"] = median_ms(lambda: engine.update_params(state))
    r["multiple"] = r["update_params_ms"] / limit
    r["sync_block_ms"] = median_ms(lambda: jax.block_until_ready(engine._sync(pure)))
    r["phases_ms"] = phases_ms(engine, state)
    # the engine's weights after all these (donating) syncs == one sync into new buffers
    fresh = engine._sync(pure)[0]
    r["equal_to_undonated"] = all(bool(jnp.array_equal(a, b)) for a, b in
                                  zip(jax.tree.leaves(engine.params), jax.tree.leaves(fresh)))
    del fresh
    if k in TRACED:
        r.update(kernel_summary(engine, state, f"{out_dir}/t_{layout}_{k}.json.gz"))
    return r


def main() -> None:
    s = QWEN25_SHAPES[os.environ.get("SIZE", "1.5b")]
    arch = {k: s[k] for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                              "num_attention_heads", "num_key_value_heads")}
    cfg = ModelConfig(**arch, head_dim=s["hidden_size"] // s["num_attention_heads"], tie_word_embeddings=True,
                      dtype=jnp.bfloat16, param_dtype=jnp.float32, attention_bias=True)
    model = init_model(cfg, seed=0)
    state = nnx.state(model, nnx.Param)
    if os.environ.get("PROBE", "1") == "1":
        for r in dispatch_probe():
            print(json.dumps(r), flush=True)
    cases = os.environ.get("CASES", "all")
    for layout in LAYOUTS if cases == "all" else ():
        for k in LAYERS_PER_PROGRAM:
            print(json.dumps(measure(model, state, layout, k, os.environ.get("OUT", "/tmp"))), flush=True)
    for donate in (True, False) * (1 if cases == "all" else 2):  # "donate": twice, interleaved
        print(json.dumps(measure(model, state, "per_layer_fused", 7, os.environ.get("OUT", "/tmp"), donate)),
              flush=True)


if __name__ == "__main__":
    main()
