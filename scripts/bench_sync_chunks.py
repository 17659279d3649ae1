"""Weight-sync timing per layer layout and layers per sync program (GPU), as JSON lines.

    python scripts/bench_sync_chunks.py          # Qwen2.5-1.5B shape with q/k/v biases, fp32 -> bf16
    SIZE=tiny python scripts/bench_sync_chunks.py

For `per_layer` and `per_layer_fused` and `rollout._weights.SYNC_LAYERS_PER_PROGRAM` in
0 (one program), 2, 4, 7, 14: the median of 30 `Engine.update_params` of the stacked fp32 params
(`update_params_ms`, and `multiple` of the byte-copy limit (fp32 read + bf16 written) / 4.3 TB/s),
of the sync without the engine's bookkeeping (`sync_block_ms`), and for 0 and 4 the traced kernel
time per sync (`kernel_ms`, top kernels). Uses the engine's private sync object.
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


def measure(model, state, layout: str, k: int, out_dir: str) -> dict:
    """One layout at `k` layers per sync program (the engine is freed on return)."""
    W.SYNC_LAYERS_PER_PROGRAM = k
    pure = nnx.to_pure_dict(state)
    engine = rollout.Engine.from_model(model, max_concurrent_decodes=8, max_prefill_length=16,
                                       max_target_length=32, dtype="bfloat16", layer_layout=layout)
    src = sum(x.nbytes for x in jax.tree.leaves(pure))
    dst = sum(x.nbytes for x in jax.tree.leaves(engine.params))
    limit = (src + dst) / 4.3e12 * 1e3
    for _ in range(3):
        engine.update_params(state)
    r = {"layout": engine.layer_layout, "k": k, "programs": len(engine._sync._parts),
         "leaves": len(jax.tree.leaves(engine.params)), "limit_ms": limit}
    r["update_params_ms"] = median_ms(lambda: engine.update_params(state))
    r["multiple"] = r["update_params_ms"] / limit
    r["sync_block_ms"] = median_ms(lambda: jax.block_until_ready(engine._sync(pure)))
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
    for layout in LAYOUTS:
        for k in LAYERS_PER_PROGRAM:
            print(json.dumps(measure(model, state, layout, k, os.environ.get("OUT", "/tmp"))), flush=True)


if __name__ == "__main__":
    main()
