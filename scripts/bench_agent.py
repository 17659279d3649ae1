"""Agent-style rollout benchmark: multi-turn sessions through `rollout.RolloutServer` vs the batch
`RolloutDriver`, and the prefill work that session prefix reuse saves.

    python scripts/bench_agent.py                         # Qwen2.5-1.5B shape, 64 sessions x 4 turns
    python scripts/bench_agent.py --model 0.5b --sessions 128 --turns 4 --gen-len 128
    python scripts/bench_agent.py --dry-run               # tiny model on CPU in seconds (tests call it)

Workload: `--sessions` concurrent asyncio sessions. Each starts from `--prompt-len` random tokens;
turn t generates exactly `--gen-len` tokens (no stop tokens, temperature 1), then a stub tool
answers with `--tool-len` fixed tokens and the next turn's prompt is the whole conversation.
Modes, each run `--repeats` times (the first run compiles; the fastest later run is reported:
sessions advance independently, so a later run can group arrivals into prefill batches of a
size the earlier runs did not compile):
- server_reuse: RolloutServer with session prefix reuse (turn t > 1 computes only the tool
  tokens and the previous turn's last token);
- server_no_reuse: the same with reuse_prefix=False (every turn prefills the conversation);
- driver: RolloutDriver.generate per turn over all sessions at once (same prompt lengths and
  token counts; a turn waits for the whole batch, and every turn prefills the conversation).
Prints one JSON object per mode (generated tokens/s, wall time, prompt tokens computed and
reused, decode steps) and a summary (server vs driver speed-up, prefill tokens saved).
Random-init models with Qwen2.5 shapes (bf16 on GPU, fp32 for --dry-run).
"""
from __future__ import annotations

import argparse
import asyncio
import gc
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_llm.metrics import JsonReport
from jaxrl_llm.models import QWEN25_SHAPES


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="1.5b", choices=sorted(QWEN25_SHAPES))
    p.add_argument("--sessions", type=int, default=64)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--gen-len", type=int, default=128, help="tokens generated per turn")
    p.add_argument("--tool-len", type=int, default=32, help="tokens the stub tool returns")
    p.add_argument("--slots", type=int, default=0, help="engine slots (0: one per session)")
    p.add_argument("--steps-per-sync", type=int, default=16)
    p.add_argument("--modes", nargs="+", default=["server_reuse", "server_no_reuse", "driver"],
                   choices=["server_reuse", "server_no_reuse", "driver"])
    p.add_argument("--repeats", type=int, default=3, help="runs per mode, the first compiles")
    p.add_argument("--out", default="", help="also write the results (a JSON list) here")
    p.add_argument("--dry-run", action="store_true",
                   help="tiny model, 4 sessions x 3 turns of a few tokens, fp32: a CPU smoke run")
    args = p.parse_args(argv)
    if args.dry_run:
        args.model, args.sessions, args.turns = "tiny", 4, 3
        args.prompt_len, args.gen_len, args.tool_len, args.steps_per_sync = 8, 4, 3, 4
        args.repeats = 2
    for name in ("sessions", "turns", "prompt_len", "gen_len", "repeats"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1")
    return args


def build_engine(args):
    import rollout
    from jaxrl_llm.models import ModelConfig, init_model

    dtype = jnp.float32 if args.dry_run else jnp.bfloat16
    cfg = ModelConfig(model_type="qwen2", attention_bias=True, rope_theta=1e6,
                      max_position_embeddings=32768, dtype=dtype, param_dtype=dtype,
                      **QWEN25_SHAPES[args.model])
    final = args.prompt_len + (args.turns - 1) * (args.gen_len + args.tool_len)
    max_prefill = next(b for b in rollout.PREFILL_BUCKETS if b >= final)  # the driver's limit
    return rollout.Engine.from_model(
        init_model(cfg, seed=0), max_concurrent_decodes=args.slots or args.sessions,
        max_prefill_length=max_prefill, max_target_length=max(max_prefill + 1, final + args.gen_len),
        temperature=1.0, stop_token_ids=(), layer_layout="per_layer")


def workload(args, vocab):
    """First prompts [sessions][prompt_len] and tool replies [sessions][turns - 1][tool_len]."""
    rng = np.random.default_rng(0)
    prompts = rng.integers(0, vocab, (args.sessions, args.prompt_len)).tolist()
    tools = rng.integers(0, vocab, (args.sessions, max(args.turns - 1, 0), args.tool_len)).tolist()
    return prompts, tools


def run_server(engine, args, prompts, tools, reuse: bool) -> dict:
    import rollout

    sp = rollout.SamplingParams(temperature=1.0)

    async def session(srv, i):
        ids = list(prompts[i])
        for t in range(args.turns):
            out = await srv.agenerate(f"s{i}t{t}", ids, sampling=sp, max_new_tokens=args.gen_len,
                                      session_id=f"s{i}", seed=t, row=i)
            ids += out.token_ids + (tools[i][t] if t < args.turns - 1 else [])
        return ids

    async def all_sessions(srv):
        return await asyncio.gather(*(session(srv, i) for i in range(args.sessions)))

    with rollout.RolloutServer(engine, steps_per_sync=args.steps_per_sync, reuse_prefix=reuse) as srv:
        t0 = time.perf_counter()
        asyncio.run(all_sessions(srv))
        wall = time.perf_counter() - t0
        stats = srv.stats
    return {"wall_s": wall, "generated_tokens": stats.get("generated_tokens", 0),
            "prefill_tokens": stats.get("prefill_tokens", 0),
            "reused_tokens": stats.get("reused_tokens", 0),
            "prefill_calls": stats.get("prefill_calls", 0), "append_calls": stats.get("append_calls", 0),
            "decode_steps": stats.get("decode_steps", 0), "evictions": stats.get("evictions", 0)}


def run_driver(engine, args, prompts, tools) -> dict:
    import rollout

    driver = rollout.RolloutDriver(engine, steps_per_sync=args.steps_per_sync,
                                   max_prefill_batch=min(args.sessions, 64))
    sp = rollout.SamplingParams(temperature=1.0)
    convs = [list(p) for p in prompts]
    generated = prefill = steps = 0
    t0 = time.perf_counter()
    for t in range(args.turns):
        prefill += sum(len(c) for c in convs)
        batch = driver.generate(convs, n=1, max_new_tokens=args.gen_len, sampling=sp, seed=t)
        generated += int(batch.response_lengths.sum())
        steps += batch.stats["decode_steps"]
        for i, c in enumerate(convs):
            c += batch.responses[i, :batch.response_lengths[i]].tolist()
            c += tools[i][t] if t < args.turns - 1 else []
    wall = time.perf_counter() - t0
    driver.release()
    return {"wall_s": wall, "generated_tokens": generated, "prefill_tokens": prefill,
            "reused_tokens": 0, "decode_steps": steps}


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    report = JsonReport(args.out)
    engine = build_engine(args)
    prompts, tools = workload(args, engine.config.vocab_size)
    base = {"model": f"qwen2.5-{args.model}", "sessions": args.sessions, "turns": args.turns,
            "prompt_len": args.prompt_len, "gen_len": args.gen_len, "tool_len": args.tool_len,
            "slots": engine.max_concurrent_decodes, "steps_per_sync": args.steps_per_sync,
            "device": str(jax.devices()[0].device_kind)}
    results = {}
    for mode in args.modes:
        def once():
            if mode == "driver":
                return run_driver(engine, args, prompts, tools)
            return run_server(engine, args, prompts, tools, reuse=mode == "server_reuse")

        runs = []
        for _ in range(args.repeats):  # the first run compiles
            gc.collect()
            runs.append(once())
        r = min(runs[1:] or runs, key=lambda x: x["wall_s"])
        r = {"mode": mode, **base, **r, "tokens_per_s": r["generated_tokens"] / r["wall_s"],
             "first_run_wall_s": runs[0]["wall_s"], "run_walls_s": [x["wall_s"] for x in runs]}
        results[mode] = report.add(r)
    summary = {"summary": True, **base}
    if "server_reuse" in results and "driver" in results:
        summary["speedup_server_reuse_vs_driver"] = (results["server_reuse"]["tokens_per_s"]
                                                     / results["driver"]["tokens_per_s"])
    if "server_reuse" in results and "server_no_reuse" in results:
        with_reuse, without = results["server_reuse"], results["server_no_reuse"]
        summary["prefill_tokens_reuse"] = with_reuse["prefill_tokens"]
        summary["prefill_tokens_no_reuse"] = without["prefill_tokens"]
        summary["prefill_tokens_saved_fraction"] = 1 - with_reuse["prefill_tokens"] / without["prefill_tokens"]
        summary["wall_s_reuse"], summary["wall_s_no_reuse"] = with_reuse["wall_s"], without["wall_s"]
    report.add(summary)
    return report.records


if __name__ == "__main__":
    main()
