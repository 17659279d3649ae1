"""Replicas on the same device(s): one RolloutServer with S decode slots vs N replicas with S/N slots
each behind a `rollout.ReplicaRouter`, on the same multi-turn agent workload (issue 30).

    python scripts/bench_replicas.py --out r.json        # 1.5B shape, 64 sessions x 4 turns, 64 slots, N=2,4,1
    python scripts/bench_replicas.py --slots 32 --replicas 2   # more sessions than slots: evictions, queueing
    python scripts/bench_replicas.py --dry-run           # tiny model on CPU in seconds (tests call it)
    python scripts/bench_replicas.py --dry-run --sessions 8 --replicas 1 2   # sessions > slots

Workload (`--seed`): `--sessions` concurrent asyncio sessions of `--turns` turns, mixed lengths.
A session's first prompt has a random length in [prompt_len/2, 3*prompt_len/2]; each turn
generates a random number of tokens (no stop tokens, temperature 1, so exactly that many): in
[gen_len/4, 7*gen_len/4], except a `--long-frac` share of turns that generate 4*gen_len (a long
tail); between turns a stub tool answers [tool_len/2, 3*tool_len/2] random tokens and the next
turn's prompt is the whole conversation (session_id set, so a replica reuses the session's parked
KV). Requests are keyed by (seed=turn, row=session): the tokens do not depend on which replica or
slot serves them.

Configurations, all over engines built from one random-init model (each engine its own weight
copy and KV cache, all on the default device):
- `server`: one `RolloutServer` on one engine with `--slots` S slots (the baseline);
- `router_N` for each N in `--replicas`: N engines with S/N slots each, a `RolloutServer` on
  each, behind one `ReplicaRouter` (sticky by session, least in flight otherwise, bound = the
  replica's slots, `--parked-reserve` slots kept for parked sessions: default half, 0 off).
  N=1 measures the router's own overhead against `server`.
Each configuration first sends one short session through each engine in turn (`warm_up`: with a
persistent compilation cache, replicas of one shape then share the main programs instead of all
compiling them at once), then runs `--repeats` times (the first compiles the remaining shapes; the
fastest later run is reported).

Prints one JSON object per configuration: generated tokens/s, prompt+generated tokens/s (prompt
tokens as the requests carry them, reused or not), requests/s, wall time, prompt tokens
computed/reused and the prefix-cache hit rate (reused / (reused + computed)), evictions, for the
router the `ReplicaRouter.metrics()` of the run (imbalance of requests and tokens: max/mean over
replicas, 1 = even; stickiness: share of later turns sent to their session's replica) and per
replica its requests, generated tokens, tokens/s and prefix hit rate; memory: `kv_cache_bytes`
(all the configuration's engines) and the device's `memory_stats()` where the backend has them
(None on CPU) before its engines are built, once built (their weight copies and KV caches) and
after its runs (`peak_bytes_in_use` is the process's peak so far, not this configuration's);
`tokens_equal`: whether every request generated the same token ids as under `server` (a cheap
correctness check; `token_match_fraction` is the share of requests that did: under bf16 a
different decode batch size can flip a near-tie, and the rest of that session then differs).
Then one summary record: per N, the ratios to `server`. Progress goes to stderr.

What it measures: several replicas on ONE device share its compute and HBM bandwidth, so this
shows router overhead, balance and prefix-cache stickiness under S/N-slot replicas, not
multi-GPU scaling (that needs a replica per device: tensor=1 sub-meshes, several GPUs).
Random-init models with Qwen2.5 shapes (bf16 on GPU, fp32 for --dry-run).
"""
from __future__ import annotations

import argparse
import asyncio
import gc
import sys
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
    p.add_argument("--prompt-len", type=int, default=256, help="mean first-prompt length")
    p.add_argument("--gen-len", type=int, default=128, help="mean tokens generated per turn (short turns)")
    p.add_argument("--long-frac", type=float, default=0.1,
                   help="share of turns that generate 4 * gen-len tokens (the long tail)")
    p.add_argument("--tool-len", type=int, default=32, help="mean tokens the stub tool returns")
    p.add_argument("--slots", type=int, default=64, help="total decode slots S (split S/N per replica)")
    p.add_argument("--replicas", type=int, nargs="+", default=[2, 4, 1],
                   help="replica counts N to compare with one server (each must divide --slots)")
    p.add_argument("--steps-per-sync", type=int, default=16)
    p.add_argument("--parked-reserve", type=int, default=None,
                   help="the router's parked_reserve (slots per replica kept for parked sessions' next "
                        "turns; default: half the replica's slots; 0: off)")
    p.add_argument("--repeats", type=int, default=3, help="runs per configuration, the first compiles")
    p.add_argument("--seed", type=int, default=0, help="workload seed")
    p.add_argument("--out", default="", help="also write the results (a JSON list) here")
    p.add_argument("--dry-run", "--tiny", action="store_true",
                   help="tiny model, 4 sessions x 3 turns of a few tokens, 4 slots, N=2, fp32: "
                        "a CPU smoke run (flags given explicitly keep their values)")
    args = p.parse_args(argv)
    if args.dry_run:  # the tiny settings, except those given on the command line
        tiny = dict(model="tiny", sessions=4, turns=3, slots=4, prompt_len=8, gen_len=4, tool_len=3,
                    steps_per_sync=4, long_frac=0.25, repeats=2, replicas=[2])
        for name, value in tiny.items():
            if getattr(args, name) == p.get_default(name):
                setattr(args, name, value)
    for name in ("sessions", "turns", "prompt_len", "gen_len", "tool_len", "slots", "repeats",
                 "steps_per_sync"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1")
    if not 0 <= args.long_frac <= 1:
        raise SystemExit(f"--long-frac must be in [0, 1], got {args.long_frac}")
    for n in args.replicas:
        if n < 1 or args.slots % n:
            raise SystemExit(f"--replicas {n}: each replica count must be >= 1 and divide --slots "
                             f"{args.slots} (every replica gets slots / N decode slots)")
    args.replicas = list(dict.fromkeys(args.replicas))  # in order, once each
    return args


def workload(args, vocab: int) -> dict:
    """First prompts [sessions][len], generated lengths [sessions][turns], tool replies
    [sessions][turns - 1][len]: all drawn from `args.seed`."""
    rng = np.random.default_rng(args.seed)

    def length(mean):  # uniform in [mean/2, 3*mean/2], at least 1
        return int(rng.integers(max(1, mean // 2), max(1, mean // 2) + mean + 1))

    prompts = [rng.integers(0, vocab, length(args.prompt_len)).tolist() for _ in range(args.sessions)]
    lo, hi = max(1, args.gen_len // 4), max(1, args.gen_len // 4) + 3 * args.gen_len // 2
    gen = rng.integers(lo, hi + 1, (args.sessions, args.turns))
    gen = np.where(rng.random((args.sessions, args.turns)) < args.long_frac, 4 * args.gen_len, gen).tolist()
    tools = [[rng.integers(0, vocab, length(args.tool_len)).tolist() for _ in range(args.turns - 1)]
             for _ in range(args.sessions)]
    return {"prompts": prompts, "gen": gen, "tools": tools}


def conversation_lengths(wl) -> tuple[int, int]:
    """(longest last-turn prompt, longest whole conversation) over the sessions."""
    last_prompt = full = 0
    for p, g, t in zip(wl["prompts"], wl["gen"], wl["tools"]):
        before_last = len(p) + sum(g[:-1]) + sum(len(x) for x in t)
        last_prompt, full = max(last_prompt, before_last), max(full, before_last + g[-1])
    return last_prompt, full


def build_model(args):
    from jaxrl_llm.models import ModelConfig, init_model

    dtype = jnp.float32 if args.dry_run else jnp.bfloat16
    cfg = ModelConfig(model_type="qwen2", attention_bias=True, rope_theta=1e6,
                      max_position_embeddings=32768, dtype=dtype, param_dtype=dtype,
                      **QWEN25_SHAPES[args.model])
    return init_model(cfg, seed=0)


def build_engines(model, n: int, slots: int, wl) -> list:
    """n engines over the same model, `slots` decode slots each (own weight copy and KV cache)."""
    import rollout

    last_prompt, full = conversation_lengths(wl)
    max_prefill = next((b for b in rollout.PREFILL_BUCKETS if b >= last_prompt), rollout.PREFILL_BUCKETS[-1])
    return [rollout.Engine.from_model(model, max_concurrent_decodes=slots, max_prefill_length=max_prefill,
                                      max_target_length=max(max_prefill + 1, full), temperature=1.0,
                                      stop_token_ids=(), layer_layout="per_layer")
            for _ in range(n)]


def warm_up(engines, args, wl) -> None:
    """One short two-turn session through each engine in turn (prefill, decode loop, append): with
    a persistent compilation cache (JAX_COMPILATION_CACHE_DIR) the later engines of the same shape
    load these programs instead of compiling them again, at the same time, in the first run (jit
    caches are per engine). Without a cache it only moves compile time out of the first run."""
    import rollout

    sp = rollout.SamplingParams(temperature=1.0)
    prompt = wl["prompts"][0]
    for e in engines:
        with rollout.RolloutServer(e, steps_per_sync=args.steps_per_sync, reuse_prefix=True) as srv:
            out = srv.generate("warm0", prompt, sampling=sp, max_new_tokens=2, session_id="warm")
            srv.generate("warm1", prompt + out.token_ids + [0], sampling=sp, max_new_tokens=2,
                         session_id="warm")


def device_memory() -> dict | None:
    """The default device's `memory_stats()` in bytes (None where the backend has none, e.g. CPU)."""
    try:
        stats = jax.devices()[0].memory_stats()
    except Exception:  # noqa: BLE001 - a backend without memory stats
        return None
    if not stats:
        return None
    return {k: int(stats[k]) for k in ("bytes_in_use", "peak_bytes_in_use", "bytes_limit") if k in stats}


def hit_rate(reused: float, computed: float) -> float:
    return float(reused) / float(reused + computed) if reused + computed else 0.0


def run_once(engines, args, wl, use_router: bool, steps_per_sync: int) -> dict:
    """Every session through one server (use_router False: engines[0]) or a router over one server
    per engine. Returns the run's figures and the generated ids [session][turn]."""
    import rollout

    sp = rollout.SamplingParams(temperature=1.0)
    servers = [rollout.RolloutServer(e, steps_per_sync=steps_per_sync, reuse_prefix=True)
               for e in (engines if use_router else engines[:1])]
    front = rollout.ReplicaRouter(servers, parked_reserve=args.parked_reserve) if use_router else servers[0]
    prompt_tokens = [0]

    async def session(i):
        ids, outs = list(wl["prompts"][i]), []
        for t in range(args.turns):
            prompt_tokens[0] += len(ids)
            out = await front.agenerate(f"s{i}t{t}", ids, sampling=sp, max_new_tokens=wl["gen"][i][t],
                                        session_id=f"s{i}", seed=t, row=i)
            outs.append(list(out.token_ids))
            ids += out.token_ids + (wl["tools"][i][t] if t < args.turns - 1 else [])
        return outs

    async def all_sessions():
        return await asyncio.gather(*(session(i) for i in range(args.sessions)))

    try:
        if use_router:
            front.metrics()  # starts the metrics interval
        t0 = time.perf_counter()
        ids = asyncio.run(all_sessions())
        wall = time.perf_counter() - t0
        metrics = front.metrics() if use_router else {}
        router_stats = front.stats if use_router else {}
        per = [s.stats for s in servers]
    finally:
        front.close()
    total = {k: sum(s.get(k, 0) for s in per) for k in
             ("generated_tokens", "prefill_tokens", "reused_tokens", "evictions", "reuse_misses",
              "decode_steps", "prefill_calls", "append_calls")}
    replicas = []
    for i, s in enumerate(per):
        r = {"replica": i, "generated_tokens": s.get("generated_tokens", 0),
             "requests": s.get("requests_finished", 0),
             "tokens_per_s": s.get("generated_tokens", 0) / wall,
             "prefill_tokens": s.get("prefill_tokens", 0), "reused_tokens": s.get("reused_tokens", 0),
             "prefix_hit_rate": hit_rate(s.get("reused_tokens", 0), s.get("prefill_tokens", 0)),
             "evictions": s.get("evictions", 0)}
        if use_router:
            r["metrics_tokens_per_s"] = metrics[f"rollout/replica/{i}/tokens_per_s"]
            r["metrics_prefix_hit_rate"] = metrics[f"rollout/replica/{i}/prefix_hit_rate"]
        replicas.append(r)
    out = {"wall_s": wall, **total, "prompt_tokens": prompt_tokens[0],
           "requests": args.sessions * args.turns,
           "prefix_hit_rate": hit_rate(total["reused_tokens"], total["prefill_tokens"]),
           "per_replica": replicas, "ids": ids}
    if use_router:
        out.update({
            "imbalance_requests": metrics["rollout/router/imbalance_requests"],
            "imbalance_tokens": metrics["rollout/router/imbalance_tokens"],
            "stickiness": metrics["rollout/router/stickiness"],
            "waited_requests": router_stats.get("waited_requests", 0),
            "session_requests": router_stats.get("session_requests", 0),
            "sticky_requests": router_stats.get("sticky_requests", 0),
            "router_metrics": {k: v for k, v in metrics.items() if k.startswith("rollout/router/")}})
    return out


def compare(ids, base) -> tuple[bool, float]:
    """(every request's ids equal, share of requests whose ids are equal)."""
    pairs = [(a, b) for sa, sb in zip(ids, base) for a, b in zip(sa, sb)]
    same = sum(a == b for a, b in pairs)
    return same == len(pairs), same / max(len(pairs), 1)


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    report = JsonReport(args.out)
    model = build_model(args)
    wl = workload(args, QWEN25_SHAPES[args.model]["vocab_size"])
    _, full = conversation_lengths(wl)
    base = {"model": f"qwen2.5-{args.model}", "sessions": args.sessions, "turns": args.turns,
            "prompt_len": args.prompt_len, "gen_len": args.gen_len, "long_frac": args.long_frac,
            "tool_len": args.tool_len, "slots": args.slots, "steps_per_sync": args.steps_per_sync,
            "parked_reserve": args.parked_reserve,
            "longest_conversation": full, "device": str(jax.devices()[0].device_kind),
            "devices": jax.device_count()}
    configs = [("server", 1, False)] + [(f"router_{n}", n, True) for n in args.replicas]
    results, base_ids = {}, None
    for name, n, use_router in configs:
        gc.collect()  # the last configuration's engines (reference cycles) go before these are built
        memory_before = device_memory()
        engines = build_engines(model, n, args.slots // n, wl)
        memory_built = device_memory()
        t0 = time.perf_counter()
        warm_up(engines, args, wl)
        warm_s = time.perf_counter() - t0
        runs = []
        for k in range(args.repeats):  # the first run compiles
            gc.collect()
            runs.append(run_once(engines, args, wl, use_router, args.steps_per_sync))
            print(f"[bench_replicas] {name}: run {k + 1}/{args.repeats} {runs[-1]['wall_s']:.2f} s",
                  file=sys.stderr, flush=True)
        memory_after = device_memory()
        kv_bytes = sum(e.kv_cache_bytes() for e in engines)
        del engines
        r = dict(min(runs[1:] or runs, key=lambda x: x["wall_s"]))
        ids = runs[0]["ids"]
        if base_ids is None:
            base_ids = ids
        equal, match = compare(ids, base_ids)
        repeats_equal = all(compare(x["ids"], ids)[0] for x in runs[1:])
        del r["ids"]
        wall = r["wall_s"]
        r = {"config": name, "replicas": n, "router": use_router, "slots_per_replica": args.slots // n,
             **base, **r,
             "tokens_per_s": r["generated_tokens"] / wall,
             "total_tokens_per_s": (r["generated_tokens"] + r["prompt_tokens"]) / wall,
             "requests_per_s": r["requests"] / wall,
             "tokens_equal": equal, "token_match_fraction": match, "repeats_tokens_equal": repeats_equal,
             "warm_up_s": warm_s, "first_run_wall_s": runs[0]["wall_s"],
             "run_walls_s": [x["wall_s"] for x in runs],
             "kv_cache_bytes": kv_bytes, "device_memory_before": memory_before,
             "device_memory_built": memory_built,
             "device_memory_after": memory_after}
        results[name] = report.add(r)
    summary = {"summary": True, **base, "tokens_equal": all(r["tokens_equal"] for r in results.values())}
    ref = results["server"]
    for name, r in results.items():
        if name == "server":
            continue
        summary[name] = {"tokens_per_s_ratio": r["tokens_per_s"] / ref["tokens_per_s"],
                         "total_tokens_per_s_ratio": r["total_tokens_per_s"] / ref["total_tokens_per_s"],
                         "wall_s_ratio": r["wall_s"] / ref["wall_s"],
                         "prefix_hit_rate": r["prefix_hit_rate"],
                         "server_prefix_hit_rate": ref["prefix_hit_rate"],
                         "imbalance_requests": r["imbalance_requests"],
                         "imbalance_tokens": r["imbalance_tokens"],
                         "stickiness": r["stickiness"], "tokens_equal": r["tokens_equal"]}
    report.add(summary)
    return report.records


if __name__ == "__main__":
    main()
