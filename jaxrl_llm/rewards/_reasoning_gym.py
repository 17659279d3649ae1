"""Scorer for reasoning-gym rows (`data_source` "reasoning_gym/<dataset>").

The answer is extracted as the row asks (`extra_info.answer_extraction`, see
`jaxrl_llm.data.tasks._reasoning_gym`: the last <answer>...</answer>, or for "last_number" that
else the last number) and graded by the dataset's own `score_answer(answer, entry)`, with the
dataset built from the row's `dataset_config` (once per process). No answer found: 0.0.
Returns {"score": score_answer's value in [0, 1], "acc": 1.0 iff it is 1.0, "answered": 1.0 iff
an answer was found}; `acc` is what validation reports as the core metric.
"""
from __future__ import annotations

import functools
import json


@functools.lru_cache(maxsize=64)
def _score_fn(name: str, config_json: str):
    from jaxrl_llm.data.tasks._reasoning_gym import _create

    return _create(name, 1, 0, json.loads(config_json)).score_answer


def reasoning_gym_score(solution_str: str, ground_truth, extra_info=None) -> dict:
    from jaxrl_llm.data.tasks._reasoning_gym import extract_reasoning_gym_answer

    info = extra_info or {}
    if "entry" not in info or "dataset" not in info:
        raise ValueError("a reasoning_gym row needs extra_info.dataset and extra_info.entry (rows "
                         "written by data.builtin_task='reasoning_gym:<dataset>')")
    entry = json.loads(info["entry"]) if isinstance(info["entry"], str) else dict(info["entry"])
    if ground_truth is not None and str(ground_truth) != str(entry["answer"]):
        entry["answer"] = str(ground_truth)  # reward_model.ground_truth wins over the copy
    answer = extract_reasoning_gym_answer(solution_str, info.get("answer_extraction", "answer_tag"))
    if answer is None:
        return {"score": 0.0, "acc": 0.0, "answered": 0.0}
    score = float(_score_fn(info["dataset"], info.get("dataset_config") or "{}")(answer, entry))
    return {"score": score, "acc": float(score == 1.0), "answered": 1.0}
