"""Benchmark output helpers: JSON lines + a rewritten JSON list, and a perfetto trace copy."""
import gzip
import json

import jax.numpy as jnp

from jaxrl_llm.metrics import JsonReport, perfetto_trace


def test_json_report_prints_each_record_and_rewrites_the_file(tmp_path, capsys):
    out = tmp_path / "r.json"
    report = JsonReport(str(out))
    report.add({"a": 1})
    assert json.loads(out.read_text()) == [{"a": 1}]  # already on disk after the first record
    report.add({"b": 2.5})
    assert [json.loads(x) for x in capsys.readouterr().out.splitlines()] == [{"a": 1}, {"b": 2.5}]
    assert json.loads(out.read_text()) == report.records == [{"a": 1}, {"b": 2.5}]
    JsonReport().add({"c": 3})  # no file: stdout only
    assert json.loads(capsys.readouterr().out) == {"c": 3}


def test_perfetto_trace_returns_the_result_and_writes_a_trace(tmp_path):
    dest = tmp_path / "sub" / "t.json.gz"
    assert perfetto_trace(lambda: float(jnp.ones(4).sum()), str(dest)) == 4.0
    with gzip.open(dest, "rt") as f:
        assert "traceEvents" in json.load(f)
