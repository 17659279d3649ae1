"""scripts/bench_train.py --tiny runs the real actor update on CPU and reports throughput and MFU."""
import json


def test_bench_train_tiny_prints_json_with_throughput_mfu_and_memory(capsys, load_script):
    results = load_script("bench_train").main(["--tiny"])
    printed = [json.loads(line) for line in capsys.readouterr().out.strip().splitlines()]
    assert printed == json.loads(json.dumps(results))
    r = printed[0]
    for key in ("tokens_per_s", "mfu", "step_s", "compile_s", "peak_bytes", "flops_per_token", "params"):
        assert key in r, key
    assert r["seq_len"] == 16 and r["rows"] == 16
    assert r["tokens_per_s"] > 0 and r["mfu"] > 0
    assert r["grad_norm"] > 0  # the update really ran on the batch


def test_bench_train_flops_count_matches_verl_formula(load_script):
    bench = load_script("bench_train")
    from jaxrl_llm.models import ModelConfig
    cfg = ModelConfig(vocab_size=100, hidden_size=8, intermediate_size=16, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=False)
    # untied: the embedding lookup (100 x 8) is no matmul; attention 12 * L * heads * head_dim * S
    assert bench.flops_per_token(cfg, 1000, 10) == 6.0 * (1000 - 800) + 12.0 * 2 * 2 * 4 * 10


def test_bench_train_same_loss_on_one_device_and_on_meshes(capsys, load_script):
    bench = load_script("bench_train")
    one = bench.main(["--tiny", "--devices", "1"])[0]
    assert one["num_devices"] == 1
    for mesh in (["1", "-1", "1"], ["2", "2", "2"], ["1", "4", "2"]):
        r = bench.main(["--tiny", "--mesh", *mesh])[0]
        assert r["num_devices"] == 8 and r["mesh"]["tensor"] == int(mesh[2])
        assert abs(r["first_pg_loss"] - one["first_pg_loss"]) <= 1e-5 * max(1.0, abs(one["first_pg_loss"]))
        assert abs(r["first_grad_norm"] - one["first_grad_norm"]) <= 1e-4 * one["first_grad_norm"]
