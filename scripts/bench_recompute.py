"""What a `partial_rollout_kv="recompute"` weight sync costs: re-prefilling the KV of held requests.

    python scripts/bench_recompute.py                   # Qwen2.5-1.5B shape, 128 held requests, bf16
    python scripts/bench_recompute.py --max-tokens 32768 --paths whole --repeats 5
    python scripts/bench_recompute.py --dry-run         # tiny model on CPU in seconds (tests call it)

A random-init model with Qwen2.5 shapes; the engine is sized like the async trainer's (`--prefill`
= max_prefill_length, the bucket of data.max_prompt_length, 16 in scripts/bench_modes.py;
`--max-target` = prefill + max_response_length). `--held` requests are submitted with kept
prefixes of long-tailed lengths (lognormal: median `--median`, log-std `--sigma`, capped at
`--cap`; each prompt is its prefix less the tokens decoded before the hold), decoded for one loop
of `--steps-per-sync` steps and held (`suspend`). Then, for each of `--paths`, `--repeats`
times: a weight sync (`update_params`, which marks every held request's KV stale) and the
recompute of their KV, timed from idle device to `block_until_ready` of the decode state (host
work included). The first repeat compiles (`first_s`); `seconds` is the fastest of the others
(the first when it is the only one). Paths: "whole" is the server's recompute (each prefix
prefilled whole, `refill_plan`'s calls); "admission" sends the same prefixes through the
admission path, as the recompute did before (a max_prefill_length prefill, then append chunks of
at most max_prefill_length tokens). `speedup` = admission seconds / whole seconds.

The recompute runs on the server's private methods while the server is suspended (its scheduler
thread waits and touches nothing), so every repeat rebuilds the same prefixes; in training it
runs on the scheduler thread when the server resumes or wakes.

Counted by wrapping the engine's `prefill_batch` and `append_rows`: `calls` (prefill + append),
`padded_tokens` (rows x bucket of every call, the padding included: what the device computes)
and the calls' shapes ("kind rows x bucket": how many programs compile); `tokens` are the
prefixes' real tokens; `prefill_calls` / `append_calls` are the server's counters' deltas.
`tokens_per_s` = tokens / seconds; `peak_bytes` the devices' peak memory in use over the whole
run where the backend reports it (GPU), else null. Prints one JSON object, a path's figures
under "paths" (each repeat's under its "repeats").
"""
from __future__ import annotations

import argparse
import collections
import json
import math
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np

import rollout
from jaxrl_llm.models import QWEN25_SHAPES, ModelConfig, init_model
from rollout._server import _gather_rows


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="1.5b", choices=sorted(QWEN25_SHAPES))
    p.add_argument("--slots", type=int, default=128, help="max_concurrent_decodes")
    p.add_argument("--held", type=int, default=128, help="requests held over the sync")
    p.add_argument("--prefill", type=int, default=16, help="max_prefill_length (a prefill bucket)")
    p.add_argument("--max-target", type=int, default=16 + 4096, help="max_target_length (KV cache length)")
    p.add_argument("--median", type=float, default=600.0, help="median kept prefix, tokens")
    p.add_argument("--sigma", type=float, default=0.6, help="log-std of the kept prefix length")
    p.add_argument("--cap", type=int, default=3000, help="longest kept prefix")
    p.add_argument("--steps-per-sync", type=int, default=4, help="decode steps before the hold")
    p.add_argument("--repeats", type=int, default=3, help="syncs + recomputes (the first compiles)")
    p.add_argument("--max-tokens", type=int, default=None,
                   help="RolloutServer(recompute_tokens=...): padded tokens per whole-prefix "
                        "recompute call (default: the server's)")
    p.add_argument("--paths", nargs="+", default=list(RECOMPUTES), choices=list(RECOMPUTES),
                   help="whole: the server's recompute (whole prefixes); admission: the same "
                        "prefixes through the admission path (the recompute before it)")
    p.add_argument("--layout", default="per_layer_fused",
                   choices=["per_layer", "per_layer_fused", "stacked", "auto"])
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--dry-run", action="store_true", help="tiny model, 8 slots, fp32: a CPU smoke run")
    args = p.parse_args(argv)
    if args.dry_run:
        args.model, args.slots, args.held, args.prefill, args.max_target = "tiny", 8, 8, 16, 256
        args.median, args.sigma, args.cap, args.repeats = 60.0, 0.6, 200, 2
        args.layout, args.dtype = "per_layer", "float32"
    if args.held > args.slots:
        p.error("--held must be <= --slots (every held request needs a slot)")
    if args.cap + 1 > args.max_target:
        p.error("--cap must leave room for one more token under --max-target")
    if args.steps_per_sync + 1 > args.cap:
        p.error("--cap must exceed --steps-per-sync")
    return args


def prefix_lengths(args) -> list[int]:
    rng = np.random.default_rng(0)
    raw = rng.lognormal(math.log(args.median), args.sigma, args.held)
    lo = args.steps_per_sync + 1  # a prompt of at least one token
    return [int(min(args.cap, max(lo, round(x)))) for x in raw]


class CallCounter:
    """Wraps engine.prefill_batch / append_rows (instance attributes) to count calls and tokens."""

    def __init__(self, engine):
        self.engine, self.on = engine, False
        self.reset()
        for name in ("prefill_batch", "append_rows"):
            setattr(engine, name, self._wrap(name, getattr(engine, name)))

    def reset(self):
        self.calls, self.padded = 0, 0
        self.shapes = collections.Counter()

    def _wrap(self, name, real):
        def call(*a, **kw):
            if self.on:
                tokens = kw["tokens"] if name == "append_rows" else a[1]
                self.calls += 1
                self.padded += int(np.prod(np.shape(tokens)))
                self.shapes[f"{name.split('_')[0]} {np.shape(tokens)[0]}x{np.shape(tokens)[1]}"] += 1
            return real(*a, **kw)
        return call


def peak_bytes(devices) -> int | None:
    stats = [d.memory_stats() or {} for d in devices]
    if all("peak_bytes_in_use" in s for s in stats):
        return sum(int(s["peak_bytes_in_use"]) for s in stats)
    return None


def hold_requests(srv, engine, args, vocab) -> list:
    """Submits the held requests and suspends the server right after its first decode loop."""
    real, reached, held = engine.decode_loop, threading.Event(), {}

    def decode_loop(*a):
        if not reached.is_set():
            held["f"] = srv.submit_suspend()
            reached.set()
        return real(*a)

    engine.decode_loop = decode_loop
    rng = np.random.default_rng(1)
    sampling = rollout.SamplingParams(1.0)
    futures = []
    for i, n in enumerate(prefix_lengths(args)):
        prompt = [int(t) for t in rng.integers(1, vocab, n - args.steps_per_sync)]
        futures.append(srv.submit(f"r{i}", prompt, sampling=sampling,
                                  max_new_tokens=args.max_target - len(prompt), seed=0, row=i))
    reached.wait()
    held["f"].result()
    del engine.decode_loop
    return futures


def admission_recompute(srv) -> dict:
    """The recompute as it was before the whole-prefix path, for comparison: the same kept
    prefixes through the admission path (`_fill`: a max_prefill_length prefill, then appends of
    at most max_prefill_length tokens, grouped by bucket, at most max_prefill_batch rows a call)."""
    slots, srv._stale = sorted(srv._stale & set(srv._running)), set()
    idx = np.full(max(4, 1 << (len(slots) - 1).bit_length()), srv._slots, np.int32)
    idx[:len(slots)] = slots
    tokens, _ = jax.device_get(_gather_rows(srv._out["tokens"], srv._out["log_probs"], jnp.asarray(idx)))
    reqs = []
    for j, slot in enumerate(slots):
        req = srv._running[slot]
        req.fill = req.prompt + [int(t) for t in tokens[j, req.offset:srv._generated[slot]]]
        reqs.append(req)
    srv._fill(reqs, [])
    srv._state = srv.engine.set_generated(srv._state, np.asarray(slots), srv._generated[slots])
    return {"recomputed_requests": len(reqs), "recomputed_tokens": sum(len(r.fill) for r in reqs)}


RECOMPUTES = {"whole": lambda srv: srv._recompute(), "admission": admission_recompute}


def measure(srv, engine, counter, recompute, repeats: int) -> dict:
    """`repeats` x (a sync, then `recompute(srv)` timed); the figures of the last, the time of the
    fastest after the first (which compiles)."""
    runs = []
    for _ in range(repeats):
        srv.update_params(engine.params)  # a sync: every held request's KV is stale
        before = srv.stats
        jax.block_until_ready(srv._state)
        counter.reset()
        counter.on = True
        t0 = time.perf_counter()
        out = recompute(srv)  # the server is suspended: its thread waits (see the docstring)
        jax.block_until_ready(srv._state)
        seconds = time.perf_counter() - t0
        counter.on = False
        after = srv.stats
        runs.append({"seconds": seconds, "calls": counter.calls, "padded_tokens": counter.padded,
                     "tokens": out["recomputed_tokens"], "recomputed_requests": out["recomputed_requests"],
                     "prefill_calls": after.get("prefill_calls", 0) - before.get("prefill_calls", 0),
                     "append_calls": after.get("append_calls", 0) - before.get("append_calls", 0),
                     "shapes": dict(sorted(counter.shapes.items()))})
    seconds = min(r["seconds"] for r in runs[1:] or runs)
    last = runs[-1]
    return {**{k: v for k, v in last.items() if k != "seconds"}, "seconds": seconds,
            "tokens_per_s": last["tokens"] / seconds,
            "padding_fraction": 1 - last["tokens"] / last["padded_tokens"],
            "first_s": runs[0]["seconds"], "repeats": runs}


def main(argv=None) -> dict:
    args = parse_args(argv)
    dtype = jnp.dtype(args.dtype)
    config = ModelConfig(model_type="qwen2", attention_bias=True, rope_theta=1e6, dtype=dtype,
                         param_dtype=dtype, **QWEN25_SHAPES[args.model])
    model = init_model(config, seed=0)
    engine = rollout.Engine.from_model(model, max_concurrent_decodes=args.slots,
                                       max_prefill_length=args.prefill, max_target_length=args.max_target,
                                       temperature=1.0, stop_token_ids=(), layer_layout=args.layout)
    devices = list(engine.mesh.devices.flat)
    kwargs = dict(steps_per_sync=args.steps_per_sync, partial_rollout_kv="recompute")
    if args.max_tokens is not None:
        kwargs["recompute_tokens"] = args.max_tokens
    counter = CallCounter(engine)
    lengths = prefix_lengths(args)
    record = {"model": args.model, "platform": devices[0].platform, "layer_layout": engine.layer_layout,
              "dtype": args.dtype, "slots": args.slots, "held": args.held,
              "max_prefill_length": args.prefill, "max_target_length": args.max_target,
              "prefix_tokens": sum(lengths), "prefix_max": max(lengths),
              "prefix_median": int(np.median(lengths)), "paths": {}}
    with rollout.RolloutServer(engine, **kwargs) as srv:
        futures = hold_requests(srv, engine, args, config.vocab_size)
        record["recompute_tokens"] = srv.recompute_tokens
        for path in args.paths:
            record["paths"][path] = measure(srv, engine, counter, RECOMPUTES[path], args.repeats)
    for f in futures:
        f.result()  # aborted by close()
    paths = record["paths"]
    if {"whole", "admission"} <= set(paths):
        record["speedup"] = paths["admission"]["seconds"] / paths["whole"]["seconds"]
    record["peak_bytes"] = peak_bytes(devices)
    print(json.dumps(record))
    return record


if __name__ == "__main__":
    sys.exit(main() and 0)
