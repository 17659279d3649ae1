"""scripts/bench_e2e.py --tiny runs whole GRPO steps on CPU and reports verl's step metrics."""
import importlib.util
import json
import os

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "bench_e2e.py")


def test_bench_e2e_tiny_prints_json_with_stage_timings_throughput_and_sync(capsys):
    spec = importlib.util.spec_from_file_location("bench_e2e", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    results = bench.main(["--tiny"])
    printed = [json.loads(line) for line in capsys.readouterr().out.strip().splitlines()]
    assert printed == json.loads(json.dumps(results))
    r = printed[0]
    assert "error" not in r, r.get("error")
    for stage in ("gen", "reward", "old_log_prob", "ref", "adv", "update_actor", "update_weights", "step"):
        assert r[f"timing_s/{stage}"] >= 0, stage
    assert r["perf/throughput"] > 0
    # 4 prompts x 2 samples x (8 prompt + 8 response tokens), every response runs to the length cap
    assert r["perf/total_num_tokens"] == 4 * 2 * 16
    assert 0 <= r["idle_fraction"] < 1
    assert r["sync/zero_copy_bytes"] == 0  # the engine's own buffers: layouts match, nothing moves
