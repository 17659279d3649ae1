"""Validation in the trainer: verl's metrics with rollout.val.n > 1, val_only, and the sample of
generations written to the run folder."""
import json

import pytest

from jaxrl_llm.config import ConfigError
from jaxrl_llm.trainer import RLTrainer


def test_val_only_reports_verl_metrics_and_writes_generations(tiny_run):
    run = tiny_run(**{"rollout.val.n": 2, "rollout.val.temperature": 1.0, "trainer.val_only": True,
                      "trainer.log_val_generations": 3, "trainer.export_hf": False})
    val = RLTrainer(run).fit()
    src = "val-core/arithmetic/reward"
    for key in (f"{src}/mean@2", f"{src}/best@2/mean", f"{src}/best@2/std",
                "val-aux/arithmetic/reward/std@2", "val-aux/arithmetic/reward/worst@2/mean"):
        assert key in val, key
    assert val[f"{src}/best@2/mean"] >= val[f"{src}/mean@2"] >= val["val-aux/arithmetic/reward/worst@2/mean"]
    run_dir = run.trainer.default_local_dir
    rows = [json.loads(x) for x in open(f"{run_dir}/metrics.jsonl")]
    assert len(rows) == 1 and rows[0]["training/global_step"] == 0  # validated, did not train
    assert not any(k.startswith("actor/") for k in rows[0])
    samples = [json.loads(x) for x in open(f"{run_dir}/val_generations.jsonl")]
    assert len(samples) == 3
    for s in samples:
        assert {"prompt", "response", "score", "ground_truth", "data_source"} <= set(s)
        assert s["prompt"] and s["ground_truth"] != ""
        # the run's reward function is len(response) % 2: the logged score is that response's
        assert s["score"] == len(s["response"]) % 2


def test_val_only_without_val_files_is_a_config_error(tiny_run):
    with pytest.raises(ConfigError, match="data.val_files"):
        tiny_run(**{"trainer.val_only": True, "data.val_files": "", "data.builtin_val_size": 0})
