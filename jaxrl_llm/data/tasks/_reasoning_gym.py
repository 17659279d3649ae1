"""reasoning-gym datasets as verl-schema rows (`data.builtin_task = "reasoning_gym:<dataset>"`).

reasoning-gym (`pip install 'jaxrl-llm[gym]'`, Apache-2.0) generates procedural, verifiable
problems (`chain_sum`, `basic_arithmetic`, `gsm_symbolic`, `countdown`, ...) and scores answers with
each dataset's own `score_answer`. This module draws one pool of problems from
`reasoning_gym.create_dataset(name, size=..., seed=seed, **dataset_config)`, drops repeated
questions, and splits it: the first `train_size` problems are the train split, the next
`val_size` the held-out split, so the two never share a question.

Row layout:
  data_source   "reasoning_gym/<dataset>" (the reward registry sends it to
                `jaxrl_llm.rewards.reasoning_gym_score`)
  prompt        [{"role": "user", "content": question + " " + instruction}]; with a
                `system_prompt` task option, {"role": "system", "content": system_prompt}
                comes first (e.g. a tool's description for a model whose chat template
                does not render `tools=`, as in configs/grpo_smollm2_gym.py:tools)
  ability       "reasoning"
  reward_model  {"style": "rule", "ground_truth": the dataset's answer string}
  extra_info    {"split", "index", "dataset", "dataset_config" (JSON), "answer_extraction",
                 "entry" (JSON of the whole reasoning-gym entry: question, answer, metadata;
                 `score_answer` needs it)}

The answer format (`answer_extraction` in the task options):
  "answer_tag" (default, reasoning-gym's convention): the prompt ends with
      "Put your final answer inside <answer></answer> tags." and the answer is the text of the
      last <answer>...</answer> in the response; a response without one scores 0.
  "last_number": the prompt ends with "End your response with the final answer." and the
      answer is the last <answer>...</answer> if there is one, else the last number in the
      response (commas removed). For numeric datasets and small models that do not follow the
      tag format (SmolLM2-135M-Instruct never writes the tags).
"""
from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping
from typing import Any

from jaxrl_llm.data._schema import DataError, PathLike, write_rows

TASK_PREFIX = "reasoning_gym:"
DATA_SOURCE_PREFIX = "reasoning_gym/"
INSTRUCTIONS = {
    "answer_tag": "Put your final answer inside <answer></answer> tags.",
    "last_number": "End your response with the final answer.",
}
OUR_OPTIONS = ("answer_extraction", "system_prompt")  # task options that are ours, not the dataset's
_TAG = re.compile(r"<answer>\s?(.*?)\s?</answer>", re.DOTALL)  # reasoning_gym.utils.extract_answer
_NUMBER = re.compile(r"(?<![\d.])[-+]?\d+(?:\.\d+)?")  # "5-3" gives 5 and 3, "-3." gives -3


def import_reasoning_gym():
    try:
        import reasoning_gym
    except ImportError as e:
        raise DataError(f"reasoning-gym is not installed ({e}): pip install 'jaxrl-llm[gym]' "
                        f"(reasoning-gym==0.1.25)") from None
    return reasoning_gym


def dataset_name(task: str) -> str | None:
    """"reasoning_gym:chain_sum" -> "chain_sum"; None for other tasks."""
    if not task.startswith(TASK_PREFIX):
        return None
    name = task[len(TASK_PREFIX):]
    if not re.fullmatch(r"[a-z0-9_]+", name):
        raise DataError(f"data.builtin_task={task!r}: expected 'reasoning_gym:<dataset>' with a "
                        f"reasoning-gym dataset name such as chain_sum")
    return name


def parse_options(options: str | Mapping | None) -> tuple[dict, str, str | None]:
    """(dataset config kwargs, answer_extraction, system_prompt) from the task options (a JSON
    object string or a dict)."""
    if options is None or options == "":
        options = {}
    if isinstance(options, str):
        try:
            options = json.loads(options)
        except ValueError as e:
            raise DataError(f"data.builtin_task_config is not JSON: {e}") from None
    if not isinstance(options, Mapping):
        raise DataError(f"data.builtin_task_config must be a JSON object, got {options!r}")
    kwargs = dict(options)
    mode = kwargs.pop("answer_extraction", "answer_tag")
    system_prompt = kwargs.pop("system_prompt", None)
    if system_prompt is not None and (not isinstance(system_prompt, str) or not system_prompt.strip()):
        raise DataError(f"data.builtin_task_config: system_prompt must be a non-empty string, got "
                        f"{system_prompt!r}")
    if mode not in INSTRUCTIONS:
        raise DataError(f"data.builtin_task_config: answer_extraction={mode!r} is not one of "
                        f"{sorted(INSTRUCTIONS)}")
    for key in ("size", "seed"):
        if key in kwargs:
            raise DataError(f"data.builtin_task_config: {key!r} comes from data.builtin_train_size/"
                            f"builtin_val_size and data.seed, not from the task options")
    return kwargs, mode, system_prompt


def _jsonable(x: Any) -> Any:
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return _jsonable(dataclasses.asdict(x))
    if isinstance(x, Mapping):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple, set, frozenset)):
        return [_jsonable(v) for v in (sorted(x, key=repr) if isinstance(x, (set, frozenset)) else x)]
    if hasattr(x, "item") and callable(x.item) and getattr(x, "shape", None) == ():
        return x.item()  # numpy scalars
    if hasattr(x, "tolist"):
        return x.tolist()
    if x is None or isinstance(x, (str, int, float, bool)):
        return x
    return str(x)


def _create(name: str, size: int, seed: int, kwargs: dict):
    rg = import_reasoning_gym()
    from reasoning_gym.factory import DATASETS

    if name not in DATASETS:
        raise DataError(f"reasoning-gym has no dataset {name!r}; it has {sorted(DATASETS)}")
    try:
        return rg.create_dataset(name, size=size, seed=seed, **kwargs)
    except (TypeError, AssertionError, ValueError) as e:
        raise DataError(f"reasoning-gym dataset {name!r} rejected the config {kwargs}: {e}") from None


def _pool(name: str, total: int, seed: int, kwargs: dict) -> list[dict]:
    """`total` entries with distinct questions, drawn in order from one seeded dataset."""
    size = total
    for _ in range(4):
        ds = _create(name, size, seed, kwargs)
        seen, entries = set(), []
        for entry in ds:
            if entry["question"] not in seen:
                seen.add(entry["question"])
                entries.append(entry)
                if len(entries) == total:
                    return entries
        size *= 2
    raise DataError(f"reasoning-gym {name} {kwargs} gives only {len(entries)} distinct questions "
                    f"out of {size // 2} drawn; ask for fewer (builtin_train_size + builtin_val_size"
                    f" = {total}) or widen the config")


def make_reasoning_gym_rows(name: str, *, split: str, train_size: int, val_size: int, seed: int,
                            options: str | Mapping | None = None) -> list[dict]:
    """The `split` ("train" or "test") rows of one seeded pool of train_size + val_size
    distinct problems (see the module docstring)."""
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    kwargs, mode, system_prompt = parse_options(options)
    system = [{"role": "system", "content": system_prompt}] if system_prompt else []
    pool = _pool(name, train_size + val_size, seed, kwargs)
    part = pool[:train_size] if split == "train" else pool[train_size:]
    config_json = json.dumps(_jsonable(kwargs), sort_keys=True)
    rows = []
    for index, entry in enumerate(part):
        entry = _jsonable(entry)
        rows.append({
            "data_source": DATA_SOURCE_PREFIX + name,
            "prompt": system + [{"role": "user", "content": f"{entry['question']} {INSTRUCTIONS[mode]}"}],
            "ability": "reasoning",
            "reward_model": {"style": "rule", "ground_truth": str(entry["answer"])},
            "extra_info": {"split": split, "index": index, "dataset": name,
                           "dataset_config": config_json, "answer_extraction": mode,
                           "entry": json.dumps(entry, sort_keys=True)},
        })
    return rows


def make_reasoning_gym_dataset(path: PathLike, name: str, **kwargs) -> PathLike:
    """Writes `make_reasoning_gym_rows(name, **kwargs)` to parquet/jsonl; returns the path."""
    write_rows(path, make_reasoning_gym_rows(name, **kwargs))
    return path


def extract_reasoning_gym_answer(solution_str: str, mode: str = "answer_tag") -> str | None:
    """The answer a response gives, by the row's `answer_extraction` (module docstring)."""
    matches = _TAG.findall(solution_str)
    if matches:
        return matches[-1].strip()
    if mode == "last_number":
        numbers = _NUMBER.findall(solution_str.replace(",", ""))
        return numbers[-1] if numbers else None
    return None
