"""Actor-update benchmark: tokens/s and MFU of the GRPO actor update on one or more accelerators.

    python scripts/bench_train.py                                 # 0.5B/1.5B/3B shapes, seq 1024
    python scripts/bench_train.py --models 1.5b --remat none dots --micro 8 16
    python scripts/bench_train.py --models 7b --mesh 1 -1 1       # fsdp over all devices
    python scripts/bench_train.py --models 0.5b --devices 1 --compute-dtype float32   # vs 2 devices:
    python scripts/bench_train.py --models 0.5b --devices 2 --compute-dtype float32   # same loss
    python scripts/bench_train.py --tiny                          # CPU smoke run (tests call it)

`--mesh DATA FSDP TENSOR` shapes the training mesh over the first `--devices` devices (default:
all; -1 fills); the batch is the same whatever the mesh, so `first_pg_loss` / `first_grad_norm`
(the warm-up step, from the same initial weights) must agree across meshes up to reduction order.

Random-init models with Qwen2.5 shapes, fp32 parameters and Adam moments, bf16 compute
(`--param-dtype bfloat16` for bf16 parameters), one `ActorWorker.update` call per timed step:
a mini-batch of `--rows` sequences of `--prompt-len + --response-len` tokens (all real tokens),
gradient accumulation over micro-batches of `--micro` rows (a `lax.scan`), clipped AdamW.

MFU = (6·N + 12·L·heads·head_dim·S) · tokens / (time · peak), with N the parameters that take
part in matmuls (the tied embedding counts once, as the LM head), S the sequence length and peak
989e12 (H100/H200 dense bf16; `--peak-tflops`). Recomputation under remat is not counted.
Each configuration runs in its own process (`--isolate`, default on a GPU) so that peak memory is
that configuration's. Prints one JSON object per line; `--out FILE` also writes them as a list.
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

QWEN25 = {k: QWEN25_SHAPES[k] for k in ("0.5b", "1.5b", "3b", "7b", "tiny")}

def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", nargs="+", default=["0.5b", "1.5b", "3b"], choices=sorted(QWEN25))
    p.add_argument("--remat", nargs="+", default=["dots"],
                   choices=["none", "full", "dots", "dots_no_batch"])
    p.add_argument("--micro", nargs="+", type=int, default=[8], help="micro-batch rows per device")
    p.add_argument("--rows", type=int, default=64, help="sequences per optimizer step")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--response-len", type=int, default=512)
    p.add_argument("--steps", type=int, default=3, help="timed steps after one warm-up step")
    p.add_argument("--param-dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--compute-dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--mesh", nargs=3, type=int, default=[1, -1, 1], metavar=("DATA", "FSDP", "TENSOR"),
                   help="training mesh over the devices used (-1 = fill)")
    p.add_argument("--devices", type=int, default=0, help="use the first N devices (0 = all)")
    p.add_argument("--attention", default="auto", choices=["auto", "xla", "cudnn", "rolled", "splash"],
                   help="ModelConfig.train_attention (auto: cuDNN flash on GPU, splash on TPU)")
    p.add_argument("--trace", default="", help="after timing, trace one more step with jax.profiler "
                   "into this folder (trace_<model>_<remat>_<micro>.json.gz; scripts/trace_summary.py)")
    p.add_argument("--peak-tflops", type=float, default=989.0)
    p.add_argument("--isolate", action=argparse.BooleanOptionalAction, default=None,
                   help="one process per configuration (default: on unless --tiny)")
    p.add_argument("--out", default="", help="also write the results (a JSON list) here")
    p.add_argument("--tiny", "--dry-run", dest="tiny", action="store_true",
                   help="tiny model, 16 rows of 8+8 tokens, fp32, CPU: a smoke run")
    args = p.parse_args(argv)
    if args.tiny:
        args.models, args.rows, args.prompt_len, args.response_len = ["tiny"], 16, 8, 8
        args.micro, args.steps, args.compute_dtype = [8], 1, "float32"
    if args.isolate is None:
        args.isolate = not args.tiny
    return args


def flops_per_token(cfg, n_params: int, seq: int) -> float:
    """verl's count: 6·N (N without the embedding lookup when untied) + 12·L·heads·head_dim·S."""
    n = n_params - (0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_size)
    attn = 12.0 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim * seq
    return 6.0 * n + attn


def _run_config(name: str, remat: str, micro: int, args, cfg=None, moe=None) -> dict:
    """cfg: a ModelConfig to time instead of `name`'s Qwen2.5 shape; moe: the actor's
    `model.moe` router losses (scripts/bench_moe.py)."""
    import jax
    from flax import nnx

    import sharding
    from jaxrl_llm import config as C, metrics as M, models
    from jaxrl_llm.models import _decoder
    from jaxrl_llm.workers import ActorWorker

    if cfg is None:
        shape = QWEN25[name]
        cfg = models.ModelConfig(
            model_type="qwen2", attention_bias=True, rope_theta=1e6, max_position_embeddings=32768,
            head_dim=shape["hidden_size"] // shape["num_attention_heads"],
            dtype=args.compute_dtype, param_dtype="float32" if name == "tiny" else args.param_dtype,
            remat=remat, train_attention=args.attention, **shape)
    devices = jax.devices()[:args.devices] if args.devices > 0 else jax.devices()
    mesh = sharding.make_mesh(sharding.MeshConfig(*args.mesh), devices=devices)
    model = sharding.init_sharded(lambda: models.CausalLM(cfg, rngs=nnx.Rngs(params=0)), mesh,
                                  sharding.TRAIN_RULES)
    n_params = models.count_params(model)
    cd = C.base_config()
    cd.actor.ppo_micro_batch_size_per_device = micro
    cd.actor.optim.lr = 1e-6
    cd.data.builtin_task, cd.model.tokenizer = "arithmetic", "char"  # validation only
    actor_cfg = C.to_run_config(cd).actor
    worker = ActorWorker(model, actor_cfg, mesh=mesh, total_steps=100, temperature=1.0, moe=moe)
    del model

    rng = np.random.default_rng(0)
    rows, p, t = args.rows, args.prompt_len, args.response_len
    ids = rng.integers(0, cfg.vocab_size, (rows, p + t)).astype(np.int32)
    batch = {
        "input_ids": ids, "attention_mask": np.ones((rows, p + t), np.int32),
        "position_ids": np.broadcast_to(np.arange(p + t, dtype=np.int32), (rows, p + t)).copy(),
        "responses": ids[:, p:].copy(), "response_mask": np.ones((rows, t), np.int32),
        "old_log_probs": np.full((rows, t), -np.log(cfg.vocab_size), np.float32),  # ratio ~ 1
        "advantages": rng.standard_normal((rows, t)).astype(np.float32),
    }
    t0 = time.perf_counter()
    first = worker.update(batch, mini_rows=rows, seed=0)  # compiles
    compile_s = time.perf_counter() - t0
    times = []
    for i in range(args.steps):
        t0 = time.perf_counter()
        metrics = worker.update(batch, mini_rows=rows, seed=i + 1)  # ends with a device_get
        times.append(time.perf_counter() - t0)
    step_s = float(np.median(times))
    if args.trace:
        M.perfetto_trace(lambda: worker.update(batch, mini_rows=rows, seed=args.steps + 1),
                         os.path.join(args.trace, f"trace_{name}_{remat}_{micro}.json.gz"))
    tokens = rows * (p + t)
    fpt = flops_per_token(cfg, n_params, p + t)
    ndev = mesh.devices.size
    stats = [d.memory_stats() or {} for d in mesh.devices.flat]
    peaks = [st.get("peak_bytes_in_use") for st in stats]
    return {
        "bench": "train", "model": f"qwen2.5-{name}", "params": n_params, "remat": remat,
        "micro_batch": micro, "rows": rows, "seq_len": p + t, "param_dtype": str(cfg.param_dtype),
        "compute_dtype": str(cfg.dtype), "device": devices[0].device_kind, "num_devices": ndev,
        "mesh": dict(mesh.shape),
        "attention": _decoder._train_attention_impl(cfg),
        "step_s": step_s, "step_s_all": times, "compile_s": compile_s - step_s,
        "tokens_per_s": tokens / step_s, "tokens_per_s_per_device": tokens / step_s / ndev,
        "flops_per_token": fpt,
        "mfu": fpt * tokens / (step_s * ndev * args.peak_tflops * 1e12),
        # peak memory per device: the largest over the mesh (bytes_in_use likewise)
        "peak_bytes": max(peaks) if None not in peaks else None,
        "peak_bytes_per_device": peaks,
        "bytes_in_use": max((st.get("bytes_in_use") or 0) for st in stats) or None,
        "grad_norm": float(metrics["actor/grad_norm"]),
        "first_pg_loss": float(first["actor/pg_loss"]), "first_grad_norm": float(first["actor/grad_norm"]),
        **({"moe_metrics": {k: float(v) for k, v in metrics.items() if "moe" in k}} if cfg.is_moe else {}),
    }


def _run_isolated(name, remat, micro, args) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--one", name, remat, str(micro),
           "--rows", str(args.rows), "--prompt-len", str(args.prompt_len),
           "--response-len", str(args.response_len), "--steps", str(args.steps),
           "--param-dtype", args.param_dtype, "--peak-tflops", str(args.peak_tflops),
           "--compute-dtype", args.compute_dtype, "--devices", str(args.devices),
           "--mesh", *map(str, args.mesh), "--attention", args.attention,
           *(["--trace", args.trace] if args.trace else [])]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        return {"bench": "train", "model": f"qwen2.5-{name}", "remat": remat, "micro_batch": micro,
                "error": proc.stderr[-2000:]}
    return json.loads(lines[-1])


def main(argv=None) -> list[dict]:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--one"]:
        name, remat, micro = argv[1], argv[2], int(argv[3])
        r = _run_config(name, remat, micro, parse_args(argv[4:]))
        print(json.dumps(r), flush=True)
        return [r]
    from jaxrl_llm.metrics import JsonReport

    args = parse_args(argv)
    report = JsonReport(args.out)
    for name in args.models:
        for remat in args.remat:
            for micro in args.micro:
                if args.isolate:
                    r = _run_isolated(name, remat, micro, args)
                else:
                    try:
                        r = _run_config(name, remat, micro, args)
                    except Exception as e:  # noqa: BLE001 - one failed config must not hide the others
                        if args.tiny:
                            raise
                        r = {"bench": "train", "model": f"qwen2.5-{name}", "remat": remat,
                             "micro_batch": micro, "error": repr(e)[-2000:]}
                report.add(r)
    return report.records


if __name__ == "__main__":
    main()
