"""Countdown scorer (verl / TinyZero semantics).

The equation is the last <answer>...</answer> in the response. No equation: 0.0. An equation
that is not +-*/ arithmetic over integer literals, does not use each given number exactly once,
or whose value misses the target: `format_score` (0.1). Value within 1e-5 of the target: 1.0.
Ground truth is {"target": int, "numbers": [int]} (a JSON string of it is accepted too). The
equation is evaluated by walking its syntax tree, never by `eval`.
"""
from __future__ import annotations

import ast
import json
import operator
import re

_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_BINOPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
           ast.Div: operator.truediv}


def extract_countdown_equation(solution_str: str) -> str | None:
    for marker in ("Assistant:", "<|im_start|>assistant"):  # verl decodes prompt + response
        if marker in solution_str:
            solution_str = solution_str.split(marker, 1)[1]
    matches = _ANSWER.findall(solution_str)
    return matches[-1].strip() if matches else None


def _evaluate(node: ast.AST, used: list[int]) -> float:
    if isinstance(node, ast.Expression):
        return _evaluate(node.body, used)
    if isinstance(node, ast.Constant) and type(node.value) is int:
        used.append(node.value)
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        return _BINOPS[type(node.op)](_evaluate(node.left, used), _evaluate(node.right, used))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _evaluate(node.operand, used)
        return -value if isinstance(node.op, ast.USub) else value
    raise ValueError(f"not allowed in a countdown equation: {ast.dump(node)}")


def countdown_score(solution_str: str, ground_truth, extra_info=None, *,
                    format_score: float = 0.1, score: float = 1.0) -> float:
    if isinstance(ground_truth, str):
        ground_truth = json.loads(ground_truth)
    target, numbers = ground_truth["target"], [int(x) for x in ground_truth["numbers"]]
    equation = extract_countdown_equation(solution_str)
    if equation is None:
        return 0.0
    used: list[int] = []
    try:
        value = _evaluate(ast.parse(equation, mode="eval"), used)
    except (SyntaxError, ValueError, ZeroDivisionError, OverflowError, RecursionError):
        return format_score
    if sorted(used) != sorted(numbers):
        return format_score
    return score if abs(value - float(target)) < 1e-5 else format_score
