"""scripts/bench_modes.py: both trainer modes run through the real trainer on the tiny model with
the long-tailed lengths; the lengths are drawn per row as documented; the figures' arithmetic."""
import json

import numpy as np
import pytest


def test_dry_run_trains_both_modes_on_long_tailed_lengths(capsys, load_script, tmp_path):
    bench = load_script("bench_modes")
    results = bench.main(["--dry-run", "--plot", str(tmp_path / "modes.png")])
    assert [r["mode"] for r in results] == ["sync", "colocate_async"]
    for r in results:
        assert r["timed_steps"] == 1 and r["tokens_trained"] > 0
        assert 1 <= r["response_length_max"] <= 12  # the --cap of the dry run
        # the model has the shape's vocabulary and no stop token (both tokenizers patched)
        assert r["vocab_size"] == bench.QWEN25_SHAPES["tiny"]["vocab_size"] and r["stop_token_ids"] == []
        assert len(r["score_mean"]) == len(r["wall_s"]) == 2  # every step, the warm-up's included
        assert all(0.0 <= s <= 1.0 for s in r["score_mean"]) and r["wall_s"][1] > r["wall_s"][0] > 0
    assert (tmp_path / "modes.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the agent loops decode with the bench's tokenizer: most of the tiny model's ids are past the
    # characters and count as a/b (about 0.5; the plain character tokenizer drops them: about 0.1)
    assert np.mean([s for r in results for s in r["score_mean"]]) > 0.3
    colocate = results[1]
    assert colocate["held_groups_mean"] >= 0 and colocate["kv_bytes_released"] > 0  # slept over the update
    lines = [json.loads(line) for line in capsys.readouterr().out.strip().splitlines()]
    assert lines[-1]["summary"]["sync"] == 1.0
    assert lines[-1]["summary"]["colocate_async"] == pytest.approx(
        results[1]["tokens_per_s_per_device"] / results[0]["tokens_per_s_per_device"])


def test_response_budget_is_a_capped_lognormal_fixed_by_seed_and_row(load_script):
    bench = load_script("bench_modes")
    draw = [bench.response_budget(7, row, median=300, sigma=1.0, cap=4096) for row in range(4000)]
    assert draw == [bench.response_budget(7, row, median=300, sigma=1.0, cap=4096) for row in range(4000)]
    assert draw != [bench.response_budget(8, row, median=300, sigma=1.0, cap=4096) for row in range(4000)]
    assert 270 <= np.median(draw) <= 330 and min(draw) >= 1 and max(draw) == 4096  # the tail hits the cap


def test_summary_counts_only_the_steps_after_warmup(load_script):
    bench = load_script("bench_modes")
    rows = [{"training/global_step": s, "timing_s/step": t, "perf/total_num_tokens": n, "timing_s/gen": 1.0,
             "response_length/mean": 10.0, "response_length/max": 20.0}
            for s, t, n in ((1, 50.0, 1), (2, 2.0, 300), (3, 4.0, 600))]
    out = bench.summarize("sync", rows, warmup=1, devices=2)
    assert out["timed_steps"] == 2 and out["tokens_trained"] == 900
    assert out["tokens_per_s_per_device"] == pytest.approx(900 / 6.0 / 2)


def test_reward_counts_even_ids_past_the_characters(load_script):
    bench = load_script("bench_modes")
    reward = load_script("bench_modes_reward")
    tok = bench.PaddedCharTokenizer(1000)
    first = tok.num_chars + (tok.num_chars % 2)  # an even id past the characters
    text = tok.decode([first, first + 1, first + 2, first + 4])
    assert text == "abaa"
    assert reward.even_token_share("d", text, None) == 0.75
    assert reward.even_token_share("d", "", None) == 0.0
