"""GSM8K scorer with verl's strict semantics.

The answer is the last "#### N" in the response's final 300 characters (N made of digits, '-',
'.', ','; commas and '$' removed) and must equal the ground truth string exactly: 1.0, else 0.0.
"""
from __future__ import annotations

import re

_CLIP_CHARS = 300
_STRICT = re.compile(r"#### (\-?[0-9\.\,]+)")


def extract_gsm8k_answer(solution_str: str) -> str | None:
    matches = _STRICT.findall(solution_str[-_CLIP_CHARS:])
    if not matches:
        return None
    return matches[-1].replace(",", "").replace("$", "")


def gsm8k_score(solution_str: str, ground_truth, extra_info=None, *, format_score: float = 0.0,
                score: float = 1.0) -> float:
    answer = extract_gsm8k_answer(solution_str)
    if answer is None:
        return 0.0
    return score if answer == str(ground_truth) else format_score
