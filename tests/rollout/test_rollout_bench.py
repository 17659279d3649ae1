"""scripts/bench_rollout.py --tiny runs on CPU and reports every field the GPU run reports."""
import json


def test_bench_rollout_tiny_prints_json_with_all_metrics(capsys, load_script):
    bench = load_script("bench_rollout")
    results = bench.main(["--tiny"])
    printed = [json.loads(line) for line in capsys.readouterr().out.strip().splitlines()]
    assert printed == json.loads(json.dumps(results))
    r = printed[0]
    for key in ("tokens_per_s", "ms_per_step", "hbm_fraction", "compile_s", "peak_bytes",
                "kv_cache_bytes", "weight_bytes"):
        assert key in r, key
    assert r["generated_tokens"] == 4 * 8
    assert r["layer_layout"] == "per_layer"  # the default: the fast decode layout
    assert r["tokens_per_s"] > 0 and r["ms_per_step"] > 0 and 0 < r["hbm_fraction"]
