"""Built-in task generators and the GSM8K converter write data our readers and scorers accept."""
import json
import subprocess
import sys
from pathlib import Path

from jaxrl_llm.data import RLDataset, read_rows
from jaxrl_llm.data.tasks import (
    make_arithmetic_dataset,
    make_arithmetic_rows,
    make_arithmetic_sft_rows,
    make_countdown_dataset,
    render_arithmetic_answer,
)
from jaxrl_llm.rewards import arithmetic_score, countdown_score

REPO = Path(__file__).resolve().parents[2]


def test_arithmetic_dataset_is_verl_schema_short_and_correct(tmp_path, tokenizer):
    path = make_arithmetic_dataset(tmp_path / "train.parquet", 200, seed=0)
    rows = read_rows(path)
    assert len(rows) == 200
    for row in rows:
        prompt = row["prompt"][0]["content"]
        assert row["data_source"] == "arithmetic" and len(prompt) <= 16
        a, b = prompt.rstrip("=").split("+")
        assert int(row["reward_model"]["ground_truth"]) == int(a) + int(b)
    assert len({r["prompt"][0]["content"] for r in rows}) == 200  # sampled without replacement
    assert len(RLDataset(path, tokenizer, max_prompt_length=32)) == 200


def test_arithmetic_train_and_test_problems_are_disjoint_and_deterministic():
    train = {r["prompt"][0]["content"] for r in make_arithmetic_rows(3000, seed=1)}
    test = {r["prompt"][0]["content"] for r in make_arithmetic_rows(500, seed=1, split="test")}
    assert not train & test
    assert make_arithmetic_rows(5, seed=3) == make_arithmetic_rows(5, seed=3)
    assert make_arithmetic_rows(5, seed=3) != make_arithmetic_rows(5, seed=4)


def test_arithmetic_sft_answer_is_what_the_scorer_accepts():
    for row in make_arithmetic_sft_rows(50, 0):
        user, assistant = row["messages"]
        assert user == row["prompt"][0] and assistant["role"] == "assistant"
        assert assistant["content"] == render_arithmetic_answer(row)
        assert arithmetic_score(assistant["content"], row["reward_model"]["ground_truth"]) == 1.0


def test_countdown_dataset_problems_are_solvable(tmp_path):
    rows = read_rows(make_countdown_dataset(tmp_path / "cd.parquet", 30, seed=0))
    assert len(rows) == 30
    for row in rows:
        truth = row["reward_model"]["ground_truth"]
        assert 3 <= len(truth["numbers"]) <= 4 and 1 <= truth["target"] <= 100
        answer = f"<answer>{row['extra_info']['solution']}</answer>"
        assert countdown_score(answer, truth) == 1.0, row


def test_convert_gsm8k_script_writes_verl_parquet(tmp_path):
    src = tmp_path / "gsm8k.jsonl"
    src.write_text("\n".join(json.dumps(r) for r in [
        {"question": "Tom has 2 apples and buys 3. How many?", "answer": "2+3=5\n#### 5"},
        {"question": "Big?", "answer": "so\n#### 1,200"}]))
    out = tmp_path / "out" / "train.parquet"
    script = str(REPO / "scripts" / "convert_gsm8k.py")
    dry = subprocess.run([sys.executable, script, "--input", str(src), "--output", str(out),
                          "--dry-run"], capture_output=True, text=True, check=True)
    assert json.loads(dry.stdout)["rows"] == 2 and not out.exists()
    subprocess.run([sys.executable, script, "--input", str(src), "--output", str(out),
                    "--split", "test"], capture_output=True, text=True, check=True)
    rows = read_rows(out)
    assert [r["reward_model"]["ground_truth"] for r in rows] == ["5", "1200"]
    assert rows[0]["data_source"] == "openai/gsm8k" and rows[0]["extra_info"]["split"] == "test"
    assert rows[0]["prompt"][0]["content"].startswith("Tom has 2 apples")
    assert "####" in rows[0]["prompt"][0]["content"]


def test_convert_gsm8k_rejects_answer_without_hashes(tmp_path):
    src = tmp_path / "bad.jsonl"
    src.write_text(json.dumps({"question": "q", "answer": "no final answer"}))
    result = subprocess.run([sys.executable, str(REPO / "scripts" / "convert_gsm8k.py"),
                             "--input", str(src), "--output", str(tmp_path / "o.parquet")],
                            capture_output=True, text=True)
    assert result.returncode != 0
    assert "bad.jsonl row 0" in result.stderr and "####" in result.stderr


def test_imperfect_sft_demonstrations_keep_the_true_ground_truth():
    from jaxrl_llm.data.tasks import make_arithmetic_sft_rows
    rows = make_arithmetic_sft_rows(400, seed=3, max_operand=20, trailing_junk=0.7, off_by_one=0.2)
    answers = [r["messages"][-1]["content"] for r in rows]
    truths = [int(r["reward_model"]["ground_truth"]) for r in rows]
    junk = sum(a.endswith(".") for a in answers) / len(rows)
    off = sum(int(a.rstrip(".")) == t + 1 for a, t in zip(answers, truths)) / len(rows)
    assert 0.6 < junk < 0.8 and 0.12 < off < 0.28
    assert all(int(a.rstrip(".")) in (t, t + 1) for a, t in zip(answers, truths))
    clean = make_arithmetic_sft_rows(50, seed=3, max_operand=20)
    assert all(r["messages"][-1]["content"] == r["reward_model"]["ground_truth"] for r in clean)
    import pytest
    with pytest.raises(ValueError, match="trailing_junk"):
        make_arithmetic_sft_rows(5, seed=0, trailing_junk=1.5)
