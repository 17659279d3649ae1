"""LoRA vs full fine-tuning: peak memory, step time and weight-sync time of a GRPO actor step.

    python scripts/bench_lora.py                                  # 1.5B and 7B, rank 0 (full) / 16 / 64
    python scripts/bench_lora.py --models 7b --ranks 0 16         # one model, some ranks
    python scripts/bench_lora.py --tiny                           # CPU smoke run (tests call it)

Rank 0 is full fine-tuning; other ranks put adapters on every linear projection of the decoder
layers (`all-linear`, alpha = 2 * rank). Random-init models with Qwen2.5 shapes, fp32 parameters
(base and adapters) and fp32 AdamW moments, bf16 compute, one `ActorWorker.update` per timed
step over `--rows` sequences of `--prompt-len + --response-len` real tokens, micro-batches of
`--micro` rows, remat `--remat`. Each configuration runs in its own process (`--isolate`, default
on a GPU), so `peak_bytes` (the device's `peak_bytes_in_use`) is that configuration's; one that
runs out of memory is reported with `"oom": true` and the error. `sync_s` is the weight sync's
on-device part: the bf16 cast of the weights (full) or the fused merge W + (α/r)·A·B with the
cast (LoRA), to the same shardings, timed after a warm-up call. Prints one JSON object per line
(flushed as each configuration finishes); `--out FILE` also writes them as a list.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

from jaxrl_llm.models import QWEN25_SHAPES


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", nargs="+", default=["1.5b", "7b"], choices=sorted(QWEN25_SHAPES))
    p.add_argument("--ranks", nargs="+", type=int, default=[0, 16, 64], help="0 = full fine-tuning")
    p.add_argument("--rows", type=int, default=16, help="sequences per optimizer step")
    p.add_argument("--micro", type=int, default=8, help="micro-batch rows per device")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--response-len", type=int, default=512)
    p.add_argument("--remat", default="dots", choices=["none", "full", "dots", "dots_no_batch"])
    p.add_argument("--steps", type=int, default=2, help="timed steps after one warm-up step")
    p.add_argument("--isolate", action=argparse.BooleanOptionalAction, default=None,
                   help="one process per configuration (default: on unless --tiny)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per isolated configuration")
    p.add_argument("--out", default="", help="also write the results (a JSON list) here")
    p.add_argument("--tiny", "--dry-run", dest="tiny", action="store_true",
                   help="tiny model, 16 rows of 8+8 tokens, fp32 compute, ranks 0 and 4: a smoke run")
    args = p.parse_args(argv)
    if args.tiny:
        args.models, args.rows, args.prompt_len, args.response_len = ["tiny"], 16, 8, 8
        args.micro, args.steps, args.ranks, args.remat = 8, 1, [0, 4], "none"
    if args.isolate is None:
        args.isolate = not args.tiny
    return args


def _run_config(name: str, rank: int, args) -> dict:
    import dataclasses

    import jax
    import jax.numpy as jnp
    from flax import nnx

    import sharding
    from jaxrl_llm import config as C, models
    from jaxrl_llm.workers import ActorWorker

    tiny = name == "tiny"
    shape = QWEN25_SHAPES[name]
    cfg = models.ModelConfig(
        model_type="qwen2", attention_bias=True, rope_theta=1e6, max_position_embeddings=32768,
        head_dim=shape["hidden_size"] // shape["num_attention_heads"],
        dtype="float32" if tiny else "bfloat16", param_dtype="float32", remat=args.remat, **shape)
    mesh = sharding.make_mesh(sharding.MeshConfig(1, 1, 1), devices=jax.devices()[:1])
    model = sharding.init_sharded(lambda: models.CausalLM(cfg, rngs=nnx.Rngs(params=0)), mesh,
                                  sharding.TRAIN_RULES)
    n_params = models.count_params(model)
    cd = C.base_config()
    cd.actor.ppo_micro_batch_size_per_device = args.micro
    cd.actor.optim.lr = 1e-6
    cd.actor.lora.rank, cd.actor.lora.alpha = rank, 2.0 * max(rank, 1)
    cd.data.builtin_task, cd.model.tokenizer = "arithmetic", "char"  # validation only
    actor_cfg = C.to_run_config(cd).actor
    if rank:
        lora = actor_cfg.lora
        models.add_lora(model, models.LoraSpec(lora.rank, lora.alpha, lora.target_modules), mesh=mesh)
    worker = ActorWorker(model, actor_cfg, mesh=mesh, total_steps=100, temperature=1.0)
    del model
    trainable = models.count_params(worker.state.params)
    opt_bytes = int(sum(x.nbytes for x in jax.tree.leaves(worker.state.opt_state)))

    rng = np.random.default_rng(0)
    rows, p, t = args.rows, args.prompt_len, args.response_len
    ids = rng.integers(0, cfg.vocab_size, (rows, p + t)).astype(np.int32)
    batch = {
        "input_ids": ids, "attention_mask": np.ones((rows, p + t), np.int32),
        "position_ids": np.broadcast_to(np.arange(p + t, dtype=np.int32), (rows, p + t)).copy(),
        "responses": ids[:, p:].copy(), "response_mask": np.ones((rows, t), np.int32),
        "old_log_probs": np.full((rows, t), -np.log(cfg.vocab_size), np.float32),
        "advantages": rng.standard_normal((rows, t)).astype(np.float32),
    }
    t0 = time.perf_counter()
    first = worker.update(batch, mini_rows=rows, seed=0)  # compiles
    compile_s = time.perf_counter() - t0
    times = []
    for i in range(args.steps):
        t0 = time.perf_counter()
        worker.update(batch, mini_rows=rows, seed=i + 1)  # ends with a device_get
        times.append(time.perf_counter() - t0)

    if rank:
        def sync():
            return worker.rollout_params(jnp.bfloat16)
    else:
        shardings = jax.tree.map(lambda x: x.sharding, worker.state.params)

        def sync():
            return sharding.reshard(worker.state.params, shardings, dtype=jnp.bfloat16)
    jax.block_until_ready(sync())  # warm-up (compiles)
    t0 = time.perf_counter()
    synced = jax.block_until_ready(sync())
    sync_s = time.perf_counter() - t0
    del synced
    stats = jax.devices()[0].memory_stats() or {}
    return {
        "bench": "lora", "model": f"qwen2.5-{name}", "params": n_params, "lora_rank": rank,
        "trainable_params": trainable, "opt_state_bytes": opt_bytes,
        "rows": rows, "seq_len": p + t, "micro_batch": args.micro, "remat": args.remat,
        "param_dtype": "float32", "compute_dtype": jnp.dtype(cfg.dtype).name,
        "device": jax.devices()[0].device_kind, "step_s": float(np.median(times)),
        "step_s_all": times, "compile_s": compile_s - float(np.median(times)),
        "tokens_per_s": rows * (p + t) / float(np.median(times)), "sync_s": sync_s,
        "peak_bytes": stats.get("peak_bytes_in_use"), "oom": False,
        "first_pg_loss": float(first["actor/pg_loss"]),
    }


def _failed(name, rank, error: str) -> dict:
    oom = any(s in error for s in ("RESOURCE_EXHAUSTED", "Out of memory", "out of memory", "OOM"))
    return {"bench": "lora", "model": f"qwen2.5-{name}", "lora_rank": rank, "oom": oom,
            "error": error[-1500:]}


def _run_isolated(name, rank, args) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--one", name, str(rank),
           "--rows", str(args.rows), "--micro", str(args.micro), "--prompt-len", str(args.prompt_len),
           "--response-len", str(args.response_len), "--remat", args.remat, "--steps", str(args.steps)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return _failed(name, rank, f"timed out after {args.timeout} s")
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        return _failed(name, rank, proc.stderr)
    return json.loads(lines[-1])


def main(argv=None) -> list[dict]:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--one"]:
        r = _run_config(argv[1], int(argv[2]), parse_args(argv[3:]))
        print(json.dumps(r), flush=True)
        return [r]
    from jaxrl_llm.metrics import JsonReport

    args = parse_args(argv)
    report = JsonReport(args.out)
    for name in args.models:
        for rank in args.ranks:
            if args.isolate:
                r = _run_isolated(name, rank, args)
            else:
                try:
                    r = _run_config(name, rank, args)
                except Exception as e:  # noqa: BLE001 - one failed config must not hide the others
                    if args.tiny:
                        raise
                    r = _failed(name, rank, repr(e))
            report.add(r)
    return report.records


if __name__ == "__main__":
    main()
