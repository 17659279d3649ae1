"""scripts/tpu/aot_moe_layer.py compiles one Qwen3-30B-A3B sparse MLP for a TPU topology on this
CPU machine: with the training rules the expert kernels split over fsdp and the dispatch
reduce-scatters (expert parallelism)."""
import ast
import re


def test_aot_moe_layer_compiles_expert_parallel_for_v5e(capsys, load_script):
    script = load_script("tpu/aot_moe_layer")
    script.main(["v5e:2x2", "4", "256", "ep"])
    out = capsys.readouterr().out
    assert "expert kernel spec P('fsdp', None, 'tensor')" in out
    temp = float(re.search(r"temp ([0-9.]+) GiB", out).group(1))
    collectives = ast.literal_eval(re.search(r"collectives: (\{.*\})", out).group(1))
    assert 0 < temp < 4 and collectives["reduce-scatter"] > 0
