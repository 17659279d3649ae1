"""Helpers for trainer tests: tiny configs that run a step in seconds."""
import os


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
QUICKSTART = os.path.join(ROOT, "configs", "quickstart.py")
REWARD_FN = os.path.join(ROOT, "tests", "fixtures", "rewards", "length_parity.py")


def tiny_overrides(run_dir, **extra):
    o = {
        "trainer.default_local_dir": str(run_dir),
        "trainer.progress_bar": False,
        "trainer.plot": False,
        "trainer.logger": "jsonl",
        "trainer.async_save": False,
        "reward.custom_reward_function.path": REWARD_FN,
        "reward.custom_reward_function.name": "compute_score",
    }
    o.update(extra)
    return [f"{k}={v}" for k, v in o.items()]


def param_checksum(trainer) -> float:
    """Sum of |actor params| of the in-process worker (local backend): did an update change them?"""
    import jax
    import numpy as np
    params = trainer.group.workers[0].actor.params
    return float(sum(np.abs(np.asarray(jax.device_get(x), np.float64)).sum() for x in jax.tree.leaves(params)))
