"""Reward functions (verl's signature) that fail for some prompts, for the replay buffer's
failed-group eviction: a group of such a prompt has no usable reward."""


def fails_on_multiples_of_three(data_source, solution_str, ground_truth, extra_info=None):
    """Length parity, but raises for a prompt whose answer is a multiple of 3 (about a third)."""
    if int(ground_truth) % 3 == 0:
        raise RuntimeError(f"no reward for answer {ground_truth} (simulated failure)")
    return float(len(solution_str) % 2)
