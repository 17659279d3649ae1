"""The countdown task (TinyZero / verl style): reach a target with each given number once.

Ground truth is {"target": int, "numbers": [int, ...]}, as in verl's countdown data; every
generated problem is solvable (it is built from a random expression, kept in extra_info).
"""
from __future__ import annotations

import numpy as np

from jaxrl_llm.data._schema import PathLike, write_rows

DATA_SOURCE = "countdown"

PROMPT = ("Using the numbers {numbers}, create an equation that equals {target}. You can use "
          "basic arithmetic operations (+, -, *, /) and each number can only be used once. "
          "Show your work in <think> </think> tags. And return the final answer in "
          "<answer> </answer> tags, for example <answer> (1 + 2) / 3 </answer>.")


def _random_problem(rng: np.random.Generator, count: int, max_number: int,
                    max_target: int) -> tuple[list[int], int, str]:
    while True:
        numbers = [int(x) for x in rng.integers(1, max_number + 1, size=count)]
        value, expr = numbers[0], str(numbers[0])
        for x in numbers[1:]:
            ops = ["+", "-", "*"] + (["/"] if value % x == 0 else [])
            op = ops[int(rng.integers(len(ops)))]
            value = {"+": value + x, "-": value - x, "*": value * x,
                     "/": value // x if op == "/" else 0}[op]
            expr = f"({expr} {op} {x})"
        if 1 <= value <= max_target:
            shown = [numbers[int(i)] for i in rng.permutation(count)]
            return shown, int(value), expr[1:-1] if expr.startswith("(") else expr


def make_countdown_rows(n: int, *, seed: int, min_numbers: int = 3, max_numbers: int = 4,
                        max_number: int = 99, max_target: int = 100) -> list[dict]:
    rng = np.random.default_rng(seed)
    rows = []
    for index in range(n):
        count = int(rng.integers(min_numbers, max_numbers + 1))
        numbers, target, solution = _random_problem(rng, count, max_number, max_target)
        rows.append({
            "data_source": DATA_SOURCE,
            "prompt": [{"role": "user", "content": PROMPT.format(numbers=numbers,
                                                                 target=target)}],
            "ability": "math",
            "reward_model": {"style": "rule",
                             "ground_truth": {"target": target, "numbers": numbers}},
            "extra_info": {"index": index, "solution": solution},
        })
    return rows


def make_countdown_dataset(path: PathLike, n: int, *, seed: int, **kwargs) -> PathLike:
    """Writes `make_countdown_rows(n, seed=seed, **kwargs)` to parquet/jsonl; returns the path."""
    write_rows(path, make_countdown_rows(n, seed=seed, **kwargs))
    return path
