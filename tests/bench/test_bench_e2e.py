"""scripts/bench_e2e.py --tiny runs whole GRPO steps on CPU and reports verl's step metrics."""
import json


def test_bench_e2e_tiny_prints_json_with_stage_timings_throughput_and_sync(capsys, load_script):
    results = load_script("bench_e2e").main(["--tiny"])
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


def test_bench_e2e_separate_placement_with_overlap_hides_the_rollout(capsys, load_script):
    # 8 CPU devices: rollout on the last 4 (data 2 x tensor 2), training fsdp over the first 4
    r = load_script("bench_e2e").main(["--tiny", "--placement", "separate", "--rollout-mesh", "2", "1", "2",
                      "--overlap", "--steps", "2"])[0]
    assert "error" not in r, r.get("error")
    assert r["overlap"] and r["train_mesh"] == {"data": 1, "fsdp": 4, "tensor": 1}
    assert r["rollout_mesh"] == {"data": 2, "fsdp": 1, "tensor": 2}
    # the rollout ran in the background: its whole duration is reported apart from the wait
    assert r["timing_s/gen_async"] > 0 and r["timing_s/gen"] >= 0 and r["idle_fraction"] is None
    # across meshes every rollout shard arrives from other devices
    assert r["sync/cross_device_bytes_max"] > 0 and r["sync/multiple_of_link_limit"] > 0
    assert r["sync/bytes_moved"] == r["sync/bytes_dst"]


def test_cross_device_bytes_counts_what_each_device_lacks(load_script):
    import jax
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    bench = load_script("bench_e2e")
    mesh = jax.make_mesh((2,), ("x",), devices=jax.devices()[:2])
    x = jax.device_put(np.zeros((8, 4), np.float32), NamedSharding(mesh, P("x", None)))
    # rows split -> replicated: each device lacks the other half (16 elements of 4 bytes)
    got = bench.cross_device_bytes([x], [NamedSharding(mesh, P())], 4)
    assert sorted(got.values()) == [64, 64]
    # rows split -> columns split: each device already holds a quarter of what it needs
    got = bench.cross_device_bytes([x], [NamedSharding(mesh, P(None, "x"))], 2)
    assert sorted(got.values()) == [16, 16]
    # same layout: nothing crosses
    assert set(bench.cross_device_bytes([x], [x.sharding], 4).values()) == {0}
