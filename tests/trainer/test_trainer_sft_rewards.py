"""SFT on its own (`python -m jaxrl_llm.sft`'s code path) and reward functions that fail."""
import json
import os
import re

import numpy as np
import pytest

from jaxrl_llm import models
from jaxrl_llm.config import load_config
from jaxrl_llm.rewards import RewardFunctionError
from jaxrl_llm.sft import run_sft
from jaxrl_llm.trainer import RLTrainer

from trainer_helpers import QUICKSTART, tiny_overrides


def test_sft_trains_on_assistant_tokens_and_exports_a_loadable_model(tmp_path):
    run_dir = tmp_path / "sft"
    rl_files = {"metrics.jsonl": '{"step": 1}\n', "sft/metrics.jsonl": '{"step": 1, "sft/nll": 1.0}\n'}
    for name, text in rl_files.items():  # an RL run's own files in the same folder
        (run_dir / name).parent.mkdir(parents=True, exist_ok=True)
        (run_dir / name).write_text(text)
    run = load_config(f"{QUICKSTART}:tiny,local", tiny_overrides(run_dir, **{"sft.steps": 6}))
    out = run_sft(run)
    # everything it writes is in its own folder, <run>/sft_only/; the RL run's files stay as they were
    assert out["run_dir"] == str(run_dir / "sft_only") and out["hf_dir"] == str(run_dir / "sft_only" / "hf")
    assert sorted(os.listdir(run_dir)) == ["metrics.jsonl", "sft", "sft_only"]
    assert {name: (run_dir / name).read_text() for name in rl_files} == rl_files
    assert os.listdir(run_dir / "sft") == ["metrics.jsonl"]
    nll = [json.loads(x)["sft/nll"] for x in open(run_dir / "sft_only" / "metrics.jsonl")]
    assert len(nll) == 6 and nll[-1] < nll[0]  # it learns
    assert json.loads((run_dir / "sft_only" / "config.json").read_text())["sft"]["steps"] == 6
    model = models.from_pretrained(out["hf_dir"])
    tok = models.load_tokenizer(out["hf_dir"])
    ids = np.asarray([tok.encode(tok.apply_chat_template([{"role": "user", "content": "1+2="}]))], np.int32)
    assert model(ids).shape == (1, ids.shape[1], model.config.vocab_size)


@pytest.mark.parametrize("name, first_error", [("broken", "this scorer always fails"),
                                                ("overflow", "non-finite score 1e+39")])
def test_reward_function_that_always_fails_stops_the_run_naming_it(tmp_path, name, first_error):
    """A scorer that raises, or returns 1e39 (inf once cast to float32), fails every row: the
    circuit breaker (reward.max_error_fraction) stops the run before anything is trained on."""
    run = load_config(f"{QUICKSTART}:tiny,local", tiny_overrides(
        tmp_path / "r", **{"reward.custom_reward_function.name": name, "trainer.total_training_steps": 1,
                           "trainer.val_before_train": False, "trainer.export_hf": False, "sft.steps": 0}))
    with pytest.raises(RewardFunctionError, match=rf"16 of 16 .*length_parity\.py.*{name}.*{re.escape(first_error)}"):
        RLTrainer(run).fit()
    assert not (tmp_path / "r" / "checkpoints").exists() or not os.listdir(tmp_path / "r" / "checkpoints")


def test_reward_function_that_hangs_times_out_and_the_run_goes_on(tmp_path):
    hang = tmp_path / "hang.py"
    hang.write_text("import time\n\ndef compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                    "    if extra_info['index'] % 2 == 0:\n        time.sleep(60)\n    return 1.0\n")
    run = load_config(f"{QUICKSTART}:tiny,local", tiny_overrides(
        tmp_path / "h", **{"reward.custom_reward_function.path": hang, "reward.num_workers": 2,
                           "reward.timeout_s": 1.0, "trainer.total_training_steps": 1,
                           "reward.max_error_fraction": 1.0, "reward.max_consecutive_timeouts": 0,
                           "trainer.val_before_train": False, "trainer.export_hf": False}))
    RLTrainer(run).fit()
    rec = [json.loads(x) for x in open(tmp_path / "h" / "metrics.jsonl")][-1]
    assert rec["reward/num_timeouts"] >= 1
    assert os.path.exists(tmp_path / "h" / "checkpoints")
