"""The SFT warm start's data, shared by the RL job (`RLTrainer.run_sft`) and `python -m jaxrl_llm.sft`:
the dataset from `sft.train_files` (or a built-in task's demonstrations: arithmetic, arithmetic_tools)
and its batches."""
from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from jaxrl_llm import data
from jaxrl_llm.config import ConfigError, RunConfig


def sft_dataset(run: RunConfig, tokenizer) -> data.SFTDataset:
    """The rows of `sft.train_files` (all files, in order), else the built-in task's
    demonstrations; ConfigError when there are neither."""
    s, d = run.sft, run.data
    if s.train_files:
        # one file: given by path, so a bad row's error names it; several: their rows in order
        source = (s.train_files[0] if len(s.train_files) == 1
                  else [row for path in s.train_files for row in data.read_raw_rows(path)])
        return data.SFTDataset(source, tokenizer, max_length=s.max_length, messages_key=s.messages_key)
    if d.builtin_task == "arithmetic_tools":
        rows = data.tasks.make_tool_arithmetic_sft_rows(
            s.builtin_size, d.seed + 7, max_operand=d.builtin_max_operand, no_tool=s.builtin_no_tool,
            trailing_junk=s.builtin_trailing_junk)
        return data.SFTDataset(rows, tokenizer, max_length=s.max_length)
    if d.builtin_task == "arithmetic":
        rows = data.tasks.make_arithmetic_sft_rows(
            s.builtin_size, d.seed + 7, max_operand=d.builtin_max_operand,
            off_by_one=s.builtin_off_by_one, trailing_junk=s.builtin_trailing_junk)
        return data.SFTDataset(rows, tokenizer, max_length=s.max_length)
    raise ConfigError(f"sft.train_files is empty and data.builtin_task={d.builtin_task!r} has no "
                      f"demonstrations (only {' and '.join(data.tasks.SFT_DEMO_TASKS)} do): give sft.train_files")


def sft_batches(run: RunConfig, dataset, pad_token_id: int) -> Iterator[data.Batch]:
    """`sft.steps` batches of `sft.batch_size` rows drawn with the trainer's seed (deterministic)."""
    s = run.sft
    rng = np.random.default_rng(run.trainer.seed)
    for _ in range(s.steps):
        idx = rng.choice(len(dataset), size=s.batch_size, replace=len(dataset) < s.batch_size)
        batch = data.collate_sft([dataset[int(i)] for i in idx], pad_token_id, s.max_length)
        yield data.Batch(**{k: np.asarray(v) for k, v in batch.items()})
