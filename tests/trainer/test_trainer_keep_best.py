"""`trainer.keep_best_val_metric`: the best validation step's actor is kept in `<run>/hf_best/`."""
import json
import math
import os
import types

import pytest

from jaxrl_llm.config import ConfigError
from jaxrl_llm.metrics import read_jsonl
from jaxrl_llm.trainer import RLTrainer

KEY = "val-core/arithmetic/reward/mean@1"


def test_the_best_validation_steps_actor_is_exported_with_its_step_and_value(tiny_run):
    run = tiny_run(**{"trainer.keep_best_val_metric": KEY, "trainer.total_training_steps": 3,
                      "trainer.test_freq": 1, "trainer.export_hf": False, "sft.steps": 0})
    RLTrainer(run).fit()
    run_dir = run.trainer.default_local_dir
    vals = [(r["training/global_step"], r[KEY]) for r in read_jsonl(f"{run_dir}/metrics.jsonl") if KEY in r]
    assert [s for s, _ in vals] == [0, 1, 2, 3]
    best_step, best_value = max(vals, key=lambda sv: (sv[1], -sv[0]))  # the first step at the max
    record = json.load(open(f"{run_dir}/hf_best/best.json"))
    assert record == {"metric": KEY, "step": best_step, "value": best_value}
    assert os.path.isfile(f"{run_dir}/hf_best/config.json") and os.path.isfile(f"{run_dir}/hf_best/model.safetensors")
    assert not os.path.exists(f"{run_dir}/hf_best.partial") and not os.path.exists(f"{run_dir}/hf_best.old")


class _Fake:
    """What `RLTrainer._keep_best` uses of the trainer; the export writes a marker file."""

    def __init__(self, run_dir, metric=KEY):
        self.config = types.SimpleNamespace(trainer=types.SimpleNamespace(keep_best_val_metric=metric))
        self.run_dir, self.tokenizer, self.logger_enabled = str(run_dir), None, True
        self.global_step, self._best_val, self.exports = 0, None, 0

    def call0(self, method, path, tokenizer=None):
        os.makedirs(path, exist_ok=True)
        self.exports += 1
        with open(os.path.join(path, "weights"), "w") as f:
            f.write(str(self.global_step))

    def keep(self, step, value, **more):
        self.global_step = step
        RLTrainer._keep_best(self, {KEY: value, **more})


def test_only_an_improvement_is_exported_and_the_record_survives_a_restart(tmp_path):
    t = _Fake(tmp_path)
    for step, value in [(0, 0.2), (1, 0.5), (2, 0.5), (3, 0.1), (4, math.nan)]:
        t.keep(step, value)
    assert t.exports == 2  # 0.2, then 0.5; a tie, a drop and NaN are not improvements
    assert json.load(open(tmp_path / "hf_best" / "best.json")) == {"metric": KEY, "step": 1, "value": 0.5}
    assert (tmp_path / "hf_best" / "weights").read_text() == "1"
    resumed = _Fake(tmp_path)  # a resumed run starts from the folder's record, not from -inf
    resumed.keep(5, 0.4)
    assert resumed.exports == 0 and (tmp_path / "hf_best" / "weights").read_text() == "1"
    resumed.keep(6, 0.75)
    assert json.load(open(tmp_path / "hf_best" / "best.json"))["step"] == 6
    assert sorted(os.listdir(tmp_path)) == ["hf_best"]


def test_off_by_default_and_a_metric_the_run_does_not_have_is_named(tmp_path, tiny_run):
    t = _Fake(tmp_path, metric="")
    t.keep(1, 0.9)
    assert t.exports == 0 and os.listdir(tmp_path) == []
    with pytest.raises(ValueError, match=r"keep_best_val_metric='val-core/arithmetic/reward/mean@8'.*mean@1"):
        RLTrainer._keep_best(_Fake(tmp_path, metric=KEY.replace("@1", "@8")), {KEY: 0.1})
    with pytest.raises(ConfigError, match="trainer.keep_best_val_metric='reward/mean@1' is not a validation"):
        tiny_run(**{"trainer.keep_best_val_metric": "reward/mean@1"})
