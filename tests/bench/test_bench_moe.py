"""scripts/bench_moe.py's pure parts: the Qwen3-30B-A3B preset, its dense twin and the active-parameter
count (the script's GPU run itself is not a test: `--tiny` is its CPU smoke run)."""
import pytest


def test_qwen3_30b_a3b_preset_counts_30_5b_total_and_3_3b_active_params(load_script):
    bench = load_script("bench_moe")
    name, kwargs = bench.shape_kwargs("qwen3-30b-a3b", 48)
    moe, dense = bench.model_configs(kwargs)
    assert name == "qwen3-30b-a3b-L48" and moe.is_moe and not dense.is_moe
    h, layers, vocab = 2048, 48, 151936
    attn = h * 32 * 128 + 2 * h * 4 * 128 + 32 * 128 * h + 2 * 128  # q, k, v, o, q/k norms
    expert = 3 * h * 768
    per_layer_shared = attn + 2 * h + h * 128  # + 2 RMSNorms + router
    embed = 2 * vocab * h + h  # untied embedding and head, final norm
    counts = bench.param_counts(moe)
    assert counts["total_params"] == layers * (per_layer_shared + 128 * expert) + embed == 30_532_122_624
    assert counts["expert_params"] == layers * 128 * expert
    assert counts["active_params"] == layers * (per_layer_shared + 8 * expert) + embed == 3_353_032_704
    # the dense twin: the same model with one SwiGLU MLP of width 8 * 768 and no router
    assert dense.intermediate_size == 8 * 768 and dense.num_hidden_layers == layers
    assert bench.param_counts(dense)["total_params"] == counts["active_params"] - layers * h * 128
    assert bench.shape_kwargs("qwen3-30b-a3b-L8", 48)[1]["num_hidden_layers"] == 8


def test_bench_moe_rejects_unknown_shapes_and_parts(load_script):
    bench = load_script("bench_moe")
    with pytest.raises(SystemExit, match="--shape='qwen3-30b'"):
        bench.shape_kwargs("qwen3-30b", 4)
    with pytest.raises(SystemExit):
        bench.parse_args(["--skip", "decode,prefill"])
    assert bench.parse_args(["--skip", "decode,update"]).parts == ["mismatch"]

