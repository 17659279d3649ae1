"""rollout.quantization=int8 compiles for a real TPU slice (v5e:2x2, libtpu's compiler on this CPU
machine, `scripts/tpu/aot_compile.py`): the decode step and the quantizing weight sync, with the
engine's resident weights smaller than bf16's. Skipped only when libtpu is not installed."""
import importlib.util
import re
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
    texts, pallas_kernels = [], aot.pallas_kernels  # the compiled programs' HLO text, as the script reads it
    aot.pallas_kernels = lambda text: (texts.append(text), pallas_kernels(text))[1]
    out = {q: aot.run_aot("v5e:2x2", "configs/quickstart.py:tiny", TINY + (f"--config.rollout.quantization={q}",),
                          programs=programs, cost=False)
           for q, programs in (("int8", ("generate", "weight_sync")), ("none", ("weight_sync",)))}
    int8 = out["int8"]
    assert int8["engine"]["quantization"] == "int8" and int8["engine"]["layer_layout"] == "per_layer"
    for name in ("generate", "weight_sync"):
        assert int8["programs"][name]["argument_bytes"] > 0 and int8["programs"][name]["code_bytes"] > 0
    assert int8["programs"]["generate"]["pallas_kernels"] == ["jaxrl_decode_attention"]
    # the TPU compiler feeds the int8 kernels straight into the matmul fusions (re-tiled inside the
    # fusion, in VMEM): every top-level instruction that turns an s8 parameter (or an int8 copy,
    # slice or concatenation of one) into anything else is a fusion containing a convolution;
    # none writes a bf16 copy of a weight first (also so for the 1.5B shape on v5e-8, checked by
    # hand: 168 such consumers, all matmul fusions)
    comps = re.split(r"\n(?=\S)", next(t for t in texts if "jit(_generate_core)" in t))
    bodies = {c.split(" ", 1)[0]: c for c in comps}
    entry = next(c for c in comps if c.startswith("ENTRY"))
    names = set(re.findall(r"(%[\w.-]+) = s8\[[\d,]+\]\{[^}]*\} parameter\(", entry))
    assert names
    consumers = []
    for line in entry.splitlines()[1:]:
        m = re.match(r"\s*(?:ROOT )?(%[\w.-]+) = (\S+).*? ([\w-]+)\((.*?)\)", line)
        if not m or not names & set(re.findall(r"%[\w.-]+", m.group(4))):
            continue
        if m.group(2).lstrip("(").startswith("s8[") or m.group(3).endswith("-done"):
            names.add(m.group(1))  # still int8 (prefetch copies and slices into VMEM, bitcasts)
        else:
            consumers.append(line)
    assert consumers
    for line in consumers:
        called = re.search(r"calls=(%[\w.-]+)", line)
        assert " fusion(" in line and called and "convolution(" in bodies[called.group(1)], line[:200]
    # the projections at 1 byte + scales instead of 2 bytes (embedding and head stay bf16)
    assert int8["resident_bytes"]["engine_params"] < 0.7 * out["none"]["resident_bytes"]["engine_params"]
