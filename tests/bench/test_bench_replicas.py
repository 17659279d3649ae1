"""scripts/bench_replicas.py --dry-run serves one multi-turn workload through one RolloutServer
(4 slots) and through a ReplicaRouter over 2 replicas (2 slots each) on the same CPU device, and
reports throughput, balance, stickiness, per-replica prefix reuse and whether the tokens match."""
import json

import pytest


def test_bench_replicas_dry_run_two_replicas_same_tokens_and_both_used(capsys, load_script):
    bench = load_script("bench_replicas")
    results = bench.main(["--dry-run"])
    printed = [json.loads(line) for line in capsys.readouterr().out.strip().splitlines()]
    assert printed == json.loads(json.dumps(results))
    configs = {r["config"]: r for r in printed if "config" in r}
    assert sorted(configs) == ["router_2", "server"]
    args = bench.parse_args(["--dry-run"])
    wl = bench.workload(args, 256)
    generated = sum(map(sum, wl["gen"]))
    requests = args.sessions * args.turns
    assert len(set(map(len, wl["prompts"]))) > 1 and len({g for s in wl["gen"] for g in s}) > 1  # mixed
    for r in configs.values():
        for key in ("tokens_per_s", "total_tokens_per_s", "requests_per_s", "wall_s", "prefix_hit_rate",
                    "kv_cache_bytes", "device_memory_built", "device_memory_after", "run_walls_s"):
            assert key in r, key
        assert r["generated_tokens"] == generated  # no stop tokens: every turn runs to its budget
        assert r["requests"] == requests and r["tokens_per_s"] > 0 and r["wall_s"] > 0
        assert r["total_tokens_per_s"] > r["tokens_per_s"]
        assert r["tokens_equal"] is True and r["token_match_fraction"] == 1.0
        assert r["repeats_tokens_equal"] is True
        assert r["prefill_tokens"] + r["reused_tokens"] == r["prompt_tokens"]
        assert r["kv_cache_bytes"] == configs["server"]["kv_cache_bytes"]  # S slots in all, split or not
    assert configs["router_2"]["prompt_tokens"] == configs["server"]["prompt_tokens"]
    router = configs["router_2"]
    assert router["replicas"] == 2 and router["slots_per_replica"] == 2
    per = router["per_replica"]
    assert [p["replica"] for p in per] == [0, 1]
    assert all(p["requests"] > 0 and p["generated_tokens"] > 0 for p in per)  # the router spread them
    assert sum(p["requests"] for p in per) == requests
    assert sum(p["generated_tokens"] for p in per) == generated
    for p in per:
        assert 0 <= p["prefix_hit_rate"] <= 1 and p["tokens_per_s"] > 0
        assert p["metrics_prefix_hit_rate"] == pytest.approx(p["prefix_hit_rate"])
    # every later turn went to its session's replica
    assert router["session_requests"] == router["sticky_requests"] == args.sessions * (args.turns - 1)
    assert router["stickiness"] == 1.0 and router["imbalance_requests"] >= 1.0
    summary = printed[-1]
    assert summary["summary"] and summary["tokens_equal"] is True
    ratio = summary["router_2"]
    server = configs["server"]
    assert ratio["tokens_per_s_ratio"] == pytest.approx(router["tokens_per_s"] / server["tokens_per_s"])
    assert ratio["tokens_equal"] is True


def test_bench_replicas_compare_and_flags(load_script):
    bench = load_script("bench_replicas")
    assert bench.compare([[[1, 2], [3]]], [[[1, 2], [3]]]) == (True, 1.0)
    assert bench.compare([[[1, 2], [3]]], [[[1, 2], [4]]]) == (False, 0.5)
    with pytest.raises(SystemExit, match="--replicas 3.*divide --slots 4"):
        bench.parse_args(["--slots", "4", "--replicas", "3"])
