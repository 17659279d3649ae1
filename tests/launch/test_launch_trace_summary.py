"""scripts/trace_summary.py: device time per kernel and kind from a perfetto trace."""
import gzip
import json

import pytest


def _trace(path):
    ev = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}},
          {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/device:GPU:1"}},
          {"ph": "M", "name": "process_name", "pid": 3, "args": {"name": "/host:CPU"}}]
    ts = 0
    for name, dur in (("nvjet_hsh_128x256_gemm", 300), ("loop_dynamic_slice_fusion", 200),
                      ("MemcpyD2D", 100), ("sm80_flash_fprop_wmma", 150), ("loop_add_fusion", 50),
                      ("nvjet_hsh_128x256_gemm", 300), ("ncclDevKernel_AllGather_RING_LL", 100)):
        ev.append({"ph": "X", "pid": 1, "tid": 1, "name": name, "ts": ts, "dur": dur})
        ts += dur + 10
    ev.append({"ph": "X", "pid": 2, "tid": 1, "name": "small", "ts": 0, "dur": 5})
    ev.append({"ph": "X", "pid": 3, "tid": 1, "name": "host work", "ts": 0, "dur": 99999})
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": ev}, f)


def test_trace_summary_groups_device_kernels_by_name_and_kind(tmp_path, capsys, load_script):
    _trace(tmp_path / "t.trace.json.gz")
    out = load_script("trace_summary").main([str(tmp_path / "t.trace.json.gz"), "--per", "2"])
    assert json.loads(capsys.readouterr().out) == out
    assert out["device_track"] == "/device:GPU:0"  # the busiest device; host events ignored
    k = out["by_kind_ms"]
    assert k["gemm"] == pytest.approx(0.3) and k["copy"] == pytest.approx(0.15)
    assert k["attention"] == pytest.approx(0.075) and k["collective"] == pytest.approx(0.05)
    assert k["fusion"] == pytest.approx(0.025)
    assert out["top_kernels"][0] == {"name": "nvjet_hsh_128x256_gemm", "kind": "gemm", "ms": 0.3, "calls": 1.0}
    assert out["kernel_ms"] == pytest.approx(0.6) and out["window_ms"] == pytest.approx(0.63)


def test_trace_summary_without_device_events_says_so(tmp_path, load_script):
    path = tmp_path / "cpu.json"
    path.write_text(json.dumps({"traceEvents": [{"ph": "X", "pid": 3, "name": "x", "ts": 0, "dur": 1}]}))
    with pytest.raises(ValueError, match="no device events"):
        load_script("trace_summary").main([str(path)])
