"""Reading, validating and writing rows in verl's RL data schema.

A row is a dict with
  data_source: str                      which scorer grades it (see `jaxrl_llm.rewards`)
  prompt: list of {"role": str, "content": str}   chat messages (the key can be renamed)
  reward_model: {"ground_truth": str | number | dict, "style": ...}
  ability: str                          optional, default ""
  extra_info: dict | None               optional, default {}
Files are parquet (nested columns as pyarrow/pandas/HF `datasets` write them) or jsonl. Any
problem is reported as a `DataError` naming the file, the row index (0-based) and the field.
Tokenization and batching are left to `_rl_dataset.py` and `_loader.py`.
"""
from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

PathLike = str | os.PathLike


class DataError(ValueError):
    """A data file or row is malformed; the message names the file, row and field."""


def _where(path: PathLike | None, index: int | None) -> str:
    file = os.fspath(path) if path is not None else "<rows>"
    return f"{file} row {index}" if index is not None else file


def _is_sequence(value: Any) -> bool:
    return isinstance(value, (list, tuple, np.ndarray))


def validate_messages(messages: Any, *, field: str, path: PathLike | None,
                      index: int | None) -> None:
    """Checks `messages` is a non-empty list of {"role": str, "content": str}."""
    where = _where(path, index)
    if not _is_sequence(messages):
        raise DataError(f"{where}: field {field!r} must be a list of chat messages "
                        f"({{'role': ..., 'content': ...}}), got {type(messages).__name__}")
    if len(messages) == 0:
        raise DataError(f"{where}: field {field!r} is an empty list of messages")
    for j, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise DataError(f"{where}: field {field}[{j}] must be a dict with 'role' and "
                            f"'content', got {type(message).__name__}")
        for key in ("role", "content"):
            if key not in message or message[key] is None:
                raise DataError(f"{where}: field {field}[{j}].{key} is missing")
            if not isinstance(message[key], str):
                raise DataError(f"{where}: field {field}[{j}].{key} must be a str, got "
                                f"{type(message[key]).__name__}")


def validate_row(row: Any, *, path: PathLike | None, index: int | None,
                 prompt_key: str = "prompt") -> None:
    """Raises `DataError` naming `path`, `index` and the field if `row` breaks verl's schema."""
    where = _where(path, index)
    if not isinstance(row, Mapping):
        raise DataError(f"{where}: a row must be a dict, got {type(row).__name__}")
    for key in ("data_source", prompt_key, "reward_model"):
        if key not in row or row[key] is None:
            raise DataError(f"{where}: required field {key!r} is missing "
                            f"(present: {sorted(row)})")
    if not isinstance(row["data_source"], str):
        raise DataError(f"{where}: field 'data_source' must be a str, got "
                        f"{type(row['data_source']).__name__}")
    validate_messages(row[prompt_key], field=prompt_key, path=path, index=index)
    reward_model = row["reward_model"]
    if not isinstance(reward_model, Mapping):
        raise DataError(f"{where}: field 'reward_model' must be a dict with 'ground_truth', "
                        f"got {type(reward_model).__name__}")
    truth = reward_model.get("ground_truth")
    if truth is None:
        raise DataError(f"{where}: required field 'reward_model.ground_truth' is missing")
    if isinstance(truth, bool) or not isinstance(truth, (str, int, float, Mapping, list)):
        raise DataError(f"{where}: field 'reward_model.ground_truth' must be a str, number or "
                        f"dict, got {type(truth).__name__}")
    ability = row.get("ability")
    if ability is not None and not isinstance(ability, str):
        raise DataError(f"{where}: field 'ability' must be a str, got {type(ability).__name__}")
    extra = row.get("extra_info")
    if extra is not None and not isinstance(extra, Mapping):
        raise DataError(f"{where}: field 'extra_info' must be a dict, got "
                        f"{type(extra).__name__}")


def read_raw_rows(path: PathLike) -> list[dict]:
    """Rows of a parquet, jsonl or json file (a list or one object per line), unvalidated."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"data file not found: {path}")
    if path.endswith(".parquet"):
        try:
            return pq.read_table(path).to_pylist()
        except (pa.ArrowException, OSError) as e:
            raise DataError(f"{path}: cannot read as parquet: {e}") from e
    if path.endswith((".jsonl", ".json")):
        return _read_json_rows(path)
    raise DataError(f"{path}: unknown data file type; use .parquet, .jsonl or .json")


def count_rows(path: PathLike) -> int:
    """Rows in a data file (parquet: from its footer, without reading the columns)."""
    if os.fspath(path).endswith(".parquet") and os.path.exists(path):
        try:
            return pq.ParquetFile(path).metadata.num_rows
        except (pa.ArrowException, OSError) as e:
            raise DataError(f"{os.fspath(path)}: cannot read as parquet: {e}") from e
    return len(read_raw_rows(path))


def _read_json_rows(path: str) -> list[dict]:
    with open(path, "rb") as f:
        raw = f.read()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[:e.start].count(b"\n") + 1
        raise DataError(f"{path} line {line} (byte {e.start}): not UTF-8 text ({e.reason}); "
                        "re-encode the file as UTF-8") from None
    if text.lstrip().startswith("["):
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}: invalid JSON: {e}") from e
        return list(rows)
    rows = []
    for line_no, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as e:
            raise DataError(f"{path} row {len(rows)} (line {line_no}): invalid JSON: {e}") from e
    return rows


def read_rows(path: PathLike, *, prompt_key: str = "prompt") -> list[dict]:
    """Reads and validates a verl-schema parquet/jsonl file; errors name file, row and field."""
    rows = read_raw_rows(path)
    for index, row in enumerate(rows):
        validate_row(row, path=path, index=index, prompt_key=prompt_key)
    return rows


def write_rows(path: PathLike, rows: Sequence[Mapping]) -> None:
    """Writes rows to `path` as parquet (nested columns) or jsonl, by the file's suffix."""
    path = os.fspath(path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    if path.endswith(".parquet"):
        pq.write_table(pa.Table.from_pylist([dict(r) for r in rows]), path)
    elif path.endswith(".jsonl"):
        with open(path, "w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
    else:
        raise DataError(f"{path}: unknown data file type; use .parquet or .jsonl")
