"""rollout.quantization=int8 compiles for a real TPU slice (v5e:2x2, libtpu's compiler on this CPU
machine, `scripts/tpu/aot_compile.py`): the decode step and the quantizing weight sync, with the
engine's resident weights smaller than bf16's. Skipped only when libtpu is not installed."""
import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("libtpu")

# the quickstart's tiny model with TPU-shaped heads (as tests/launch/test_launch_aot.py)
TINY = ("--config.model.init.head_dim=128", "--config.model.init.num_attention_heads=2",
        "--config.model.init.num_key_value_heads=2", "--config.model.dtype=bfloat16")


def test_int8_rollout_decode_and_sync_compile_for_v5e():
    path = Path(__file__).resolve().parents[2] / "scripts" / "tpu" / "aot_compile.py"
    spec = importlib.util.spec_from_file_location("aot_compile", path)
    aot = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(aot)
    out = {q: aot.run_aot("v5e:2x2", "configs/quickstart.py:tiny", TINY + (f"--config.rollout.quantization={q}",),
                          programs=programs, cost=False)
           for q, programs in (("int8", ("generate", "weight_sync")), ("none", ("weight_sync",)))}
    int8 = out["int8"]
    assert int8["engine"]["quantization"] == "int8" and int8["engine"]["layer_layout"] == "per_layer"
    for name in ("generate", "weight_sync"):
        assert int8["programs"][name]["argument_bytes"] > 0 and int8["programs"][name]["code_bytes"] > 0
    assert int8["programs"]["generate"]["pallas_kernels"] == ["jaxrl_decode_attention"]
    # the projections at 1 byte + scales instead of 2 bytes (embedding and head stay bf16)
    assert int8["resident_bytes"]["engine_params"] < 0.7 * out["none"]["resident_bytes"]["engine_params"]
