"""Built-in scorers chosen by `data_source`, and the normalisation of any scorer's result.

A scorer is `(solution_str, ground_truth, extra_info=None) -> float | dict`; a dict follows
verl's convention: key "score" is the reward, other numeric keys are extra per-row values.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from jaxrl_llm.rewards._arithmetic import arithmetic_score
from jaxrl_llm.rewards._countdown import countdown_score
from jaxrl_llm.rewards._gsm8k import gsm8k_score
from jaxrl_llm.rewards._math import math_score
from jaxrl_llm.rewards._reasoning_gym import reasoning_gym_score

Scorer = Callable[..., Any]

SCORERS: dict[str, Scorer] = {
    "openai/gsm8k": gsm8k_score,
    "gsm8k": gsm8k_score,
    "lighteval/MATH": math_score,
    "DigitalLearningGmbH/MATH-lighteval": math_score,
    "HuggingFaceH4/MATH-500": math_score,
    "math": math_score,
    "countdown": countdown_score,
    "arithmetic": arithmetic_score,
}
PREFIX_SCORERS: dict[str, Scorer] = {  # data_source prefixes: "reasoning_gym/<dataset>"
    "reasoning_gym/": reasoning_gym_score,
}


def get_scorer(data_source: str) -> Scorer:
    """The built-in scorer for `data_source`; raises ValueError listing the known names."""
    try:
        return SCORERS[data_source]
    except KeyError:
        for prefix, scorer in PREFIX_SCORERS.items():
            if data_source.startswith(prefix):
                return scorer
        raise ValueError(f"no reward scorer for data_source {data_source!r}; known: "
                         f"{sorted(SCORERS)} and names starting with {sorted(PREFIX_SCORERS)}; "
                         f"or set custom_reward_function.path/name") from None


def default_compute_score(data_source: str, solution_str: str, ground_truth,
                          extra_info: dict | None = None):
    """verl's signature over the built-in scorers."""
    return get_scorer(data_source)(solution_str, ground_truth, extra_info)


def _is_number(value: Any) -> bool:
    return isinstance(value, (bool, int, float, np.number)) and not isinstance(value, complex)


def _finite32(value: float, what: str) -> float:
    """`value` if it is finite as the float32 the batch stores (|x| < 3.4e38), else ValueError."""
    with np.errstate(over="ignore"):
        finite = math.isfinite(value) and bool(np.isfinite(np.float32(value)))
    if not finite:
        raise ValueError(f"scorer returned a non-finite {what} {value!r} (rewards are float32: "
                         "finite and below 3.4e38 in magnitude)")
    return value


def normalize_result(result: Any) -> tuple[float, dict[str, float]]:
    """float | {"score": float, other numeric keys} -> (score, extras); TypeError/ValueError
    if the result is not a number finite in float32, or such a dict."""
    if isinstance(result, Mapping):
        if "score" not in result:
            raise TypeError(f"scorer returned a dict without 'score': keys {sorted(result)}")
        extras = {str(k): _finite32(float(v), f"value for {k!r}")
                  for k, v in result.items() if k != "score" and _is_number(v)}
        score = result["score"]
    else:
        extras, score = {}, result
    if not _is_number(score):
        raise TypeError(f"scorer returned {type(score).__name__}, expected a number")
    return _finite32(float(score), "score"), extras


def score_one(custom_fn: Scorer | None, data_source: str, solution_str: str, ground_truth,
              extra_info) -> tuple[float, dict[str, float]]:
    """Scores one response with `custom_fn` (verl's keyword call) or the built-in scorer."""
    if custom_fn is not None:
        result = custom_fn(data_source=data_source, solution_str=solution_str,
                           ground_truth=ground_truth, extra_info=extra_info)
    else:
        result = get_scorer(data_source)(solution_str, ground_truth, extra_info)
    return normalize_result(result)
