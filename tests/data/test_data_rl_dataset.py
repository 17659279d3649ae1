"""RLDataset: chat template + tokenization, overlong filtering/truncation, left-padded collation."""
import logging

import numpy as np
import pytest

from jaxrl_llm.data import DataError, RLDataset, collate_prompts, write_rows


def _row(content, truth="1", source="arithmetic"):
    return {"data_source": source, "prompt": [{"role": "user", "content": content}],
            "ability": "arithmetic", "reward_model": {"ground_truth": truth},
            "extra_info": {"k": content}}


# "<user>" + content + "\n<assistant>" = 18 + len(content) bytes
def _prompt_len(content):
    return len(f"<user>{content}\n<assistant>")


def test_prompts_are_rendered_with_chat_template_and_tokenized(tmp_path, tokenizer):
    path = tmp_path / "a.jsonl"  # jsonl: ground-truth types may differ between rows
    write_rows(path, [_row("1+2=", "3"), _row("4+4=", 8.0)])
    ds = RLDataset(path, tokenizer, max_prompt_length=64)
    assert len(ds) == 2
    ex = ds[0]
    assert tokenizer.decode(ex.prompt_ids) == "<user>1+2=\n<assistant>"
    assert ex.raw_prompt == [{"role": "user", "content": "1+2="}]
    assert (ex.data_source, ex.ground_truth, ex.ability, ex.index) == ("arithmetic", "3",
                                                                        "arithmetic", 0)
    assert ex.extra_info == {"k": "1+2="}
    assert ds[1].ground_truth == "8"  # a float ground truth that is an integer becomes "8"


def test_overlong_prompts_are_filtered_counted_and_logged(tmp_path, tokenizer, caplog):
    limit = _prompt_len("12345")
    rows = [_row("1"), _row("123456"), _row("12345"), _row("1234567890")]
    write_rows(tmp_path / "a.jsonl", rows[:2])
    write_rows(tmp_path / "b.jsonl", rows[2:])
    with caplog.at_level(logging.INFO, logger="jaxrl_llm.data"):
        ds = RLDataset([tmp_path / "a.jsonl", tmp_path / "b.jsonl"], tokenizer,
                       max_prompt_length=limit)
    assert ds.num_filtered == 2
    assert [ex.raw_prompt[0]["content"] for ex in ds] == ["1", "12345"]
    assert [ex.index for ex in ds] == [0, 2]
    assert "dropped 2" in caplog.text and f"max_prompt_length={limit}" in caplog.text


def test_truncation_error_left_right(tmp_path, tokenizer):
    path = tmp_path / "a.jsonl"
    write_rows(path, [_row("1"), _row("123456")])
    limit = _prompt_len("12345")
    with pytest.raises(DataError, match=r"a.jsonl row 1: prompt has \d+ tokens"):
        RLDataset(path, tokenizer, max_prompt_length=limit, filter_overlong_prompts=False)
    full = tokenizer.encode("<user>123456\n<assistant>")
    left = RLDataset(path, tokenizer, max_prompt_length=limit, filter_overlong_prompts=False,
                     truncation="left")
    right = RLDataset(path, tokenizer, max_prompt_length=limit, filter_overlong_prompts=False,
                      truncation="right")
    assert left[1].prompt_ids == full[-limit:] and right[1].prompt_ids == full[:limit]
    assert left.num_filtered == 0 and len(left) == 2
    with pytest.raises(ValueError, match="truncation"):
        RLDataset(path, tokenizer, max_prompt_length=limit, truncation="middle")


def test_collate_prompts_left_pads_with_verl_names(tmp_path, tokenizer):
    write_rows(tmp_path / "a.jsonl", [_row("1"), _row("123")])
    ds = RLDataset(tmp_path / "a.jsonl", tokenizer, max_prompt_length=30)
    batch = collate_prompts([ds[0], ds[1]], tokenizer.pad_token_id, 30)
    n0, n1 = _prompt_len("1"), _prompt_len("123")
    assert batch["input_ids"].shape == (2, 30) and batch["input_ids"].dtype == np.int32
    assert batch["input_ids"][0, 30 - n0:].tolist() == ds[0].prompt_ids
    assert (batch["input_ids"][0, : 30 - n0] == tokenizer.pad_token_id).all()
    assert batch["attention_mask"][1].tolist() == [0] * (30 - n1) + [1] * n1
    assert batch["position_ids"][1].tolist() == [0] * (30 - n1) + list(range(n1))
    assert batch["position_ids"].dtype == np.int32
    with pytest.raises(ValueError, match="max_prompt_length=5"):
        collate_prompts([ds[0]], tokenizer.pad_token_id, 5)
