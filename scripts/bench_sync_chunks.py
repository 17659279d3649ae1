"""Weight-sync timing per layer layout and layers per sync program (GPU), as JSON lines.

    python scripts/bench_sync_chunks.py          # Qwen2.5-1.5B shape with q/k/v biases, fp32 -> bf16
    SIZE=tiny python scripts/bench_sync_chunks.py

For `per_layer` and `per_layer_fused` and `rollout._weights.SYNC_LAYERS_PER_PROGRAM` in
0 (one program), 2, 4, 7, 14: the median of 30 `Engine.update_params` of the stacked fp32 params
(`update_params_ms`, and `multiple` of the byte-copy limit (fp32 read + bf16 written) / 4.3 TB/s),
of the sync without the engine's bookkeeping (`sync_block_ms`), and for 0 and 4 the traced kernel
time per sync (`kernel_ms`, top kernels). Uses the engine's private sync object.
"""
import json, os, sys, time
import numpy as np, jax, jax.numpy as jnp
from flax import nnx
import rollout
from rollout import _weights as W
from jaxrl_llm.models import ModelConfig, init_model, QWEN25_SHAPES
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
out_dir = os.environ.get("OUT", "/tmp")
s = QWEN25_SHAPES[os.environ.get("SIZE", "1.5b")]
arch = {k: s[k] for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                          "num_attention_heads", "num_key_value_heads")}
cfg = ModelConfig(**arch, head_dim=s["hidden_size"] // s["num_attention_heads"], tie_word_embeddings=True,
                  dtype=jnp.bfloat16, param_dtype=jnp.float32, attention_bias=True)
model = init_model(cfg, seed=0)
state = nnx.state(model, nnx.Param)
pure = nnx.to_pure_dict(state)
src = sum(x.nbytes for x in jax.tree.leaves(pure))
def rep(fn, n=30):
    ts = []
    for _ in range(n):
        t0 = time.perf_counter(); fn(); ts.append(time.perf_counter() - t0)
    return float(np.median(ts)) * 1e3
import trace_summary
from jaxrl_llm.metrics import perfetto_trace
for layout in ("per_layer", "per_layer_fused"):
    for k in (0, 2, 4, 7, 14):
        W.SYNC_LAYERS_PER_PROGRAM = k
        eng = rollout.Engine.from_model(model, max_concurrent_decodes=8, max_prefill_length=16,
                                        max_target_length=32, dtype="bfloat16", layer_layout=layout)
        dst = sum(x.nbytes for x in jax.tree.leaves(eng.params))
        limit = (src + dst) / 4.3e12 * 1e3
        for _ in range(3): eng.update_params(state)
        r = {"layout": eng.layer_layout, "k": k, "programs": len(eng._sync._parts),
             "leaves": len(jax.tree.leaves(eng.params)), "limit_ms": limit}
        r["update_params_ms"] = rep(lambda: eng.update_params(state))
        r["multiple"] = r["update_params_ms"] / limit
        r["sync_block_ms"] = rep(lambda: jax.block_until_ready(eng._sync(pure)))
        if k in (0, 4):
            path = f"{out_dir}/t_{layout}_{k}.json.gz"
            perfetto_trace(lambda: [eng.update_params(state) for _ in range(5)], path)
            try:
                t = trace_summary.summarize(trace_summary.load_events(path), per=5, top=6)
                r["kernel_ms"] = t["kernel_ms"]
                r["top"] = [(x["name"][:40], round(x["ms"], 4), x["calls"]) for x in t["top_kernels"]]
            except ValueError as e:
                r["trace"] = str(e)
            os.remove(path)
        del eng
        print(json.dumps(r), flush=True)
