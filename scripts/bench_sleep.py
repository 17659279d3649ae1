"""Device memory a `RolloutServer.sleep()` frees for a colocated trainer, and what `wake()` takes back.

    python scripts/bench_sleep.py                          # Qwen2.5-1.5B shape, 256 slots, bf16
    python scripts/bench_sleep.py --model 0.5b --slots 64 --max-target 2048 --layout stacked
    python scripts/bench_sleep.py --dry-run                # tiny model on CPU in seconds (tests call it)

A random-init model stands for the trainer's weights (stacked, the training layout); an engine is
built from it with `--layout` (per_layer: the engine holds its own relaid-out copy, which sleep
releases; stacked with the same dtype: zero-copy, the weights are shared and stay). `--requests`
requests are submitted and decoded for `--decode-loops` loops, then the server is suspended,
put to sleep, given the weights again (`update_params`, as the trainer does after its step) and
woken; the held requests then finish.

Memory in use is `memory_stats()["bytes_in_use"]` summed over the engine's devices where the
backend reports it (GPU, TPU), else the bytes of live JAX arrays (CPU); `source` says which.
Prints one JSON object: in_use at "suspended", "asleep", "asleep_weights_given" and "awake",
freed_by_sleep = suspended - asleep, the engine's kv_cache_bytes, the bytes sleep() reported, and
the held requests' token counts.
"""
from __future__ import annotations

import argparse
import json
import sys
import threading

import jax
import jax.numpy as jnp
import numpy as np

import rollout
from jaxrl_llm.models import QWEN25_SHAPES, ModelConfig, init_model


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="1.5b", choices=sorted(QWEN25_SHAPES))
    p.add_argument("--slots", type=int, default=256, help="max_concurrent_decodes")
    p.add_argument("--prefill", type=int, default=512, help="max_prefill_length (a prefill bucket)")
    p.add_argument("--max-target", type=int, default=4608, help="max_target_length (KV cache length)")
    p.add_argument("--requests", type=int, default=64, help="requests held over the sleep")
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--max-new", type=int, default=64)
    p.add_argument("--decode-loops", type=int, default=2, help="decode loops before the suspend")
    p.add_argument("--steps-per-sync", type=int, default=8)
    p.add_argument("--layout", default="per_layer", choices=["per_layer", "per_layer_fused", "stacked", "auto"])
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--dry-run", action="store_true", help="tiny model, 4 slots, fp32: a CPU smoke run")
    args = p.parse_args(argv)
    if args.dry_run:
        args.model, args.slots, args.prefill, args.max_target = "tiny", 4, 16, 32
        args.requests, args.prompt_len, args.max_new, args.decode_loops = 3, 5, 12, 1
        args.steps_per_sync, args.dtype = 4, "float32"
    if args.max_new <= args.decode_loops * args.steps_per_sync:
        p.error("--max-new must exceed --decode-loops x --steps-per-sync (requests still running at the sleep)")
    if args.prompt_len + args.max_new > args.max_target:
        p.error(f"--prompt-len + --max-new must fit --max-target={args.max_target}")
    return args


def in_use(devices) -> tuple[int, str]:
    """(bytes in use on `devices`, "memory_stats" | "live_arrays")."""
    stats = [d.memory_stats() or {} for d in devices]
    if all("bytes_in_use" in s for s in stats):
        return sum(int(s["bytes_in_use"]) for s in stats), "memory_stats"
    return sum(x.nbytes for x in jax.live_arrays() if not x.is_deleted()), "live_arrays"


def main(argv=None) -> dict:
    args = parse_args(argv)
    dtype = jnp.dtype(args.dtype)
    config = ModelConfig(model_type="qwen2", attention_bias=True, dtype=dtype, param_dtype=dtype,
                         **QWEN25_SHAPES[args.model])
    model = init_model(config, seed=0)  # the trainer's weights (stacked layout)
    engine = rollout.Engine.from_model(model, max_concurrent_decodes=args.slots,
                                       max_prefill_length=args.prefill, max_target_length=args.max_target,
                                       temperature=1.0, layer_layout=args.layout)
    devices = list(engine.mesh.devices.flat)
    rng = np.random.default_rng(0)
    sampling = rollout.SamplingParams(1.0)
    record: dict = {"model": args.model, "slots": args.slots, "max_target": args.max_target,
                    "layer_layout": engine.layer_layout, "dtype": args.dtype,
                    "kv_cache_bytes": engine.kv_cache_bytes(), "in_use": {}}
    with rollout.RolloutServer(engine, steps_per_sync=args.steps_per_sync) as srv:
        real, calls, reached = engine.decode_loop, [0], threading.Event()

        def decode_loop(*a):  # suspend right after loop `decode_loops` (queued from the scheduler)
            calls[0] += 1
            if calls[0] == args.decode_loops:
                record["_suspend"] = srv.submit_suspend()
                reached.set()
            return real(*a)

        engine.decode_loop = decode_loop
        futures = [srv.submit(f"r{i}", [int(t) for t in rng.integers(1, config.vocab_size, args.prompt_len)],
                              sampling=sampling, max_new_tokens=args.max_new, seed=0, row=i)
                   for i in range(args.requests)]
        reached.wait()
        record.pop("_suspend").result()
        del engine.decode_loop
        record["in_use"]["suspended"], record["source"] = in_use(devices)
        record["sleep"] = srv.sleep()
        record["in_use"]["asleep"] = in_use(devices)[0]
        srv.update_params(model)
        record["in_use"]["asleep_weights_given"] = in_use(devices)[0]
        record["wake"] = srv.wake()
        record["in_use"]["awake"] = in_use(devices)[0]
        outs = [f.result() for f in futures]
    used = record["in_use"]
    record["freed_by_sleep"] = used["suspended"] - used["asleep"]
    record["held_tokens"] = [len(o.token_ids) for o in outs]
    record["finish_reasons"] = sorted({o.finish_reason for o in outs})
    print(json.dumps(record))
    return record


if __name__ == "__main__":
    sys.exit(main() and 0)
