"""scripts/bench_agent.py --dry-run runs multi-turn sessions through the server and the driver on
CPU and reports throughput and the prefill work that session reuse saves."""
import json


def test_bench_agent_dry_run_reports_modes_and_prefill_saved_by_reuse(capsys, load_script):
    results = load_script("bench_agent").main(["--dry-run"])
    printed = [json.loads(line) for line in capsys.readouterr().out.strip().splitlines()]
    assert printed == json.loads(json.dumps(results))
    modes = {r["mode"]: r for r in printed if "mode" in r}
    assert sorted(modes) == ["driver", "server_no_reuse", "server_reuse"]
    sessions, turns, prompt, gen, tool = 4, 3, 8, 4, 3  # the dry-run workload
    for r in modes.values():
        assert r["generated_tokens"] == sessions * turns * gen  # no stop tokens: every turn runs out
        assert r["tokens_per_s"] > 0 and r["wall_s"] > 0
    # every turn prefills the whole conversation, in the driver and without reuse alike
    full = sessions * sum(prompt + t * (gen + tool) for t in range(turns))
    assert modes["driver"]["prefill_tokens"] == modes["server_no_reuse"]["prefill_tokens"] == full
    # with reuse a later turn computes only the tool's tokens and the previous turn's last token
    assert modes["server_reuse"]["prefill_tokens"] == sessions * (prompt + (turns - 1) * (tool + 1))
    assert modes["server_reuse"]["reused_tokens"] == full - modes["server_reuse"]["prefill_tokens"]
    summary = printed[-1]
    assert summary["summary"] and 0 < summary["prefill_tokens_saved_fraction"] < 1
    assert summary["speedup_server_reuse_vs_driver"] > 0
