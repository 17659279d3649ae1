"""MetricsLogger files, console output, disabled mode, and plot_curves."""
import json
import math

import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm.metrics import MetricsLogger, plot_curves, read_jsonl
from jaxrl_llm.metrics._logger import STEP_KEY


def test_logger_jsonl_has_step_values_and_nonfinite_strings(tmp_path):
    with MetricsLogger(tmp_path, backends=("jsonl",)) as logger:
        logger.log({"actor/pg_loss": jnp.float32(0.5), "critic/score/mean": np.float64(1.25),
                    "perf/total_num_tokens": 12, "actor/entropy": float("nan"),
                    "actor/grad_norm": float("inf")}, step=3)
        logger.log({"critic/score/mean": 2.0}, step=4)
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 2
    assert '"actor/entropy": "NaN"' in lines[0] and '"actor/grad_norm": "Infinity"' in lines[0]
    records = read_jsonl(tmp_path / "metrics.jsonl")
    first = records[0]
    assert first["training/global_step"] == 3
    assert first["actor/pg_loss"] == 0.5 and first["critic/score/mean"] == 1.25
    assert first["perf/total_num_tokens"] == 12 and isinstance(first["perf/total_num_tokens"], int)
    assert math.isnan(first["actor/entropy"]) and first["actor/grad_norm"] == math.inf
    assert records[1] == {"training/global_step": 4, "critic/score/mean": 2.0}


def test_logger_appends_on_reopen(tmp_path):
    for step in (1, 2):
        with MetricsLogger(tmp_path, backends=("jsonl",)) as logger:
            logger.log({"x/y": step}, step=step)
    assert [r["training/global_step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [1, 2]


def test_logger_rejects_non_scalar_naming_key(tmp_path):
    with MetricsLogger(tmp_path, backends=("jsonl",)) as logger:
        with pytest.raises(ValueError, match="'actor/kl'"):
            logger.log({"actor/kl": np.ones(3)}, step=1)


def test_logger_tensorboard_event_file(tmp_path):
    with MetricsLogger(tmp_path, backends=("tensorboard",)) as logger:
        logger.log({"actor/pg_loss": 0.5}, step=1)
    events = list((tmp_path / "tensorboard").glob("events.out.tfevents*"))
    assert len(events) == 1
    assert b"actor/pg_loss" in events[0].read_bytes()
    assert not (tmp_path / "metrics.jsonl").exists()


def test_logger_names_the_run_and_writes_generation_samples_to_tensorboard(tmp_path):
    with MetricsLogger(tmp_path, backends=("tensorboard", "jsonl"), run_name="proj/exp-7") as logger:
        logger.log_generations([{"prompt": "1+2=", "response": "3", "score": 1.0}], step=4)
    data = b"".join(p.read_bytes() for p in (tmp_path / "tensorboard").glob("events.out.tfevents*"))
    assert b"run/name" in data and b"proj/exp-7" in data
    assert b"val/generations" in data and b"1+2=" in data
    (row,) = [json.loads(x) for x in open(tmp_path / "val_generations.jsonl")]
    assert row == {"training/global_step": 4, "prompt": "1+2=", "response": "3", "score": 1.0}


def test_logger_console_is_one_line_per_step_and_the_table_goes_to_metrics_log(tmp_path, capsys):
    with MetricsLogger(tmp_path, backends=("console",), console_every=2) as logger:
        for step in (1, 2, 3):
            logger.log({"actor/pg_loss": 0.125, "timing_s/gen": 2.0, "val-core/acc": step}, step)
    out = capsys.readouterr().out
    assert out.splitlines() == ["step 1: pg_loss=0.125  val-core/acc=1", "step 3: pg_loss=0.125  val-core/acc=3"]
    table = (tmp_path / "metrics.log").read_text()
    assert "step 1 " in table and "step 3 " in table and "step 2 " not in table
    lines = table.splitlines()
    assert any(line.startswith("actor") and "pg_loss=0.125" in line for line in lines)
    assert any(line.startswith("timing_s") and "gen=2" in line for line in lines)
    assert any(line.startswith("val-core") and "acc=3" in line for line in lines)


def test_logger_disabled_writes_nothing(tmp_path, capsys, monkeypatch):
    with MetricsLogger(tmp_path / "off", enable=False) as logger:
        logger.log({"a/b": 1.0}, step=1)
    monkeypatch.setattr("jaxrl_llm.metrics._logger.jax.process_index", lambda: 1)
    with MetricsLogger(tmp_path / "rank1") as logger:
        logger.log({"a/b": 1.0}, step=1)
    assert list(tmp_path.iterdir()) == []
    assert capsys.readouterr().out == ""


def _is_png(path):
    return path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_curves_score_and_validation(tmp_path):
    with MetricsLogger(tmp_path, backends=("jsonl",)) as logger:
        for step in range(1, 6):
            logger.log({"critic/score/mean": 0.1 * step}, step)
            if step % 2 == 0:
                logger.log({"val-core/gsm8k/acc/mean@1": 0.2 * step}, step)
    out = plot_curves(tmp_path, tmp_path / "plots" / "curves.png")
    assert out == tmp_path / "plots" / "curves.png"
    assert _is_png(out) and out.stat().st_size > 1000


def test_plot_curves_single_point_and_missing_keys(tmp_path):
    with MetricsLogger(tmp_path, backends=("jsonl",)) as logger:
        logger.log({"actor/pg_loss": 1.0}, step=1)
    out = plot_curves(tmp_path / "metrics.jsonl", tmp_path / "a.png")
    assert _is_png(out)
    with MetricsLogger(tmp_path / "one", backends=("jsonl",)) as logger:
        logger.log({"critic/score/mean": 1.0}, step=7)
    assert _is_png(plot_curves(tmp_path / "one", tmp_path / "b.png"))
    with pytest.raises(FileNotFoundError, match="missing"):
        plot_curves(tmp_path / "missing", tmp_path / "c.png")


def test_rewind_drops_rows_after_the_step_and_purges_tensorboard(tmp_path, monkeypatch):
    import tensorboardX

    purges = []
    real = tensorboardX.SummaryWriter.__init__

    def spy(self, *args, purge_step=None, **kwargs):
        purges.append(purge_step)
        real(self, *args, purge_step=purge_step, **kwargs)

    monkeypatch.setattr(tensorboardX.SummaryWriter, "__init__", spy)
    with MetricsLogger(tmp_path, backends=("jsonl", "tensorboard")) as logger:
        for step in (1, 2, 3):
            logger.log({"a": float(step)}, step=step)
            logger.log_generations([{"response": f"r{step}"}], step=step)
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"training/global_step": 4, "a": ')  # a row cut short by a kill
    with MetricsLogger(tmp_path, backends=("jsonl", "tensorboard")) as logger:
        logger.rewind(2)
        logger.log({"a": 30.0}, step=3)
    assert [(r[STEP_KEY], r["a"]) for r in read_jsonl(tmp_path / "metrics.jsonl")] == [
        (1, 1.0), (2, 2.0), (3, 30.0)]
    assert [r["response"] for r in read_jsonl(tmp_path / "val_generations.jsonl")] == ["r1", "r2"]
    assert purges[-1] == 3


def _tensorboard_scalars(folder) -> dict[str, list[tuple[int, float]]]:
    """{tag: [(step, value), ...]} read back from the event files (TFRecord framing: length,
    its CRC, the Event proto, its CRC)."""
    import struct

    from tensorboardX.proto.event_pb2 import Event

    out: dict[str, list[tuple[int, float]]] = {}
    for path in sorted(folder.glob("events.out.tfevents*")):
        data, pos = path.read_bytes(), 0
        while pos < len(data):
            (length,) = struct.unpack("<Q", data[pos:pos + 8])
            event = Event.FromString(data[pos + 12:pos + 12 + length])
            pos += 12 + length + 4
            for v in event.summary.value:
                if v.HasField("simple_value"):
                    out.setdefault(v.tag, []).append((event.step, v.simple_value))
    return out


def test_tensorboard_tags_are_the_printed_and_jsonl_names(tmp_path):
    name = "val-core/arithmetic/reward/mean@1"
    with MetricsLogger(tmp_path, backends=("tensorboard", "jsonl")) as logger:
        logger.log({name: 0.25, "actor/pg_loss": 0.5}, step=3)
    (row,) = read_jsonl(tmp_path / "metrics.jsonl")
    scalars = _tensorboard_scalars(tmp_path / "tensorboard")
    assert set(scalars) == set(row) - {"training/global_step"} == {name, "actor/pg_loss"}
    assert scalars[name] == [(3, 0.25)] and scalars["actor/pg_loss"] == [(3, 0.5)]


def test_generation_turns_stay_apart_in_jsonl_and_the_tensorboard_table(tmp_path):
    turns = [{"role": "user", "content": "37*48="}, {"role": "assistant", "content": "<call>"},
             {"role": "tool", "content": "1776"}, {"role": "assistant", "content": "1776"}]
    with MetricsLogger(tmp_path, backends=("tensorboard", "jsonl")) as logger:
        logger.log_generations([{"prompt": "37*48=", "response": "<call>1776", "score": 1.0, "turns": turns}],
                               step=2)
    (row,) = [json.loads(x) for x in open(tmp_path / "val_generations.jsonl")]
    assert row["turns"] == turns and row["response"] == "<call>1776"
    data = b"".join(p.read_bytes() for p in (tmp_path / "tensorboard").glob("events.out.tfevents*"))
    assert b"user: 37*48=<br>assistant: <call><br>tool: 1776<br>assistant: 1776" in data
