"""The built-in tool-use task: two-digit multiplication that a tiny model solves with a calculator.

A prompt is one user message "a*b=" (a, b in [10, `max_operand`]); the answer is the product.
A tiny character-level model cannot multiply two-digit numbers in its head, but it can learn to
call the `calculator` tool (hermes format, `<tool_call>{...}</tool_call>`) and copy the result.
Rows carry `agent_name = "tool_agent"`; the scorer (data_source "arithmetic", exact integer
match) reads the model's last message. The train/test split is the arithmetic task's (a hash of
the problem text), so held-out accuracy measures generalisation.

`make_tool_arithmetic_sft_rows` writes demonstrations: tool-call traces
[user, assistant call, tool result, assistant answer], a fraction `no_tool` of direct answers
(the true product without the tool: imitation learns to guess sometimes; GRPO learns that
calling the calculator pays), and a fraction `trailing_junk` of final answers that end with a
stray "." (as in the quickstart: the exact-match scorer rejects it, GRPO unlearns it).
"""
from __future__ import annotations

import json

import numpy as np

from jaxrl_llm.data._schema import PathLike, write_rows
from jaxrl_llm.data.tasks._arithmetic import _problems

DATA_SOURCE = "arithmetic"
MIN_OPERAND = 10
TOOL_NAME = "calculator"


def tool_call_text(expression: str) -> str:
    """The hermes-format calculator call the demonstrations use (compact JSON)."""
    body = json.dumps({"name": TOOL_NAME, "arguments": {"expression": expression}},
                      separators=(",", ":"))
    return f"<tool_call>{body}</tool_call>"


def make_tool_arithmetic_rows(n: int, *, seed: int, split: str = "train",
                              max_operand: int = 99) -> list[dict]:
    """`n` verl-schema rows of "a*b=" problems from `split`, run by the `tool_agent` loop."""
    if max_operand < MIN_OPERAND:
        raise ValueError(f"max_operand must be >= {MIN_OPERAND} for the tool task, got {max_operand}")
    problems = [p for p in _problems(split, max_operand, ("*",))
                if p[0] >= MIN_OPERAND and p[2] >= MIN_OPERAND]
    rng = np.random.default_rng(seed)
    picks = rng.choice(len(problems), size=n, replace=n > len(problems))
    rows = []
    for index, k in enumerate(picks):
        a, _, b = problems[int(k)]
        rows.append({
            "data_source": DATA_SOURCE,
            "agent_name": "tool_agent",
            "prompt": [{"role": "user", "content": f"{a}*{b}="}],
            "ability": "arithmetic",
            "reward_model": {"style": "rule", "ground_truth": str(a * b)},
            "extra_info": {"split": split, "index": index, "a": int(a), "b": int(b), "op": "*"},
        })
    return rows


def make_tool_arithmetic_dataset(path: PathLike, n: int, *, seed: int, split: str = "train",
                                 max_operand: int = 99) -> PathLike:
    write_rows(path, make_tool_arithmetic_rows(n, seed=seed, split=split, max_operand=max_operand))
    return path


def make_tool_arithmetic_sft_rows(n: int, seed: int, *, max_operand: int = 99,
                                  no_tool: float = 0.0, trailing_junk: float = 0.0) -> list[dict]:
    """Rows with `messages` for the SFT warm start (train split only); see the module docstring."""
    for name, frac in (("no_tool", no_tool), ("trailing_junk", trailing_junk)):
        if not 0.0 <= frac <= 1.0:
            raise ValueError(f"{name} must be in [0, 1], got {frac}")
    rows = make_tool_arithmetic_rows(n, seed=seed, split="train", max_operand=max_operand)
    rng = np.random.default_rng(seed + 1)
    direct, junk = rng.random(len(rows)) < no_tool, rng.random(len(rows)) < trailing_junk
    out = []
    for row, d, j in zip(rows, direct, junk):
        a, b = row["extra_info"]["a"], row["extra_info"]["b"]
        result = row["reward_model"]["ground_truth"]
        answer = result + ("." if j else "")
        turns = [{"role": "assistant", "content": answer}] if d else [
            {"role": "assistant", "content": tool_call_text(f"{a}*{b}")},
            {"role": "tool", "content": result},
            {"role": "assistant", "content": answer}]
        out.append({**row, "messages": [*row["prompt"], *turns]})
    return out
