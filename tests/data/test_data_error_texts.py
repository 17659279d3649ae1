"""Errors a user causes with a data file name the file and the row (issue 17, item 7)."""
import pytest

from jaxrl_llm.data import DataError, PromptLoader, RLDataset, write_rows
from jaxrl_llm.models import CharTokenizer


def _row(content):
    return {"data_source": "arithmetic", "prompt": [{"role": "user", "content": content}],
            "ability": "arithmetic", "reward_model": {"ground_truth": "1"}, "extra_info": {}}


def test_non_utf8_jsonl_names_the_file_and_line(tmp_path):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(b'{"a": 1}\n{"a": "caf\xe9"}\n')
    with pytest.raises(DataError, match=rf"{path} line 2 .*not UTF-8"):
        RLDataset(path, CharTokenizer(), max_prompt_length=64)


def test_character_outside_the_tokenizer_names_the_file_and_row(tmp_path):
    path = tmp_path / "a.jsonl"
    write_rows(path, [_row("1+2="), _row("1\u00b72=")])
    with pytest.raises(DataError, match=rf"{path} row 1: CharTokenizer: character"):
        RLDataset(path, CharTokenizer(), max_prompt_length=64)


def test_too_small_dataset_names_a_real_config_field(tmp_path):
    path = tmp_path / "a.jsonl"
    write_rows(path, [_row("1+2=")])
    ds = RLDataset(path, CharTokenizer(), max_prompt_length=64)
    with pytest.raises(ValueError, match="data.train_batch_size") as e:
        PromptLoader(ds, 4)
    assert "drop_last" not in str(e.value)
