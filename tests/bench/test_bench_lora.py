"""scripts/bench_lora.py --tiny runs a full fine-tuning and a LoRA actor step on CPU and reports
memory, step and sync time; LoRA's optimizer state is a small fraction of full fine-tuning's."""
import json


def test_bench_lora_tiny_prints_json_for_full_and_lora_steps(capsys, load_script):
    results = load_script("bench_lora").main(["--tiny"])
    printed = [json.loads(line) for line in capsys.readouterr().out.strip().splitlines()]
    assert printed == json.loads(json.dumps(results))
    full, lora = printed
    assert (full["lora_rank"], lora["lora_rank"]) == (0, 4)
    for r in printed:
        for key in ("step_s", "sync_s", "peak_bytes", "opt_state_bytes", "trainable_params", "params"):
            assert key in r, key
        assert r["step_s"] > 0 and r["sync_s"] > 0 and not r["oom"]
    assert full["trainable_params"] == full["params"]
    assert lora["trainable_params"] < full["params"] / 2
    # AdamW keeps two fp32 moments per trained parameter
    assert abs(lora["opt_state_bytes"] - 8 * lora["trainable_params"]) <= 64
    assert abs(full["opt_state_bytes"] - 8 * full["params"]) <= 64
