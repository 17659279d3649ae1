"""The built-in arithmetic task: the embedded default demo a tiny model learns on CPU.

A prompt is one user message "a+b=" (operands 0..`max_operand`, so at most 6 characters with
the default 99); the answer is the plain integer, e.g. "95", which the model ends with EOS. The
scorer (`jaxrl_llm.rewards`, data_source "arithmetic") gives 1.0 iff the stripped response
parses as an integer equal to the ground truth. Problems are split into train and test by a
hash of the problem text (about 10% are test), so held-out accuracy measures generalisation.
"""
from __future__ import annotations

import zlib
from collections.abc import Mapping, Sequence

import numpy as np

from jaxrl_llm.data._schema import PathLike, write_rows

DATA_SOURCE = "arithmetic"
SPLITS = ("train", "test")
_OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


def _split_of(problem: str) -> str:
    return "test" if zlib.crc32(problem.encode()) % 10 == 0 else "train"


def _problems(split: str, max_operand: int, ops: Sequence[str]) -> list[tuple[int, str, int]]:
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    for op in ops:
        if op not in _OPS:
            raise ValueError(f"unknown op {op!r}; choose from {sorted(_OPS)}")
    return [(a, op, b) for op in ops for a in range(max_operand + 1)
            for b in range(max_operand + 1) if _split_of(f"{a}{op}{b}=") == split]


def make_arithmetic_rows(n: int, *, seed: int, split: str = "train", max_operand: int = 99,
                         ops: Sequence[str] = ("+",)) -> list[dict]:
    """`n` verl-schema rows of "a<op>b=" problems from `split` (sampled without replacement
    while `n` is at most the number of distinct problems in the split)."""
    problems = _problems(split, max_operand, ops)
    rng = np.random.default_rng(seed)
    picks = rng.choice(len(problems), size=n, replace=n > len(problems))
    rows = []
    for index, k in enumerate(picks):
        a, op, b = problems[int(k)]
        answer = _OPS[op](a, b)
        rows.append({
            "data_source": DATA_SOURCE,
            "prompt": [{"role": "user", "content": f"{a}{op}{b}="}],
            "ability": "arithmetic",
            "reward_model": {"style": "rule", "ground_truth": str(answer)},
            "extra_info": {"split": split, "index": index, "a": a, "b": b, "op": op},
        })
    return rows


def make_arithmetic_dataset(path: PathLike, n: int, *, seed: int, split: str = "train",
                            max_operand: int = 99, ops: Sequence[str] = ("+",)) -> PathLike:
    """Writes `make_arithmetic_rows(...)` to a parquet (or jsonl) file and returns its path."""
    write_rows(path, make_arithmetic_rows(n, seed=seed, split=split, max_operand=max_operand,
                                          ops=ops))
    return path


def render_arithmetic_answer(row: Mapping) -> str:
    """The assistant's target text for an arithmetic row: the integer, nothing else."""
    return str(int(row["reward_model"]["ground_truth"]))


def make_arithmetic_sft_rows(n: int, seed: int, *, split: str = "train", max_operand: int = 99,
                             ops: Sequence[str] = ("+",), off_by_one: float = 0.0,
                             trailing_junk: float = 0.0) -> list[dict]:
    """Rows with `messages` = [user prompt, assistant answer] for an SFT warm start; they also
    keep the verl fields of `make_arithmetic_rows`.

    Imperfect demonstrations, for showing what a verifier reward (RL) adds over imitation:
    `off_by_one` is the fraction whose answer is the true result + 1; `trailing_junk` the
    fraction whose (otherwise right) answer ends with a stray "." that the exact-match scorer
    rejects. Imitation copies both habits; GRPO unlearns them. `ground_truth` stays the truth.
    """
    for name, frac in (("off_by_one", off_by_one), ("trailing_junk", trailing_junk)):
        if not 0.0 <= frac <= 1.0:
            raise ValueError(f"{name} must be in [0, 1], got {frac}")
    rows = make_arithmetic_rows(n, seed=seed, split=split, max_operand=max_operand, ops=ops)
    rng = np.random.default_rng(seed + 1)
    wrong, junk = rng.random(len(rows)) < off_by_one, rng.random(len(rows)) < trailing_junk
    out = []
    for row, w, j in zip(rows, wrong, junk):
        answer = str(int(render_arithmetic_answer(row)) + int(w)) + ("." if j else "")
        out.append({**row, "messages": [*row["prompt"], {"role": "assistant", "content": answer}]})
    return out
