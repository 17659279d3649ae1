"""reasoning-gym as a data source and reward: verl-schema rows, disjoint train/held-out splits,
scores from each dataset's own `score_answer` (chain_sum: numeric answers; countdown: an
expression checked against the entry's metadata), the config path and its errors."""
import json
import os

import numpy as np
import pytest

from jaxrl_llm.config import ConfigError, load_config
from jaxrl_llm.data import DataError, RLDataset, read_rows
from jaxrl_llm.data.tasks import (extract_reasoning_gym_answer, make_reasoning_gym_dataset,
                                  make_reasoning_gym_rows)
from jaxrl_llm.rewards import RewardManager, default_compute_score, reasoning_gym_score
from jaxrl_llm.trainer._rl import prepare_builtin_data

pytest.importorskip("reasoning_gym", reason="the gym extra: pip install -e '.[gym]'")

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
CHAIN = {"min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 2}


def test_rows_are_verl_schema_and_the_splits_are_disjoint(tmp_path, tokenizer):
    for name, options in (("chain_sum", CHAIN), ("countdown", {"min_numbers": 3, "max_numbers": 4})):
        path = make_reasoning_gym_dataset(tmp_path / f"{name}.parquet", name, split="train",
                                          train_size=40, val_size=10, seed=7, options=options)
        train = read_rows(path)
        test = make_reasoning_gym_rows(name, split="test", train_size=40, val_size=10, seed=7,
                                       options=json.dumps(options))
        assert len(train) == 40 and len(test) == 10
        questions = [json.loads(r["extra_info"]["entry"])["question"] for r in train + test]
        assert len(set(questions)) == 50  # no repeats inside a split, none shared by the two
        for row in train:
            assert row["data_source"] == f"reasoning_gym/{name}" and row["ability"] == "reasoning"
            entry = json.loads(row["extra_info"]["entry"])
            assert row["prompt"] == [{"role": "user", "content": entry["question"] + " Put your "
                                      "final answer inside <answer></answer> tags."}]
            assert row["reward_model"]["ground_truth"] == entry["answer"]
            assert row["extra_info"]["answer_extraction"] == "answer_tag"
            assert json.loads(row["extra_info"]["dataset_config"]) == options
        assert len(RLDataset(path, tokenizer, max_prompt_length=1024)) == 40
        # deterministic in the seed, different for another seed
        again = make_reasoning_gym_rows(name, split="train", train_size=40, val_size=10, seed=7,
                                        options=options)
        assert again == train
        other = make_reasoning_gym_rows(name, split="train", train_size=40, val_size=10, seed=8,
                                        options=options)
        assert other != train


def test_chain_sum_config_options_reach_the_generator():
    rows = make_reasoning_gym_rows("chain_sum", split="train", train_size=30, val_size=0, seed=0,
                                   options={"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1})
    for row in rows:
        expr = json.loads(row["extra_info"]["entry"])["metadata"]["expression"]
        terms = expr.replace("-", "+").split("+")
        assert len(terms) == 2 and all(0 <= int(t) <= 9 for t in terms), expr


def _score(row, response):
    return default_compute_score(row["data_source"], response, row["reward_model"]["ground_truth"],
                                 row["extra_info"])


def test_reward_is_the_datasets_own_score_answer_on_the_tagged_answer():
    chain = make_reasoning_gym_rows("chain_sum", split="test", train_size=5, val_size=20, seed=1,
                                    options=CHAIN)
    for row in chain:
        truth = row["reward_model"]["ground_truth"]
        assert _score(row, f"Let me add. <answer>{truth}</answer>") == {"score": 1.0, "acc": 1.0, "answered": 1.0}
        # chain_sum's scorer tolerates "+", commas and trailing decimals
        assert _score(row, f"<answer>wrong</answer> then <answer> {int(truth):,}.00 </answer>")["acc"] == 1.0
        assert _score(row, f"<answer>{int(truth) + 1}</answer>")["score"] == 0.0
        assert _score(row, f"The answer is {truth}.") == {"score": 0.0, "acc": 0.0, "answered": 0.0}
    countdown = make_reasoning_gym_rows("countdown", split="train", train_size=10, val_size=0, seed=2,
                                        options={"min_numbers": 3, "max_numbers": 3})
    for row in countdown:
        entry = json.loads(row["extra_info"]["entry"])
        meta = entry["metadata"]
        assert _score(row, f"<answer>{entry['answer']}</answer>")["acc"] == 1.0
        # countdown's scorer evaluates the expression against metadata["numbers"] / ["target"]
        swapped = f"<answer>{' + '.join(map(str, meta['numbers']))}</answer>"
        want = 1.0 if sum(meta["numbers"]) == meta["target"] else 0.0
        assert (_score(row, swapped)["score"] == 1.0) == bool(want)
        assert _score(row, "<answer>1 + 1</answer>")["score"] < 1.0


def test_last_number_extraction_mode():
    rows = make_reasoning_gym_rows("chain_sum", split="train", train_size=10, val_size=0, seed=3,
                                   options=dict(CHAIN, answer_extraction="last_number"))
    for row in rows:
        truth = row["reward_model"]["ground_truth"]
        assert row["prompt"][0]["content"].endswith(" End your response with the final answer.")
        assert _score(row, f"3 + 4 = 7, so the answer is {truth}.")["acc"] == 1.0
        assert _score(row, f"<answer>{truth}</answer> and 5")["acc"] == 1.0  # a tag wins
        assert _score(row, "no number here")["answered"] == 0.0
    # a system_prompt option puts a system message before every question (same problems)
    sys_rows = make_reasoning_gym_rows("chain_sum", split="train", train_size=10, val_size=0, seed=3,
                                       options=dict(CHAIN, answer_extraction="last_number",
                                                    system_prompt="Use the calculator."))
    assert [r["prompt"] for r in sys_rows] == [
        [{"role": "system", "content": "Use the calculator."}] + r["prompt"] for r in rows]
    assert extract_reasoning_gym_answer("5-3 is 2; total 1,000.", "last_number") == "1000"
    assert extract_reasoning_gym_answer("it is -45.", "last_number") == "-45"
    assert extract_reasoning_gym_answer("10-4", "last_number") == "4"
    assert extract_reasoning_gym_answer("x <answer> 7 </answer>") == "7"
    assert extract_reasoning_gym_answer("it is 7") is None


@pytest.mark.parametrize("num_workers", [0, 2])
def test_reward_manager_scores_gym_rows_with_acc_as_an_extra(num_workers):
    rows = make_reasoning_gym_rows("chain_sum", split="train", train_size=4, val_size=0, seed=4,
                                   options=CHAIN)
    responses = [f"<answer>{r['reward_model']['ground_truth']}</answer>" for r in rows[:2]] + ["?", "<answer>x</answer>"]
    with RewardManager(num_workers=num_workers, timeout_s=60.0) as manager:
        scores, extra, _ = manager.score_batch([r["data_source"] for r in rows], responses,
                                               [r["reward_model"]["ground_truth"] for r in rows],
                                               [r["extra_info"] for r in rows])
    assert scores.tolist() == [1.0, 1.0, 0.0, 0.0]
    assert np.asarray(extra["acc"]).tolist() == [1.0, 1.0, 0.0, 0.0]
    assert np.asarray(extra["answered"]).tolist() == [1.0, 1.0, 0.0, 1.0]


def test_builtin_task_config_writes_both_splits(tmp_path):
    over = [f"trainer.default_local_dir={tmp_path}", "sft.steps=0",
            "data.builtin_task=reasoning_gym:chain_sum", "data.builtin_train_size=30",
            "data.builtin_val_size=12", f"data.builtin_task_config={json.dumps(CHAIN)}"]
    config = load_config(os.path.join(ROOT, "configs", "quickstart.py"), over)
    files = prepare_builtin_data(config)
    train, val = read_rows(files.train[0]), read_rows(files.val[0])
    assert (len(train), len(val)) == (30, 12)
    assert {r["extra_info"]["split"] for r in val} == {"test"}
    assert not {r["prompt"][0]["content"] for r in train} & {r["prompt"][0]["content"] for r in val}
    folder = os.path.dirname(files.train[0])
    assert os.path.basename(folder).startswith("reasoning_gym-chain_sum-")
    settings = json.loads(open(os.path.join(folder, "settings.json")).read())
    assert settings["val_size"] == 12 and settings["task_config"] == json.dumps(CHAIN)
    # another option: both files are made again, in another folder
    other = prepare_builtin_data(load_config(os.path.join(ROOT, "configs", "quickstart.py"),
                                             over[:-1] + ['data.builtin_task_config={"max_digits": 1}']))
    assert os.path.dirname(other.train[0]) != folder and read_rows(other.train[0]) != train


def test_config_and_data_errors_name_the_problem(tmp_path):
    base = os.path.join(ROOT, "configs", "quickstart.py")
    with pytest.raises(ConfigError, match="not JSON"):
        load_config(base, ["data.builtin_task=reasoning_gym:chain_sum", "data.builtin_task_config={bad"])
    with pytest.raises(ConfigError, match="answer_extraction='box'"):
        load_config(base, ["data.builtin_task=reasoning_gym:chain_sum",
                           'data.builtin_task_config={"answer_extraction": "box"}'])
    with pytest.raises(ConfigError, match="system_prompt must be a non-empty string"):
        load_config(base, ["data.builtin_task=reasoning_gym:chain_sum",
                           'data.builtin_task_config={"system_prompt": 3}'])
    with pytest.raises(ConfigError, match="builtin_task_config is for"):
        load_config(base, ['data.builtin_task_config={"a": 1}'])
    with pytest.raises(ConfigError, match="reasoning_gym:<dataset>"):
        load_config(base, ["data.builtin_task=reasoning_gym:Chain Sum"])
    with pytest.raises(DataError, match="no dataset 'nope'.*chain_sum"):
        make_reasoning_gym_rows("nope", split="train", train_size=1, val_size=1, seed=0)
    with pytest.raises(DataError, match="rejected the config"):
        make_reasoning_gym_rows("chain_sum", split="train", train_size=1, val_size=1, seed=0,
                                options={"min_term": 2})
    with pytest.raises(DataError, match="distinct questions"):
        make_reasoning_gym_rows("chain_sum", split="train", train_size=150, val_size=150, seed=0,
                                options={"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1})
    with pytest.raises(DataError, match="size"):
        make_reasoning_gym_rows("chain_sum", split="train", train_size=1, val_size=1, seed=0,
                                options={"size": 5})
    with pytest.raises(ValueError, match="extra_info.dataset"):
        reasoning_gym_score("<answer>1</answer>", "1", {})
