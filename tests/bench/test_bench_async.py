"""scripts/bench_async.py: every mode's command is a valid run config (checked by the loader), the
modes differ only in scheduling, and the summary arithmetic is right on hand-made metrics."""
import json

import pytest

from jaxrl_llm.config import load_config


def test_dry_run_commands_are_valid_configs(capsys, load_script, tmp_path):
    bench = load_script("bench_async")
    results = bench.main(["--dry-run", "--out", str(tmp_path)])
    assert [r["mode"] for r in results] == list(bench.MODES)
    printed = [json.loads(line) for line in capsys.readouterr().out.strip().splitlines()]
    assert printed == json.loads(json.dumps(results))
    seen = {}
    for r in results:
        spec = r["command"][r["command"].index("-m") + 2].split("=", 1)[1]
        overrides = [a[len("--config."):] for a in r["command"] if a.startswith("--config.")]
        c = load_config(spec, overrides)
        v1 = c.trainer.v1
        seen[r["mode"]] = (c.rollout_source, v1.colocate_async.num_warmup_batches,
                           v1.sampler.max_off_policy_threshold, c.async_training.partial_rollout)
        assert c.placement.mode == "separate" and c.trainer.total_training_steps == 20
    # the base config (quickstart_async) is separate_async half a batch ahead: every mode replaces it
    assert seen["sync"][0] == "sync"
    assert seen["one_step_off"] == ("one_step_off", 1.0, 1, False)
    assert seen["async_s0.5"] == ("buffer", 0.5, 1, False)
    assert seen["async_s1_partial"] == ("buffer", 1.0, 1, True)
    with pytest.raises(ValueError, match="unknown mode"):
        bench.main(["--dry-run", "--modes", "async_fast"])


def test_summary_throughput_per_device(load_script):
    bench = load_script("bench_async")
    rows = [{"timing_s/step": 2.0, "perf/total_num_tokens": 400, "perf/throughput": 100.0,
             "critic/score/mean": 0.5, "fully_async/staleness/max": 1.0},
            {"timing_s/step": 2.0, "perf/total_num_tokens": 400, "perf/throughput": 100.0,
             "critic/score/mean": 0.7, "fully_async/staleness/max": 0.0},
            {"val-core/arithmetic/reward/mean@1": 0.6}]
    s = bench.summarize("async_s1", rows)
    assert s["tokens_per_s_per_device"] == pytest.approx(800 / 4 / 2)  # 2 devices
    assert s["wall_s"] == [2.0, 4.0] and s["reward"] == [0.5, 0.7]
    assert s["staleness_max"] == 1.0 and s["val_last"] == 0.6
