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
    assert r["overlap"] and r["train_mesh"] == {"data": 1, "fsdp": 4, "context": 1, "tensor": 1}
    assert r["rollout_mesh"] == {"data": 2, "fsdp": 1, "context": 1, "tensor": 2}
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


def test_bench_e2e_lognormal_lengths_padded_and_packed_see_the_same_real_tokens(capsys, load_script):
    bench = load_script("bench_e2e")
    # median 4 under an 8-token budget: lengths from 1 to the cap; --tiny times one step (seed 1)
    recs = bench.main(["--tiny", "--lengths", "lognormal", "--median", "4", "--sync-repeats", "1",
                       "--modes", "padded", "packed", "--max-token-len", "64"])
    padded, packed, summary = recs
    assert (padded["mode"], packed["mode"], summary["bench"]) == ("padded", "packed", "e2e_packing")
    assert "error" not in padded and "error" not in packed
    draw = [bench.response_length(1, r, median=4, sigma=1.0, cap=8) for r in range(8)]
    assert len(set(draw)) > 2 and max(draw) <= 8
    # the rows were cut to the draw: 4 x 2 rows of 8 prompt tokens + the drawn responses
    assert padded["real_tokens"] == packed["real_tokens"] == 8 * 8 + sum(draw)
    assert padded["response_len_max"] == packed["response_len_max"] == max(draw)
    assert padded["response_len_mean"] == packed["response_len_mean"] == sum(draw) / 8
    # like for like: the same rows, the same loss whether packed or padded
    assert abs(padded["actor/pg_loss"] - packed["actor/pg_loss"]) < 1e-5
    assert padded["max_token_len"] is None and packed["max_token_len"] == 64
    for stage in ("old_log_prob", "ref", "update_actor", "step"):
        assert packed[f"real_tokens_per_s/{stage}"] > 0 and summary[f"speedup/{stage}"] > 0
    assert packed["compiled/old_log_prob"] >= packed["compiled_after_warmup/old_log_prob"] >= 1
    for r in (padded, packed):  # each stage also without the compiles inside its timed steps
        for stage in ("old_log_prob", "ref", "update_actor", "step"):
            c = r[f"compile_s/{stage}"]
            assert c >= 0 and abs(r[f"timing_s_excl_compile/{stage}"] - (r[f"timing_s/{stage}"] - c)) < 1e-9
    assert all(summary[f"speedup_excl_compile/{s}"] > 0 for s in ("old_log_prob", "ref", "update_actor", "step"))
    capsys.readouterr()


def test_the_compile_watch_counts_a_new_programs_trace_lowering_and_compile(load_script):
    import jax
    import numpy as np

    bench = load_script("bench_e2e")
    bench._watch_compiles()
    before = bench._COMPILE_S[0]
    jax.jit(lambda x: x * 3.0 + 1.25)(np.ones(7, np.float32)).block_until_ready()
    assert bench._COMPILE_S[0] > before


def test_cut_responses_right_pads_past_each_length(load_script):
    import numpy as np

    from jaxrl_llm.data import RolloutResult

    bench = load_script("bench_e2e")
    gen = RolloutResult(responses=np.arange(1, 13, dtype=np.int32).reshape(3, 4),
                        response_mask=np.ones((3, 4), np.int32),
                        rollout_log_probs=np.full((3, 4), -1.0, np.float32), finish_reasons=("length",) * 3)
    cut = bench.cut_responses(gen, np.array([4, 1, 2]))
    assert cut.responses.tolist() == [[1, 2, 3, 4], [5, 0, 0, 0], [9, 10, 0, 0]]
    assert cut.response_mask.sum(-1).tolist() == [4, 1, 2]
    assert cut.rollout_log_probs.tolist()[1] == [-1.0, 0.0, 0.0, 0.0]
