"""scripts/bench_rollout.py --tiny runs on CPU and reports every field the GPU run reports (with
--batch-invariant both: the fast and the batch-invariant engine)."""
import json

import pytest


def test_bench_rollout_tiny_prints_json_with_all_metrics(capsys, load_script):
    bench = load_script("bench_rollout")
    results = bench.main(["--tiny", "--batch-invariant", "both"])
    printed = [json.loads(line) for line in capsys.readouterr().out.strip().splitlines()]
    assert printed == json.loads(json.dumps(results))
    r = printed[0]
    for key in ("tokens_per_s", "ms_per_step", "hbm_fraction", "compile_s", "peak_bytes",
                "kv_cache_bytes", "weight_bytes", "prefill_s", "flops_per_step", "roofline_ms",
                "roofline_fraction"):
        assert key in r, key
    assert r["generated_tokens"] == 4 * 8
    assert r["layer_layout"] == "per_layer"  # the default: the fast decode layout
    assert r["tokens_per_s"] > 0 and r["ms_per_step"] > 0 and 0 < r["hbm_fraction"]
    assert (r["gen_len"], r["short_len"]) == (8, 4)  # decode-only = the difference of the two calls
    assert r["bytes_per_step"] == r["weight_bytes"] + r["kv_read_bytes"]
    assert r["roofline_fraction"] == pytest.approx(r["roofline_ms"] / r["ms_per_step"])
    # --batch-invariant both: the fast path, then the invariant engine with its cost ratios
    assert [x["batch_invariant"] for x in printed] == [False, True] and "vs_fast_path" not in r
    inv = printed[1]
    assert inv["generated_tokens"] == r["generated_tokens"]
    assert inv["vs_fast_path"]["ms_per_step"] == pytest.approx(inv["ms_per_step"] / r["ms_per_step"])
    assert inv["vs_fast_path"]["total_s"] == pytest.approx(inv["total_s"] / r["total_s"])


def test_bench_rollout_invariance_check_finds_the_invariant_engine_bit_identical(load_script):
    """--invariance-check (what the GPU run uses to check the real kernels): 8 requests alone vs
    among 16, batch_invariant off then on; on, their tokens and log-probs are equal."""
    records = load_script("bench_rollout").main(["--tiny", "--invariance-check"])
    assert [(r["batch"], r["batch_invariant"]) for r in records] == [(16, False), (16, True)]
    on = records[1]
    assert on["tokens_equal"] and on["max_abs_logprob_diff"] == 0.0 and on["tokens_checked"] == 8 * 8


def test_bench_decode_kernels_tiny_times_every_kernel_and_checks_its_numerics(tmp_path, load_script):
    """scripts/bench_decode_kernels.py --tiny (CPU, interpret mode): attention plans and split-K
    GEMMs, each with a time and its error against the fp32 reference."""
    bench = load_script("bench_decode_kernels")
    out = tmp_path / "k.json"
    records = bench.main(["--tiny", "--out", str(out)])
    assert json.loads(out.read_text())["records"] == json.loads(json.dumps(records))
    attention = [r for r in records if r["part"] == "attention"]
    gemm = [r for r in records if r["part"] == "gemm"]
    assert {r["kernel"] for r in attention} == {"triton_default", "triton"}
    assert {r["splits"] for r in gemm} == {1, 2}
    for r in attention + gemm:
        assert "error" not in r and r["ms"] > 0, r
        assert r["max_err"] < 0.02, r  # bf16 against fp32


def test_bench_sleep_dry_run_frees_the_kv_cache_and_weight_copy_and_wake_takes_them_back(capsys, load_script):
    """scripts/bench_sleep.py --dry-run (CPU: live-array bytes): sleep frees at least the KV cache
    plus the engine's own weight copy; the held requests finish after wake."""
    record = load_script("bench_sleep").main(["--dry-run"])
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == json.loads(json.dumps(record))
    used, slept = record["in_use"], record["sleep"]
    assert record["source"] == "live_arrays" and record["layer_layout"] == "per_layer"
    assert slept["kv_bytes"] == record["kv_cache_bytes"] and slept["weights_released"]
    assert record["freed_by_sleep"] >= slept["kv_bytes"] + slept["weight_bytes"]
    assert used["awake"] >= used["suspended"] - 1024  # the small per-slot arrays may differ
    assert record["wake"]["recomputed_requests"] == 3
    assert record["held_tokens"] == [12, 12, 12]


def test_bench_recompute_dry_run_refills_held_prefixes_in_fewer_calls_than_the_admission_path(
        capsys, load_script):
    """scripts/bench_recompute.py --dry-run (CPU): 8 held requests with prefixes up to 131 tokens
    on a max_prefill_length=16 engine. The server's recompute ("whole") uses prefill calls alone,
    fewer than the 16-token chunk rounds the longest prefix takes through the admission path (the
    recompute before it, "admission"), which needs appends; both rebuild every prefix token,
    every repeat with the same calls."""
    record = load_script("bench_recompute").main(["--dry-run"])
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == json.loads(json.dumps(record))
    whole, admission = record["paths"]["whole"], record["paths"]["admission"]
    assert record["prefix_max"] > 8 * 16 and record["held"] == 8
    for path in (whole, admission):
        assert path["recomputed_requests"] == 8 and path["tokens"] == record["prefix_tokens"]
        assert path["calls"] == path["prefill_calls"] + path["append_calls"] == sum(path["shapes"].values())
        assert path["tokens"] <= path["padded_tokens"] and path["seconds"] > 0 and path["tokens_per_s"] > 0
        assert len({(r["calls"], r["padded_tokens"]) for r in path["repeats"]}) == 1
    assert whole["append_calls"] == 0 and whole["calls"] < record["prefix_max"] // 16
    assert admission["append_calls"] >= record["prefix_max"] // 16 > whole["calls"]
    assert record["speedup"] == admission["seconds"] / whole["seconds"]
