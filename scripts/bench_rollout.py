"""Rollout decode benchmark: our engine + RL driver vs Hugging Face `generate`, on one GPU.

    python scripts/bench_rollout.py                       # Qwen2.5-0.5B/1.5B shapes, batch 64/256
    python scripts/bench_rollout.py --models 1.5b --batches 256 --gen-len 256 --trace $OUT
    python scripts/bench_rollout.py --models 0.5b --batches 64 --no-peer
    python scripts/bench_rollout.py --tiny                # CPU smoke run in seconds (tests call it)
    python scripts/bench_rollout.py --models 1.5b --batches 256 --variants einsum:1 cudnn:1
    python scripts/bench_rollout.py --models 1.5b --batches 256 --no-peer --layouts stacked per_layer
    python scripts/bench_rollout.py --models 1.5b --batches 64 256 --no-peer --batch-invariant both
    python scripts/bench_rollout.py --models 1.5b --batches 256 --no-peer --quantization none fp8 int8

Random-init bf16 models with Qwen2.5 shapes; every prompt is `--prompt-len` random tokens and
generates exactly the requested number of tokens (no stop tokens), sampling at temperature 1.

What is timed (every call warm: each shape is compiled by an untimed call first):
- `total_s`: one whole `RolloutDriver.generate` call of `--gen-len` tokens (prefill, insert and
  decode); `tokens_per_s` = generated tokens / total_s (whole call).
- `ms_per_step` (decode only) = (T(gen_len) - T(short_len)) / (gen_len - short_len): the
  difference of two whole calls that differ only in the number of decode steps, so prefill,
  insert and per-call host work cancel. `short_len` defaults to just over half of gen_len's
  power-of-two bucket, so both calls share compiled shapes. `decode_context` is the mean context
  of those steps.
- `prefill_s` = T(short_len) - (short_len - 1) * step: prefill + insert of all prompts plus the
  per-call host work (derived, not timed alone).
- `bytes_per_step` = weight bytes + KV bytes read at `decode_context` (the least a step must read);
  `flops_per_step` = 2 * batch * (matmul params) + 4 * batch * context * heads * head_dim * layers;
  `roofline_ms` = max(bytes / `--hbm-gbs`, flops / `--tflops`); `roofline_fraction` =
  roofline_ms / ms_per_step; `hbm_fraction` = bytes / step time / HBM bandwidth.
- The peer (`peer`, one record per `--peer-cache`): transformers `generate` in torch (bf16,
  sampling, `min_new_tokens` = `max_new_tokens`), each length called twice and the second call
  timed; `decode_ms_per_step` from the same two lengths, `total_s` the whole gen_len call.
  `vs_peer[cache]` = {"decode_only": peer decode ms / ours, "whole_call": peer total_s / ours}.
- `--trace DIR`: after timing, traces both calls with `jax.profiler` and reports the difference
  of their device-kernel times per kind and per kernel divided by the step difference
  (`decode_trace`: decode-only kernel ms per step, prefill excluded).

`--quantization none fp8 int8` times the engine once per `rollout.quantization` (the dense
projections' weights; `jaxrl_llm.models._quant`) in the same run: `weight_bytes` is then the
engine's real weight bytes (quantized kernels + scales + bf16 embedding/head/norms), the fp8
record's matmul FLOPs count against `--fp8-tflops` (int8 is weight-only: bf16 compute), and
each quantized record gets `vs_unquantized` = {"decode_only": the `none` record's ms_per_step /
its own, "whole_call": total_s ratio} when `none` ran in the same run with the same model, batch,
layout and variant (list `none` first). `--kv-cache-dtype auto fp8` does the same per
`rollout.kv_cache_dtype` (each format with each cache dtype; `kv_read_bytes` counts the cache's
real itemsize; the baseline of `vs_unquantized` is none with auto). With `--check`, each format's one-token decode is
also compared with the fp32 reference (`check_variants`). Every record has `sync_ms`: the median
of `--sync-repeats` warm `engine.update_params` of the model's bf16 stacked weights (relayout,
plus quantization when on; `sync_bytes_written`, `sync_donated`).

`--variants ATTN:UNROLL ...` times the decode path under each setting of
`ModelConfig.decode_attention` (auto | einsum | reduce | cudnn | pallas | triton) and `.decode_unroll`
(stacked layout only); `--layouts` picks the engine's `layer_layout`. `--batch-invariant on|both`
times the engine with `batch_invariant=True` (rollout.batch_invariant: fixed-row prefill calls, the
trainer's log-softmax; docs/rollout.md), "both" also the fast path, and adds `vs_fast_path` to the
invariant record: its ms_per_step, prefill_s and total_s over the fast path's.
`--invariance-check` instead checks bit-identity on the device: 8 prompts (lengths from half of
`--prompt-len` up to it) decoded one at a time through a `RolloutServer`, then among `batch`
requests submitted at once in a shuffled order, with the engine's batch_invariant off and on;
each record gives `tokens_equal` and `max_abs_logprob_diff` of those 8 (0 and true expected with
it on). Prints one JSON object per line (and `--out` writes the list).
"""
from __future__ import annotations

import argparse
import gc
import os
import sys
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
    p.add_argument("--gen-len", type=int, default=256)
    p.add_argument("--short-len", type=int, default=0, help="the shorter call of the decode-only "
                   "difference (0: just over half of gen-len's power-of-two bucket)")
    p.add_argument("--steps-per-sync", type=int, default=32)
    p.add_argument("--hbm-gbs", type=float, default=4800.0, help="HBM bandwidth, GB/s (H200: 4800)")
    p.add_argument("--tflops", type=float, default=989.0, help="dense bf16 peak, TFLOP/s (H200: 989)")
    p.add_argument("--no-peer", action="store_true", help="skip the transformers generate peer")
    p.add_argument("--peer-only", action="store_true", help="time only the transformers peer")
    p.add_argument("--peer-cache", nargs="+", default=["dynamic", "static"],
                   help="transformers cache_implementation(s) to time (dynamic = the default)")
    p.add_argument("--variants", nargs="+", default=["auto:1"],
                   help="decode settings ATTN:UNROLL to compare (see the module docstring)")
    p.add_argument("--layouts", nargs="+", default=["per_layer"],
                   choices=["per_layer", "per_layer_fused", "stacked", "auto"],
                   help="engine layer_layout(s) to compare (see the module docstring)")
    p.add_argument("--quantization", nargs="+", default=["none"], choices=["none", "fp8", "int8"],
                   help="engine weight format(s) to compare in this run (rollout.quantization)")
    p.add_argument("--kv-cache-dtype", nargs="+", default=["auto"], choices=["auto", "fp8"],
                   help="engine KV cache dtype(s) to compare in this run (rollout.kv_cache_dtype)")
    p.add_argument("--sync-repeats", type=int, default=5,
                   help="time this many weight syncs of the model into the engine (sync_ms: median)")
    p.add_argument("--fp8-tflops", type=float, default=1979.0,
                   help="dense fp8 peak, TFLOP/s (H200: 1979), for the fp8 roofline")
    p.add_argument("--engine-opt", nargs="*", default=[], metavar="KEY=VALUE",
                   help="extra rollout.Engine keyword arguments (ints, floats, true/false, strings)")
    p.add_argument("--decode-xla-option", nargs="*", default=[], metavar="KEY=VALUE",
                   help="XLA options for the engine's decode programs only (decode_compiler_options)")
    p.add_argument("--batch-invariant", default="off", choices=["off", "on", "both"],
                   help="time the engine with batch_invariant=True (on), or with and without (both)")
    p.add_argument("--invariance-check", action="store_true",
                   help="check that 8 requests decode bit-identically alone and among --batches "
                   "others, batch_invariant off and on (see the module docstring); no timing")
    p.add_argument("--out", default="", help="also write the results (a JSON list) here")
    p.add_argument("--trace", default="", help="trace the two timed calls into this folder and "
                   "report decode-only kernel time per step (see the module docstring)")
    p.add_argument("--check", action="store_true", help="first compare each variant's (and each "
                   "--quantization's) one-token decode with an fp32 einsum reference on a small bf16 "
                   "model (relative error)")
    p.add_argument("--tiny", "--dry-run", dest="tiny", action="store_true",
                   help="tiny model, batch 4, 16+8 tokens, fp32, no peer: a CPU smoke run")
    args = p.parse_args(argv)
    if args.tiny:
        args.models, args.batches, args.prompt_len, args.gen_len = ["tiny"], [4], 16, 8
        if args.invariance_check:  # 8 prompts and others
            args.batches = [16]
        args.steps_per_sync, args.no_peer, args.sync_repeats = 4, True, 2
    if not args.short_len:
        bucket = 1 << max(0, max(args.gen_len, 16) - 1).bit_length()  # the driver's output buffer
        args.short_len = bucket // 2 + 1 if args.gen_len > 16 else max(1, args.gen_len // 2)
    if not 1 <= args.short_len < args.gen_len:
        p.error(f"--short-len={args.short_len} must be in [1, gen-len={args.gen_len})")
    return args


def _engine_opts(items) -> dict:
    out = {}
    for item in items:
        key, sep, val = item.partition("=")
        if not sep:
            raise SystemExit(f"--engine-opt takes KEY=VALUE, got {item!r}")
        low = val.lower()
        if low in ("true", "false"):
            out[key] = low == "true"
        else:
            for cast in (int, float):
                try:
                    out[key] = cast(val)
                    break
                except ValueError:
                    pass
            else:
                out[key] = val
    return out


def _config(name, dtype, variant="auto:1"):
    from jaxrl_llm.models import ModelConfig
    attn, unroll = variant.split(":")
    return ModelConfig(model_type="qwen2", attention_bias=True, rope_theta=1e6,
                       max_position_embeddings=32768, dtype=dtype, param_dtype=dtype,
                       decode_attention=attn, decode_unroll=int(unroll), **QWEN25[name])


def _peak_bytes():
    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("peak_bytes_in_use")


def step_cost(c, n_params: int, batch: int, context: float, *, hbm_gbs: float, tflops: float,
              weight_bytes: int | None = None, matmul_tflops: float | None = None,
              kv_itemsize: int | None = None) -> dict:
    """Least bytes and FLOPs of one decode step of `batch` rows at mean `context` cached tokens,
    and the roofline time max(bytes / HBM, FLOPs / peak) in ms. `weight_bytes` (default: n_params
    in param_dtype) and `matmul_tflops` (the weight matmuls' peak, default `tflops`) for a
    quantized engine; `kv_itemsize` (default: c.dtype's) for an fp8 KV cache."""
    itemsize = kv_itemsize or jnp.dtype(c.dtype).itemsize
    if weight_bytes is None:
        weight_bytes = n_params * jnp.dtype(c.param_dtype).itemsize
    kv_bytes = batch * context * 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * itemsize
    # the embedding lookup is a gather, not a matmul; a tied embedding is also the unembed matmul
    matmul_params = n_params - (0 if c.tie_word_embeddings else c.vocab_size * c.hidden_size)
    attn_flops = 4 * batch * context * c.num_attention_heads * c.head_dim * c.num_hidden_layers
    flops = 2 * batch * matmul_params + attn_flops
    bytes_ = weight_bytes + kv_bytes
    mem_ms = bytes_ / (hbm_gbs * 1e9) * 1e3
    flop_ms = (2 * batch * matmul_params / ((matmul_tflops or tflops) * 1e12) + attn_flops / (tflops * 1e12)) * 1e3
    return {"bytes_per_step": int(bytes_), "weight_bytes": int(weight_bytes), "kv_read_bytes": int(kv_bytes),
            "flops_per_step": int(flops), "roofline_ms": max(mem_ms, flop_ms),
            "bound": "memory" if mem_ms >= flop_ms else "compute"}


def _time_sync(engine, model, repeats: int) -> dict:
    """The median of `repeats` warm `engine.update_params(model)` (the model's bf16 stacked
    weights into the engine's layout, quantized when the engine is; compiled by the engine's
    first sync at construction, and the donating variant by an untimed first call here):
    `sync_ms`, and the engine's weight bytes it wrote."""
    engine.update_params(model)
    times, stats = [], {}
    for _ in range(max(1, repeats)):
        t0 = time.perf_counter()
        stats = engine.update_params(model)
        times.append(time.perf_counter() - t0)
    return {"sync_ms": float(np.median(times)) * 1e3, "sync_bytes_written": int(stats["bytes_moved"]),
            "sync_donated": bool(stats["donated"])}


def _trace_diff(paths, steps: int) -> dict:
    """Decode-only kernel time per step: (long trace - short trace) / steps, per kind and kernel."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import trace_summary

    short, long_ = (trace_summary.summarize(trace_summary.load_events(p), top=10**6) for p in paths)
    kinds = {k: (long_["by_kind_ms"].get(k, 0.0) - short["by_kind_ms"].get(k, 0.0)) / steps
             for k in long_["by_kind_ms"]}
    s_names = {k["name"]: k for k in short["top_kernels"]}
    kernels = []
    for k in long_["top_kernels"]:
        s = s_names.get(k["name"], {"ms": 0.0, "calls": 0.0})
        kernels.append({"name": k["name"], "kind": k["kind"], "ms": (k["ms"] - s["ms"]) / steps,
                        "calls": (k["calls"] - s["calls"]) / steps})
    kernels.sort(key=lambda k: -k["ms"])
    return {"kernel_ms": (long_["kernel_ms"] - short["kernel_ms"]) / steps,
            "by_kind_ms": dict(sorted(kinds.items(), key=lambda kv: -kv[1])),
            "top_kernels": kernels[:30], "files": [os.path.basename(p) for p in paths]}


def bench_ours(name, batch, args, variant="auto:1", layout="per_layer", batch_invariant=None,
               quantization="none", cfg=None, kv_cache_dtype="auto"):
    """cfg: a ModelConfig to time instead of `name`'s Qwen2.5 shape (scripts/bench_moe.py)."""
    import rollout
    from jaxrl_llm.models import init_model
    from rollout._engine import PREFILL_BUCKETS

    dtype = jnp.float32 if args.tiny else jnp.bfloat16
    cfg = _config(name, dtype, variant) if cfg is None else cfg
    model = init_model(cfg, seed=0)
    prefill_len = next(b for b in PREFILL_BUCKETS if b >= args.prompt_len)
    opts = _engine_opts(args.engine_opt)
    if args.decode_xla_option:
        opts["decode_compiler_options"] = _engine_opts(args.decode_xla_option)
    if batch_invariant is not None:
        opts["batch_invariant"] = batch_invariant
    engine = rollout.Engine.from_model(
        model, max_concurrent_decodes=batch, max_prefill_length=prefill_len,
        max_target_length=max(prefill_len + 1, args.prompt_len + args.gen_len), temperature=1.0,
        layer_layout=layout, quantization=quantization, kv_cache_dtype=kv_cache_dtype, **opts)
    sync = _time_sync(engine, model, args.sync_repeats)
    del model
    driver = rollout.RolloutDriver(engine, steps_per_sync=args.steps_per_sync,
                                   max_prefill_batch=min(batch, 64))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, cfg.vocab_size, args.prompt_len).tolist() for _ in range(batch)]
    sp = rollout.SamplingParams(temperature=1.0)
    long_, short = args.gen_len, args.short_len

    def run(gen):
        t0 = time.perf_counter()
        out = driver.generate(prompts, n=1, max_new_tokens=gen, sampling=sp, seed=0)
        return time.perf_counter() - t0, out

    first_s, _ = run(long_)  # compiles prefill, insert and the decode loop (short shares shapes)
    run(short)
    short_s, _ = run(short)
    total_s, out = run(long_)
    gen_tokens = int(out.response_lengths.sum())
    step_s = max(total_s - short_s, 1e-9) / (long_ - short)
    c = engine.config
    n_params = sum(x.size for x in jax.tree.leaves(engine.params))
    context = args.prompt_len + (short + long_) / 2  # mean cached tokens over the timed steps
    weight_bytes = sum(x.nbytes for x in jax.tree.leaves(engine.params))
    cost = step_cost(c, n_params, batch, context, hbm_gbs=args.hbm_gbs, tflops=args.tflops,
                     weight_bytes=weight_bytes,
                     matmul_tflops=args.fp8_tflops if quantization == "fp8" else None,
                     kv_itemsize=engine.kv_cache_dtype.itemsize)
    rec = {
        "engine": "jaxrl_llm.rollout", "model": f"qwen2.5-{name}", "batch": batch,
        "decode_attention": cfg.decode_attention, "decode_unroll": cfg.decode_unroll,
        "layer_layout": engine.layer_layout, "quantization": quantization,
        "kv_cache_dtype": kv_cache_dtype, "engine_opts": opts,
        "batch_invariant": engine.batch_invariant,
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "prompt_len": args.prompt_len, "gen_len": long_, "short_len": short, "dtype": str(jnp.dtype(dtype)),
        "device": str(jax.devices()[0].device_kind), "generated_tokens": gen_tokens,
        "ms_per_step": step_s * 1e3, "decode_tokens_per_s": batch / step_s,
        "decode_context": context, "prefill_s": max(short_s - (short - 1) * step_s, 0.0),
        "total_s": total_s, "short_s": short_s, "tokens_per_s": gen_tokens / total_s,
        "compile_s": first_s - total_s, **cost,
        "roofline_fraction": cost["roofline_ms"] / (step_s * 1e3),
        "hbm_fraction": cost["bytes_per_step"] / step_s / (args.hbm_gbs * 1e9),
        "kv_cache_bytes": int(engine.kv_cache_bytes()), "peak_bytes": _peak_bytes(),
        "decode_loops": out.stats["decode_loops"], "steps_per_sync": args.steps_per_sync, **sync,
    }
    if args.trace:
        tag = f"{engine.layer_layout}_{variant.replace(':', '_')}_{quantization}_kv{kv_cache_dtype}_b{batch}"
        paths = [os.path.join(args.trace, f"trace_{tag}_{n}.json.gz") for n in (short, long_)]
        for gen, path in zip((short, long_), paths):
            perfetto_trace(lambda gen=gen: run(gen), path)
        try:
            rec["decode_trace"] = _trace_diff(paths, long_ - short)
        except ValueError as e:  # e.g. no device track (a CPU run)
            rec["decode_trace"] = {"error": str(e)}
    return rec


def check_invariance(name, batch, args, batch_invariant: bool, layout="per_layer") -> dict:
    """8 prompts alone vs among `batch` shuffled requests through a RolloutServer (sampled at
    temperature 1, each request its own (seed, row) stream): are their tokens and log-probs equal?"""
    import rollout
    from jaxrl_llm.models import init_model
    from rollout._engine import PREFILL_BUCKETS

    if batch < 9:
        raise SystemExit(f"--invariance-check needs a batch of at least 9 (8 prompts and others), got {batch}")
    cfg = _config(name, jnp.float32 if args.tiny else jnp.bfloat16)
    prefill_len = next(b for b in PREFILL_BUCKETS if b >= args.prompt_len)
    engine = rollout.Engine.from_model(
        init_model(cfg, seed=0), max_concurrent_decodes=batch, max_prefill_length=prefill_len,
        max_target_length=prefill_len + args.gen_len, temperature=1.0, layer_layout=layout,
        batch_invariant=batch_invariant)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, cfg.vocab_size, int(rng.integers(args.prompt_len // 2, args.prompt_len + 1))).tolist()
               for _ in range(batch)]
    kw = dict(sampling=rollout.SamplingParams(1.0), max_new_tokens=args.gen_len, seed=0)
    with rollout.RolloutServer(engine, steps_per_sync=args.steps_per_sync) as srv:
        alone = [srv.generate(f"a{r}", prompts[r], row=r, **kw) for r in range(8)]
        futures = {r: srv.submit(f"b{r}", prompts[r], row=r, **kw) for r in rng.permutation(batch).tolist()}
        crowd = [futures[r].result() for r in range(8)]
    diff = max(float(np.max(np.abs(np.asarray(a.log_probs) - np.asarray(c.log_probs)), initial=0.0))
               if a.token_ids == c.token_ids else float("inf") for a, c in zip(alone, crowd))
    return {"check": "batch_invariance", "model": f"qwen2.5-{name}", "batch": batch,
            "layer_layout": engine.layer_layout, "batch_invariant": batch_invariant,
            "dtype": str(jnp.dtype(cfg.dtype)), "device": jax.devices()[0].device_kind,
            "tokens_equal": all(a.token_ids == c.token_ids for a, c in zip(alone, crowd)),
            "max_abs_logprob_diff": diff, "tokens_checked": sum(len(a.token_ids) for a in alone)}


def check_variants(variants, layouts=("stacked",), quantizations=("none",)) -> list[dict]:
    """Relative error of each (layout, variant, quantization)'s one-token decode vs an fp32
    stacked einsum reference (bf16 model, head_dim 128, GQA 4:1, rows at different cache
    offsets); a quantized check runs the weights the engine's sync would make
    (`_quant.quantize_params`), so on a GPU it checks the FP8 GEMM's numbers."""
    from jaxrl_llm.models import ModelConfig, _decoder, _quant, init_model
    from flax import nnx
    out = []
    base = dict(vocab_size=1024, hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=1, model_type="qwen2", attention_bias=True)
    rng = np.random.default_rng(1)
    b, s = 8, 256
    ids = jnp.asarray(rng.integers(0, 1024, (b, 100)), jnp.int32)
    index = jnp.asarray(rng.integers(1, 100, b), jnp.int32)
    tok = jnp.asarray(rng.integers(0, 1024, (b, 1)), jnp.int32)

    def decode(dtype, variant, layout="stacked", quant="none"):
        attn, unroll = variant.split(":")
        config = ModelConfig(**base, dtype=dtype, param_dtype=dtype, decode_attention=attn,
                             decode_unroll=int(unroll))
        model = init_model(config, seed=0)
        _, pre = model.prefill(ids)
        pad = [(0, 0), (0, 0), (0, s - 100), (0, 0), (0, 0)]
        cache = _decoder.KVCache(jnp.pad(pre.k, pad), jnp.pad(pre.v, pad))
        if layout == "per_layer" or quant != "none":
            pure = nnx.to_pure_dict(nnx.state(model, nnx.Param))
            pure = _decoder.unstack_layers(pure) if layout == "per_layer" else pure
            pure = pure if quant == "none" else _quant.quantize_params(pure, quant)
            graphdef, _ = nnx.split(_decoder.abstract_model(config.replace(quantization=quant), layer_layout=layout),
                                    nnx.Param)
            model = nnx.merge(graphdef, pure)
        if layout == "per_layer":
            cache = _decoder.KVCache(tuple(cache.k), tuple(cache.v))
        graphdef, state = nnx.split(model)
        fn = jax.jit(lambda st, c: nnx.merge(graphdef, st).decode(tok, positions=index[:, None], cache=c,
                                                                   cache_index=index)[0])
        return np.asarray(fn(state, cache), np.float32)

    ref = decode(jnp.float32, "einsum:1")
    for layout in dict.fromkeys("stacked" if lay == "auto" else lay for lay in layouts):
        for v in variants:
            for quant in quantizations:
                rec = {"check": v, "layer_layout": layout, "quantization": quant}
                try:
                    h = decode(jnp.bfloat16, v, layout, quant)
                    out.append({**rec, "rel_err": float(np.linalg.norm(h - ref) / np.linalg.norm(ref))})
                except Exception as e:  # noqa: BLE001
                    out.append({**rec, "error": repr(e)[-1000:]})
    return out


def bench_peer(name, batch, args) -> list[dict]:
    """The same workload through transformers' generate (torch, CUDA, bf16, sampling at T=1), one
    record per cache implementation, timed warm (see the module docstring)."""
    try:
        import torch
        import transformers
    except ImportError as e:
        return [{"engine": "transformers.generate", "skipped": f"not installed: {e}"}]
    if not torch.cuda.is_available():
        return [{"engine": "transformers.generate", "skipped": "no CUDA device for torch"}]
    cfg = transformers.Qwen2Config(**QWEN25[name], max_position_embeddings=32768, rope_theta=1e6)
    model = transformers.Qwen2ForCausalLM(cfg).to(device="cuda", dtype=torch.bfloat16).eval()
    ids = torch.randint(0, cfg.vocab_size, (batch, args.prompt_len), device="cuda")
    long_, short = args.gen_len, args.short_len
    records = []
    for cache in args.peer_cache:
        kw = dict(do_sample=True, pad_token_id=0, attention_mask=torch.ones_like(ids))
        if cache != "dynamic":
            kw["cache_implementation"] = cache

        def call(n):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, **kw)
            torch.cuda.synchronize()
            return time.perf_counter() - t0, out

        rec = {"engine": "transformers.generate", "cache_implementation": cache,
               "model": f"qwen2.5-{name}", "batch": batch, "transformers": transformers.__version__,
               "torch": torch.__version__, "gen_len": long_, "short_len": short}
        try:
            with torch.inference_mode():
                torch.cuda.reset_peak_memory_stats()
                warm_s = call(short)[0] + call(long_)[0]  # compiles / allocates: untimed
                short_s, _ = call(short)
                total_s, out = call(long_)
            gen = int((out.shape[1] - args.prompt_len) * batch)
            step = (total_s - short_s) / (long_ - short)
            rec.update({"decode_ms_per_step": step * 1e3, "total_s": total_s, "short_s": short_s,
                        "tokens_per_s": gen / total_s, "generated_tokens": gen,
                        "prefill_s": max(short_s - (short - 1) * step, 0.0), "warmup_s": warm_s,
                        "peak_bytes": int(torch.cuda.max_memory_allocated())})
            del out
        except Exception as e:  # noqa: BLE001 - a peer setting that fails is a result
            rec["error"] = repr(e)[-1000:]
        records.append(rec)
    del model
    torch.cuda.empty_cache()  # hand the memory back before JAX allocates its pool
    return records


def compare(ours: dict, peers: list[dict]) -> dict:
    """Like-for-like ratios (peer time / ours): decode-only ms per step, and whole gen_len call."""
    out = {}
    for p in peers:
        if "decode_ms_per_step" in p and "ms_per_step" in ours:
            out[p["cache_implementation"]] = {
                "decode_only": p["decode_ms_per_step"] / ours["ms_per_step"],
                "whole_call": p["total_s"] / ours["total_s"]}
    return out


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    report = JsonReport(args.out)
    if args.check:
        for r in check_variants(["einsum:1"] + [v for v in args.variants if v != "einsum:1"],
                                args.layouts, args.quantization):
            report.add(r)
    if args.invariance_check:
        for name in args.models:
            for batch in args.batches:
                for layout in args.layouts:
                    for inv in (False, True):
                        gc.collect()
                        report.add(check_invariance(name, batch, args, inv, layout))
        return report.records
    for name in args.models:
        for batch in args.batches:
            peers = [] if args.no_peer else bench_peer(name, batch, args)
            for p in peers:
                report.add(p)
            invariant = {"off": [None], "on": [True], "both": [False, True]}[args.batch_invariant]
            unquantized = {}
            for layout, variant, quant, kv in [] if args.peer_only else [
                    (lay, v, q, k) for lay in args.layouts for v in args.variants for q in args.quantization
                    for k in args.kv_cache_dtype]:
                fast = None
                for inv in invariant:
                    gc.collect()  # the previous engine (a reference cycle through its jits) and its cache
                    try:
                        ours = bench_ours(name, batch, args, variant, layout, inv, quant, kv_cache_dtype=kv)
                    except Exception as e:  # noqa: BLE001 - a variant that fails to compile is a result
                        if args.tiny:
                            raise
                        ours = {"engine": "jaxrl_llm.rollout", "model": f"qwen2.5-{name}", "batch": batch,
                                "variant": variant, "layer_layout": layout, "batch_invariant": bool(inv),
                                "quantization": quant, "kv_cache_dtype": kv, "error": repr(e)[-2000:]}
                    if inv is False and "error" not in ours:
                        fast = ours
                    elif inv and fast is not None and "error" not in ours:
                        ours["vs_fast_path"] = {k: ours[k] / fast[k] for k in ("ms_per_step", "prefill_s", "total_s")
                                                if fast.get(k)}
                    if peers:
                        ours["vs_peer"] = compare(ours, peers)
                    if quant == "none" and kv == "auto":
                        unquantized[(layout, variant, inv)] = ours
                    elif "ms_per_step" in ours and "ms_per_step" in unquantized.get((layout, variant, inv), {}):
                        base = unquantized[(layout, variant, inv)]
                        ours["vs_unquantized"] = {"decode_only": base["ms_per_step"] / ours["ms_per_step"],
                                                  "whole_call": base["total_s"] / ours["total_s"]}
                    report.add(ours)
    return report.records


if __name__ == "__main__":
    main()
