"""Scorer for the built-in arithmetic task (`jaxrl_llm.data.tasks.make_arithmetic_dataset`).

1.0 iff the response, with surrounding whitespace stripped, is an integer literal
(optional sign, digits only) equal to the ground truth; anything else (extra text, "9 5",
"95.0", empty) scores 0.0. The response should be the decoded completion without EOS/padding.
"""
from __future__ import annotations

import re

_INT = re.compile(r"[+-]?\d+")


def arithmetic_score(solution_str: str, ground_truth, extra_info=None) -> float:
    text = solution_str.strip()
    if not _INT.fullmatch(text):
        return 0.0
    return 1.0 if int(text) == int(str(ground_truth).strip()) else 0.0
