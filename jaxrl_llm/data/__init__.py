"""Data: verl-schema prompt files -> tokenized prompts -> resumable grain batches; SFT data;
the RL `Batch` (verl's fields) that controller and workers exchange.

Scoring responses is `jaxrl_llm.rewards`'s job; tokenizers come from `jaxrl_llm.models`.
"""
from jaxrl_llm.data import tasks
from jaxrl_llm.data._batch import Batch, MissingFieldError, RolloutResult
from jaxrl_llm.data._loader import PromptLoader
from jaxrl_llm.data._rl_dataset import PromptExample, RLDataset, collate_prompts
from jaxrl_llm.data._builtin import builtin_folder, builtin_splits, prepare_builtin_files
from jaxrl_llm.data._schema import DataError, count_rows, read_raw_rows, read_rows, validate_row, write_rows
from jaxrl_llm.data._sft import SFTDataset, SFTExample, collate_sft
from jaxrl_llm.data._tokenizer import Tokenizer

__all__ = [
    "Batch",
    "DataError",
    "MissingFieldError",
    "PromptExample",
    "PromptLoader",
    "RLDataset",
    "RolloutResult",
    "SFTDataset",
    "SFTExample",
    "Tokenizer",
    "builtin_folder",
    "builtin_splits",
    "collate_prompts",
    "collate_sft",
    "count_rows",
    "prepare_builtin_files",
    "read_raw_rows",
    "read_rows",
    "tasks",
    "validate_row",
    "write_rows",
]
