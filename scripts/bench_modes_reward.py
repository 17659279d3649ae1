"""The reward of `scripts/bench_modes.py`: one a random-init model can learn in a few steps.

`bench_modes.PaddedCharTokenizer` decodes every id past the character vocabulary as "a" (even
id) or "b" (odd id), so a random model's response is a string of a's and b's (about half each);
the score is the share of a's. GRPO then has a per-token preference to learn (raise the even
ids' logits), so reward against step and against wall time compare how the trainer modes learn
at equal samples. Kept free of imports: the reward workers load this file by path.
"""


def even_token_share(data_source, solution_str, ground_truth, extra_info=None) -> float:
    """Share of "a" among the response's "a"/"b" characters (0 when it has none)."""
    a, b = solution_str.count("a"), solution_str.count("b")
    return a / (a + b) if a + b else 0.0
