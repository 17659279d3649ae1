"""Runs `scripts/bench_rollout.py` once per case (each in its own process, so XLA flags apply) and
prints one JSON summary: the decode A/B table of docs/benchmarks.md §3.

    python scripts/bench_decode_sweep.py --cases scripts/decode_sweep.json --out $OUT/sweep.json \
        -- --models 1.5b --batches 256 --gen-len 256 --no-peer

A case is {"name", "xla_flags" (appended to XLA_FLAGS), "args" (extra bench_rollout arguments),
"tree" (optional: a folder whose jaxrl_llm/, rollout/ and sharding/ are imported instead of this
checkout's, e.g. `git worktree add /tmp/base <commit>` for a before figure; relative paths are
taken from the cases file's folder), "timeout_s"}. The bench script is always this checkout's, so
every case is timed the same way. Arguments after `--` go to every case.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KEYS = ("batch", "layer_layout", "quantization", "ms_per_step", "roofline_fraction", "prefill_s", "total_s",
        "tokens_per_s", "compile_s", "decode_context", "bytes_per_step", "flops_per_step", "vs_unquantized")


def run_case(case: dict, common: list[str], base_dir: str, out_dir: str) -> dict:
    env = dict(os.environ)
    flags = " ".join(x for x in (env.get("XLA_FLAGS", ""), case.get("xla_flags", "")) if x)
    if flags:
        env["XLA_FLAGS"] = flags
    tree = case.get("tree")
    root = os.path.join(base_dir, tree) if tree and not os.path.isabs(tree) else tree or ROOT
    env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    out = os.path.join(out_dir, f"case_{case['name']}.json")
    cmd = [sys.executable, os.path.join(ROOT, "scripts", "bench_rollout.py"), *common,
           *case.get("args", []), "--out", out]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True,
                              timeout=case.get("timeout_s", 300))
        rc, tail = proc.returncode, (proc.stdout + proc.stderr)[-1500:]
    except subprocess.TimeoutExpired as e:
        rc, tail = "timeout", str(e.stdout or "")[-1500:]
    records = json.load(open(out)) if os.path.exists(out) else []
    return {"name": case["name"], "xla_flags": case.get("xla_flags", ""), "args": case.get("args", []),
            "tree": tree or ".", "rc": rc, "wall_s": time.perf_counter() - t0, "records": records,
            **({} if rc == 0 else {"tail": tail})}


def summary(results: list[dict]) -> list[dict]:
    peers = [r for res in results for r in res["records"] if r.get("engine") == "transformers.generate"
             and "decode_ms_per_step" in r]
    rows = []
    for res in results:
        for r in res["records"]:
            if r.get("engine") != "jaxrl_llm.rollout":
                continue
            row = {"case": res["name"], **{k: r.get(k) for k in KEYS}, "error": r.get("error")}
            for p in peers:
                if p["batch"] == r["batch"] and "ms_per_step" in r:
                    row[f"x_peer_{p['cache_implementation']}_decode"] = p["decode_ms_per_step"] / r["ms_per_step"]
                    row[f"x_peer_{p['cache_implementation']}_whole"] = p["total_s"] / r["total_s"]
            rows.append(row)
    return rows


def main(argv=None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    common = []
    if "--" in argv:
        i = argv.index("--")
        argv, common = argv[:i], argv[i + 1:]
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cases", required=True, help="JSON list of cases (see the module docstring)")
    p.add_argument("--only", nargs="*", default=[], help="run only these case names")
    p.add_argument("--out", default="", help="write the full results here (rewritten after each case)")
    args = p.parse_args(argv)
    cases = json.load(open(args.cases))
    if args.only:
        cases = [c for c in cases if c["name"] in args.only]
    out_dir = os.path.dirname(os.path.abspath(args.out)) if args.out else ROOT
    results = []
    for case in cases:
        res = run_case(case, common, os.path.dirname(os.path.abspath(args.cases)), out_dir)
        results.append(res)
        print(json.dumps({k: v for k, v in res.items() if k != "records"} | {"summary": summary([res])}),
              flush=True)
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"results": results, "summary": summary(results)}, f, indent=1)
    table = summary(results)
    print(json.dumps({"summary": table}))
    return {"results": results, "summary": table}


if __name__ == "__main__":
    main()
