"""Per-run summary of metrics.jsonl files (one JSON object keyed by file name): step times after
the first step (mean, steps/s, every `timing_s/*` stage), response lengths and the engine/trainer
log-prob mismatch (`rollout/logprob_abs_diff/{max,mean}`) per step and the last validation metrics.

    python scripts/summarize_runs.py runs/a/metrics.jsonl runs/b/metrics.jsonl
"""
import json
import sys


def summarize(path: str) -> dict:
    rows = [json.loads(line) for line in open(path)]
    steps = [r for r in rows if "timing_s/step" in r]

    def values(key):
        return [r[key] for r in steps if key in r]

    def mean_after_first(key):
        v = values(key)[1:]
        return sum(v) / max(len(v), 1)

    stages = sorted({k for r in steps for k in r if k.startswith("timing_s/")})
    late = values("timing_s/step")[1:]
    return {
        "steps": len(steps), "step_s_first": values("timing_s/step")[0] if steps else None,
        "step_s_mean_after_first": mean_after_first("timing_s/step"),
        "steps_per_s_after_first": len(late) / max(sum(late), 1e-9),
        **{f"{k}_mean_after_first": mean_after_first(k) for k in stages},
        "response_length_mean": values("response_length/mean"),
        "response_length_max": values("response_length/max"),
        "prompt_length_mean": values("prompt_length/mean")[:3],
        # the engine/trainer log-prob mismatch per step (runs with an old-log-prob pass)
        "logprob_abs_diff_max": values("rollout/logprob_abs_diff/max"),
        "logprob_abs_diff_mean": values("rollout/logprob_abs_diff/mean"),
        "val": [{k: v for k, v in r.items() if k.startswith("val") and not k.endswith("_s")}
                for r in rows if any(k.startswith("val") for k in r)][-3:],
    }


if __name__ == "__main__":
    print(json.dumps({p.split("/")[-1]: summarize(p) for p in sys.argv[1:]}, indent=1))
