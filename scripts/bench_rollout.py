"""Rollout throughput benchmark: our engine + RL driver vs Hugging Face `generate` on one GPU.

    python scripts/bench_rollout.py                       # Qwen2.5-0.5B/1.5B shapes, batch 64/256
    python scripts/bench_rollout.py --models 0.5b --batches 64 --no-peer
    python scripts/bench_rollout.py --tiny                # CPU smoke run in seconds (tests call it)
    python scripts/bench_rollout.py --models 1.5b --batches 256 --variants einsum:1 reduce:1 reduce:0
    python scripts/bench_rollout.py --models 1.5b --batches 256 --no-peer --layouts stacked per_layer

`--variants ATTN:UNROLL ...` times the decode path under each setting of
`ModelConfig.decode_attention` (auto | einsum | reduce | cudnn | pallas) and `.decode_unroll`
(layers per scan iteration; 0 = all; the stacked layout only); the default `auto:1` is the
library's default. `--layouts` picks the engine's `layer_layout` (per_layer: separate weight and
KV-cache arrays per layer, unrolled; stacked: `[L, ...]` arrays under a scan; auto: what the
engine would choose for these params, i.e. stacked, since it could share the model's bf16
buffers); every (layout, variant) pair is timed.

Random-init bf16 models with Qwen2.5 shapes; every prompt is `--prompt-len` random tokens and
generates exactly `--gen-len` tokens (no stop tokens). Prints one JSON object per line with:
tokens_per_s, ms_per_step (decode only), hbm_fraction = (weight bytes + KV bytes read per step)
/ step time / HBM bandwidth, compile_s, peak_bytes, and the same workload through transformers'
`generate` in torch (`peer`) when torch + CUDA are available.
"""
from __future__ import annotations

import argparse
import gc
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_llm.metrics import JsonReport, perfetto_trace
from jaxrl_llm.models import QWEN25_SHAPES

QWEN25 = {k: QWEN25_SHAPES[k] for k in ("0.5b", "1.5b", "tiny")}

def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", nargs="+", default=["0.5b", "1.5b"], choices=sorted(QWEN25))
    p.add_argument("--batches", nargs="+", type=int, default=[64, 256])
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--gen-len", type=int, default=512)
    p.add_argument("--steps-per-sync", type=int, default=32)
    p.add_argument("--hbm-gbs", type=float, default=4800.0, help="HBM bandwidth, GB/s (H200: 4800)")
    p.add_argument("--no-peer", action="store_true", help="skip the transformers generate peer")
    p.add_argument("--variants", nargs="+", default=["auto:1"],
                   help="decode settings ATTN:UNROLL to compare (see the module docstring)")
    p.add_argument("--layouts", nargs="+", default=["per_layer"],
                   choices=["per_layer", "stacked", "auto"],
                   help="engine layer_layout(s) to compare (see the module docstring)")
    p.add_argument("--out", default="", help="also write the results (a JSON list) here")
    p.add_argument("--trace", default="", help="write a jax.profiler perfetto trace of each timed "
                   "run into this folder (trace_<layout>_<attn>_<unroll>.json.gz)")
    p.add_argument("--check", action="store_true", help="first compare each variant's one-token "
                   "decode with an fp32 einsum reference on a small bf16 model (relative error)")
    p.add_argument("--tiny", "--dry-run", dest="tiny", action="store_true",
                   help="tiny model, batch 4, 16+8 tokens, fp32, no peer: a CPU smoke run")
    args = p.parse_args(argv)
    if args.tiny:
        args.models, args.batches, args.prompt_len, args.gen_len = ["tiny"], [4], 16, 8
        args.steps_per_sync, args.no_peer = 4, True
    return args


def _config(name, dtype, variant="auto:1"):
    from jaxrl_llm.models import ModelConfig
    attn, unroll = variant.split(":")
    return ModelConfig(model_type="qwen2", attention_bias=True, rope_theta=1e6,
                       max_position_embeddings=32768, dtype=dtype, param_dtype=dtype,
                       decode_attention=attn, decode_unroll=int(unroll), **QWEN25[name])


def _peak_bytes():
    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("peak_bytes_in_use")


def bench_ours(name, batch, args, variant="auto:1", layout="per_layer"):
    import rollout
    from jaxrl_llm.models import init_model
    from rollout._engine import PREFILL_BUCKETS

    dtype = jnp.float32 if args.tiny else jnp.bfloat16
    cfg = _config(name, dtype, variant)
    model = init_model(cfg, seed=0)
    prefill_len = next(b for b in PREFILL_BUCKETS if b >= args.prompt_len)
    engine = rollout.Engine.from_model(
        model, max_concurrent_decodes=batch, max_prefill_length=prefill_len,
        max_target_length=max(prefill_len + 1, args.prompt_len + args.gen_len), temperature=1.0,
        layer_layout=layout)
    del model
    driver = rollout.RolloutDriver(engine, steps_per_sync=args.steps_per_sync,
                                   max_prefill_batch=min(batch, 64))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, cfg.vocab_size, args.prompt_len).tolist() for _ in range(batch)]
    sp = rollout.SamplingParams(temperature=1.0)

    def run(gen):
        t0 = time.perf_counter()
        out = driver.generate(prompts, n=1, max_new_tokens=gen, sampling=sp, seed=0)
        return time.perf_counter() - t0, out

    compile_s, _ = run(args.gen_len)  # first call compiles prefill, insert and the decode loop
    run(1)  # a 1-token run has other output-buffer shapes: compile those before timing
    prefill_s, _ = run(1)  # prefill + insert + one decode step
    if args.trace:
        total_s, out = perfetto_trace(lambda: run(args.gen_len), os.path.join(
            args.trace, f"trace_{engine.layer_layout}_{attn}_{unroll}.json.gz"))
    else:
        total_s, out = run(args.gen_len)
    gen_tokens = int(out.response_lengths.sum())
    step_s = max(total_s - prefill_s, 1e-9) / max(args.gen_len - 1, 1)
    c = engine.config
    weight_bytes = sum(x.nbytes for x in jax.tree.leaves(engine.params))
    kv_per_token = 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * jnp.dtype(c.dtype).itemsize
    avg_ctx = args.prompt_len + args.gen_len / 2
    bytes_per_step = weight_bytes + batch * avg_ctx * kv_per_token
    return {
        "engine": "jaxrl_llm.rollout", "model": f"qwen2.5-{name}", "batch": batch,
        "decode_attention": cfg.decode_attention, "decode_unroll": cfg.decode_unroll, "layer_layout": engine.layer_layout,
        "prompt_len": args.prompt_len, "gen_len": args.gen_len, "dtype": str(jnp.dtype(dtype)),
        "device": str(jax.devices()[0].device_kind), "generated_tokens": gen_tokens,
        "tokens_per_s": gen_tokens / total_s, "total_s": total_s, "prefill_s": prefill_s,
        "ms_per_step": step_s * 1e3, "compile_s": compile_s - total_s,
        "hbm_fraction": bytes_per_step / step_s / (args.hbm_gbs * 1e9),
        "bytes_per_step": int(bytes_per_step), "weight_bytes": int(weight_bytes),
        "kv_cache_bytes": int(engine.kv_cache_bytes()), "peak_bytes": _peak_bytes(),
        "decode_loops": out.stats["decode_loops"], "steps_per_sync": args.steps_per_sync,
    }


def check_variants(variants, layouts=("stacked",)) -> list[dict]:
    """Relative error of each (layout, variant)'s one-token decode vs an fp32 stacked einsum
    reference (bf16 model, head_dim 128, GQA 4:1, rows at different cache offsets)."""
    from jaxrl_llm.models import ModelConfig, _decoder, init_model
    from flax import nnx
    out = []
    base = dict(vocab_size=1024, hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=1, model_type="qwen2", attention_bias=True)
    rng = np.random.default_rng(1)
    b, s = 8, 256
    ids = jnp.asarray(rng.integers(0, 1024, (b, 100)), jnp.int32)
    index = jnp.asarray(rng.integers(1, 100, b), jnp.int32)
    tok = jnp.asarray(rng.integers(0, 1024, (b, 1)), jnp.int32)

    def decode(dtype, variant, layout="stacked"):
        attn, unroll = variant.split(":")
        config = ModelConfig(**base, dtype=dtype, param_dtype=dtype, decode_attention=attn,
                             decode_unroll=int(unroll))
        model = init_model(config, seed=0)
        _, pre = model.prefill(ids)
        pad = [(0, 0), (0, 0), (0, s - 100), (0, 0), (0, 0)]
        cache = _decoder.KVCache(jnp.pad(pre.k, pad), jnp.pad(pre.v, pad))
        if layout == "per_layer":
            pure = nnx.to_pure_dict(nnx.state(model, nnx.Param))
            graphdef, _ = nnx.split(_decoder.abstract_model(config, layer_layout="per_layer"), nnx.Param)
            model = nnx.merge(graphdef, _decoder.unstack_layers(pure))
            cache = _decoder.KVCache(tuple(cache.k), tuple(cache.v))
        graphdef, state = nnx.split(model)
        fn = jax.jit(lambda st, c: nnx.merge(graphdef, st).decode(tok, positions=index[:, None], cache=c,
                                                                   cache_index=index)[0])
        return np.asarray(fn(state, cache), np.float32)

    ref = decode(jnp.float32, "einsum:1")
    for layout in dict.fromkeys("stacked" if lay == "auto" else lay for lay in layouts):
        for v in variants:
            try:
                h = decode(jnp.bfloat16, v, layout)
                out.append({"check": v, "layer_layout": layout,
                            "rel_err": float(np.linalg.norm(h - ref) / np.linalg.norm(ref))})
            except Exception as e:  # noqa: BLE001
                out.append({"check": v, "layer_layout": layout, "error": repr(e)[-1000:]})
    return out


def bench_peer(name, batch, args):
    """The same workload through transformers' generate (torch, CUDA, bf16, sampling at T=1)."""
    try:
        import torch
        import transformers
    except ImportError as e:
        return {"engine": "transformers.generate", "skipped": f"not installed: {e}"}
    if not torch.cuda.is_available():
        return {"engine": "transformers.generate", "skipped": "no CUDA device for torch"}
    cfg = transformers.Qwen2Config(**QWEN25[name], max_position_embeddings=32768, rope_theta=1e6)
    model = transformers.Qwen2ForCausalLM(cfg).to(device="cuda", dtype=torch.bfloat16).eval()
    ids = torch.randint(0, cfg.vocab_size, (batch, args.prompt_len), device="cuda")
    kw = dict(max_new_tokens=args.gen_len, min_new_tokens=args.gen_len, do_sample=True,
              pad_token_id=0, attention_mask=torch.ones_like(ids))
    with torch.inference_mode():
        t0 = time.perf_counter()
        model.generate(ids, **{**kw, "max_new_tokens": 2, "min_new_tokens": 2})
        torch.cuda.synchronize()
        warm = time.perf_counter() - t0
        torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        out = model.generate(ids, **kw)
        torch.cuda.synchronize()
        total = time.perf_counter() - t0
    gen = int((out.shape[1] - args.prompt_len) * batch)
    peak = int(torch.cuda.max_memory_allocated())
    del model, out
    torch.cuda.empty_cache()  # hand the memory back before JAX allocates its pool
    return {"engine": "transformers.generate", "model": f"qwen2.5-{name}", "batch": batch,
            "transformers": transformers.__version__, "torch": torch.__version__,
            "tokens_per_s": gen / total, "total_s": total, "ms_per_step": total / args.gen_len * 1e3,
            "warmup_s": warm, "peak_bytes": peak}


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    report = JsonReport(args.out)
    if args.check:
        for r in check_variants(["einsum:1"] + [v for v in args.variants if v != "einsum:1"],
                                args.layouts):
            report.add(r)
    for name in args.models:
        for batch in args.batches:
            peer = None if args.no_peer else bench_peer(name, batch, args)
            for layout, variant in [(lay, v) for lay in args.layouts for v in args.variants]:
                gc.collect()  # the previous engine (a reference cycle through its jits) and its cache
                try:
                    ours = bench_ours(name, batch, args, variant, layout)
                except Exception as e:  # noqa: BLE001 - a variant that fails to compile is a result
                    if args.tiny:
                        raise
                    ours = {"engine": "jaxrl_llm.rollout", "model": f"qwen2.5-{name}", "batch": batch,
                            "variant": variant, "layer_layout": layout, "error": repr(e)[-2000:]}
                if peer is not None:
                    ours["peer"] = peer
                    if "tokens_per_s" in peer and "tokens_per_s" in ours:
                        ours["speedup_vs_peer"] = ours["tokens_per_s"] / peer["tokens_per_s"]
                report.add(ours)
    return report.records


if __name__ == "__main__":
    main()
