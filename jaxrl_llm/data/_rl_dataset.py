"""Tokenized RL prompts: verl-schema rows -> `PromptExample`s, plus left-padded collation.

Rows are read and validated by `_schema.py`; the order in which prompts are served (shuffling,
epochs, resumable state) is `_loader.py`'s job.
"""
from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxrl_llm.data._schema import DataError, PathLike, read_rows
from jaxrl_llm.data._tokenizer import Tokenizer

logger = logging.getLogger(__name__)

TRUNCATIONS = ("error", "left", "right")


@dataclasses.dataclass(frozen=True)
class PromptExample:
    """One tokenized prompt.

    `ground_truth` is a str for most tasks (numbers in the file become str); a dict (e.g.
    countdown's {"target", "numbers"}) is kept as is. `index` is the row's position among all
    rows of the dataset's files, before filtering.
    """

    prompt_ids: list[int]
    raw_prompt: list[dict]
    data_source: str
    ground_truth: Any
    extra_info: dict
    ability: str
    index: int
    agent_name: str = ""  # verl's `agent_name` column: which agent loop runs this row ("" = default)


def _normalize_truth(truth: Any) -> Any:
    if isinstance(truth, float) and truth.is_integer():
        return str(int(truth))
    if isinstance(truth, (int, float)):
        return str(truth)
    return truth


def _agent_name(row: dict, index: int) -> str:
    name = row.get("agent_name") or ""
    if not isinstance(name, str):
        raise DataError(f"row {index}: agent_name must be a string naming an agent loop, got "
                        f"{type(name).__name__} {name!r}")
    return name


class RLDataset(Sequence):
    """Prompts from verl-schema parquet/jsonl files, rendered with the chat template and tokenized.

    Prompts longer than `max_prompt_length` tokens are dropped when `filter_overlong_prompts`
    (counted in `num_filtered` and logged); otherwise `truncation` decides: "error" raises naming
    the file and row, "left" keeps the last tokens, "right" the first. `seed` and `shuffle` are
    the defaults a `PromptLoader` over this dataset uses.
    """

    def __init__(self, path_or_paths: PathLike | Sequence[PathLike], tokenizer: Tokenizer, *,
                 max_prompt_length: int, filter_overlong_prompts: bool = True,
                 truncation: str = "error", prompt_key: str = "prompt", seed: int = 0,
                 shuffle: bool = True):
        if truncation not in TRUNCATIONS:
            raise ValueError(f"truncation must be one of {TRUNCATIONS}, got {truncation!r}")
        if max_prompt_length <= 0:
            raise ValueError(f"max_prompt_length must be positive, got {max_prompt_length}")
        paths = ([path_or_paths] if isinstance(path_or_paths, (str, os.PathLike))
                 else list(path_or_paths))
        if not paths:
            raise ValueError("RLDataset needs at least one data file")
        self.max_prompt_length = max_prompt_length
        self.seed = seed
        self.shuffle = shuffle
        self.num_rows = 0
        self.num_filtered = 0
        self.examples: list[PromptExample] = []
        for path in paths:
            for row_index, row in enumerate(read_rows(path, prompt_key=prompt_key)):
                try:
                    example = self._make_example(row, tokenizer, prompt_key, self.num_rows)
                except DataError:
                    raise
                except ValueError as e:  # e.g. a character the tokenizer does not know
                    raise DataError(f"{os.fspath(path)} row {row_index}: {e}") from e
                ids = example.prompt_ids
                if len(ids) > max_prompt_length:
                    if filter_overlong_prompts:
                        self.num_filtered += 1
                        self.num_rows += 1
                        continue
                    if truncation == "error":
                        raise DataError(
                            f"{os.fspath(path)} row {row_index}: prompt has {len(ids)} tokens, "
                            f"more than max_prompt_length={max_prompt_length}; raise the limit, "
                            "set filter_overlong_prompts=True or truncation='left'|'right'")
                    ids = ids[-max_prompt_length:] if truncation == "left" else (
                        ids[:max_prompt_length])
                    example = dataclasses.replace(example, prompt_ids=ids)
                self.examples.append(example)
                self.num_rows += 1
        logger.info("RLDataset: kept %d of %d prompts from %s; dropped %d longer than "
                    "max_prompt_length=%d tokens (filter_overlong_prompts=%s)",
                    len(self.examples), self.num_rows, [os.fspath(p) for p in paths],
                    self.num_filtered, max_prompt_length, filter_overlong_prompts)
        if not self.examples:
            raise DataError(f"no prompts left in {[os.fspath(p) for p in paths]} after "
                            f"filtering {self.num_filtered} prompts longer than "
                            f"max_prompt_length={max_prompt_length}")

    @staticmethod
    def _make_example(row: dict, tokenizer: Tokenizer, prompt_key: str,
                      index: int) -> PromptExample:
        messages = [dict(m) for m in row[prompt_key]]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        return PromptExample(
            prompt_ids=list(tokenizer.encode(text)),
            raw_prompt=messages,
            data_source=row["data_source"],
            ground_truth=_normalize_truth(row["reward_model"]["ground_truth"]),
            extra_info=dict(row.get("extra_info") or {}),
            ability=row.get("ability") or "",
            index=index,
            agent_name=_agent_name(row, index),
        )

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, i):
        return self.examples[i]


def collate_prompts(examples: Sequence[PromptExample], pad_token_id: int,
                    max_prompt_length: int) -> dict[str, np.ndarray]:
    """Left-pads prompts into verl's batch fields.

    Returns input_ids int32[b, p], attention_mask int32[b, p] and position_ids int32[b, p]
    (cumsum(mask) - 1, clipped at 0), where p = max_prompt_length.
    """
    b = len(examples)
    input_ids = np.full((b, max_prompt_length), pad_token_id, dtype=np.int32)
    attention_mask = np.zeros((b, max_prompt_length), dtype=np.int32)
    for i, example in enumerate(examples):
        n = len(example.prompt_ids)
        if n > max_prompt_length:
            raise ValueError(f"prompt of row index {example.index} has {n} tokens, more than "
                             f"max_prompt_length={max_prompt_length}")
        if n:
            input_ids[i, max_prompt_length - n:] = example.prompt_ids
            attention_mask[i, max_prompt_length - n:] = 1
    position_ids = np.clip(np.cumsum(attention_mask, axis=1) - 1, 0, None).astype(np.int32)
    return {"input_ids": input_ids, "attention_mask": attention_mask,
            "position_ids": position_ids}
