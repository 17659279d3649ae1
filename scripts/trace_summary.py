"""Device-time summary of a `jax.profiler` perfetto trace (`*.trace.json.gz`), as JSON.

    python scripts/trace_summary.py trace.json.gz                # top kernels and kinds
    python scripts/trace_summary.py trace.json.gz --per 64 --top 40   # per step of 64 steps

Sums the duration of every complete event (`"ph": "X"`) on a device track (a process whose
name mentions a GPU/TPU device, e.g. `/device:GPU:0`), grouped by kernel name and by kind
(`gemm`, `attention`, `copy`, `collective`, `fusion`, `other`, from the name). `--per N` divides
the times by N (e.g. decode steps or optimizer steps in the traced window). Times are in ms.
With several devices, the busiest device's kernels are reported (`--device` picks another).
"""
from __future__ import annotations

import argparse
import gzip
import json
import re
import sys
from collections import defaultdict

# first match wins; names are lower-cased
KINDS = (
    ("collective", r"nccl|all-?reduce|all-?gather|reduce-?scatter|all-?to-?all|collective"),
    ("attention", r"flash|fmha|sdpa|attention|cudnn"),
    ("gemm", r"gemm|nvjet|cutlass|matmul|dot|wgmma|sm90_xmma|ampere_.*xmma"),
    ("copy", r"memcpy|memset|copy|dynamic[-_]slice|dynamic[-_]update[-_]slice|transpose"),
    ("fusion", r"fusion|reduce|loop_|input_|convert|broadcast"),
)
_DEVICE_TRACK = re.compile(r"/device:(gpu|tpu)|gpu:\d|tpu:\d", re.I)


def kind_of(name: str) -> str:
    low = name.lower()
    for kind, pattern in KINDS:
        if re.search(pattern, low):
            return kind
    return "other"


def load_events(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def summarize(events: list[dict], *, per: float = 1.0, top: int = 25, device: str = "") -> dict:
    names = {e["pid"]: e.get("args", {}).get("name", "") for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    by_device: dict[str, list[dict]] = defaultdict(list)
    for e in events:
        if e.get("ph") != "X" or "dur" not in e:
            continue
        pname = names.get(e.get("pid"), "")
        if _DEVICE_TRACK.search(pname):
            by_device[pname].append(e)
    if not by_device:
        raise ValueError("no device events in this trace (was it recorded on a GPU/TPU?)")
    if device:
        picked = [k for k in by_device if device in k]
        if not picked:
            raise ValueError(f"no device track matches {device!r}; tracks: {sorted(by_device)}")
        track = picked[0]
    else:
        track = max(by_device, key=lambda k: sum(e["dur"] for e in by_device[k]))
    evs = by_device[track]
    per_name: dict[str, float] = defaultdict(float)
    count: dict[str, int] = defaultdict(int)
    for e in evs:
        per_name[e["name"]] += e["dur"]
        count[e["name"]] += 1
    per_kind: dict[str, float] = defaultdict(float)
    for name, us in per_name.items():
        per_kind[kind_of(name)] += us
    start = min(e["ts"] for e in evs)
    end = max(e["ts"] + e["dur"] for e in evs)
    busy = sum(per_name.values())
    ms = lambda us: us / 1000.0 / per  # noqa: E731
    ranked = sorted(per_name.items(), key=lambda kv: -kv[1])[:top]
    return {
        "device_track": track, "tracks": sorted(by_device), "per": per,
        "window_ms": ms(end - start), "kernel_ms": ms(busy),
        "kernel_fraction_of_window": busy / max(end - start, 1e-9),
        "by_kind_ms": {k: ms(v) for k, v in sorted(per_kind.items(), key=lambda kv: -kv[1])},
        "top_kernels": [{"name": n[:160], "kind": kind_of(n), "ms": ms(us), "calls": count[n] / per}
                        for n, us in ranked],
    }


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("trace")
    p.add_argument("--per", type=float, default=1.0, help="divide times by this (steps in the trace)")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--device", default="", help="substring of the device track to report")
    args = p.parse_args(argv)
    out = summarize(load_events(args.trace), per=args.per, top=args.top, device=args.device)
    json.dump(out, sys.stdout, indent=1)
    print()
    return out


if __name__ == "__main__":
    main()
