"""verl-schema files: nested parquet written by pyarrow reads back; bad rows name file/row/field."""
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from jaxrl_llm.data import DataError, read_rows, validate_row, write_rows


def _row(i, **overrides):
    row = {
        "data_source": "openai/gsm8k",
        "prompt": [{"role": "system", "content": "be brief"},
                   {"role": "user", "content": f"what is {i}+1?"}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": str(i + 1)},
        "extra_info": {"split": "train", "index": i},
    }
    row.update(overrides)
    return row


def test_reads_verl_parquet_with_nested_prompt_and_reward_model_columns(tmp_path):
    path = tmp_path / "train.parquet"
    table = pa.Table.from_pylist([_row(0), _row(1)])
    assert pa.types.is_list(table.schema.field("prompt").type)
    assert pa.types.is_struct(table.schema.field("reward_model").type)
    pq.write_table(table, path)
    rows = read_rows(path)
    assert len(rows) == 2
    assert rows[1]["prompt"][1] == {"role": "user", "content": "what is 1+1?"}
    assert rows[1]["reward_model"]["ground_truth"] == "2"
    assert rows[0]["extra_info"] == {"split": "train", "index": 0}


def test_reads_jsonl_and_write_rows_round_trips(tmp_path):
    path = tmp_path / "rows.jsonl"
    write_rows(path, [_row(3)])
    assert json.loads(path.read_text())["data_source"] == "openai/gsm8k"
    assert read_rows(path) == [_row(3)]
    write_rows(tmp_path / "rows.parquet", [_row(3), _row(4)])
    assert read_rows(tmp_path / "rows.parquet")[1] == _row(4)


@pytest.mark.parametrize("bad, field", [
    ({"data_source": None}, "data_source"),
    ({"data_source": 3}, "data_source"),
    ({"prompt": "just a string"}, "prompt"),
    ({"prompt": [{"role": "user"}]}, "prompt[0].content"),
    ({"prompt": [{"role": "user", "content": 5}]}, "prompt[0].content"),
    ({"reward_model": {"style": "rule"}}, "reward_model.ground_truth"),
    ({"reward_model": "42"}, "reward_model"),
    ({"extra_info": [1, 2]}, "extra_info"),
    ({"ability": 1}, "ability"),
])
def test_malformed_row_error_names_file_row_and_field(tmp_path, bad, field):
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in [_row(0), _row(1), _row(2, **bad)]))
    with pytest.raises(DataError) as info:
        read_rows(path)
    message = str(info.value)
    assert "bad.jsonl row 2" in message
    assert field in message


def test_missing_field_in_parquet_names_row(tmp_path):
    path = tmp_path / "missing.parquet"
    rows = [_row(0), _row(1)]
    del rows[1]["reward_model"]
    pq.write_table(pa.Table.from_pylist(rows), path)  # row 1 gets reward_model = null
    with pytest.raises(DataError, match=r"missing.parquet row 1: required field 'reward_model'"):
        read_rows(path)


def test_validate_row_accepts_optional_fields_absent():
    row = _row(0)
    del row["ability"], row["extra_info"]
    validate_row(row, path="x.parquet", index=0)
    with pytest.raises(DataError, match="x.parquet row 7"):
        validate_row({**row, "prompt": []}, path="x.parquet", index=7)


def test_invalid_json_line_names_row(tmp_path):
    path = tmp_path / "broken.jsonl"
    path.write_text(json.dumps(_row(0)) + "\n{not json\n")
    with pytest.raises(DataError, match=r"broken.jsonl row 1 \(line 2\)"):
        read_rows(path)
