"""A user's reward function loaded from a file, as verl's `custom_reward_function.path/name`.

The function is called with verl's keywords
`(data_source=..., solution_str=..., ground_truth=..., extra_info=...)` and returns a float or
a dict with "score". Reward worker processes import the file themselves from (path, name); the
object also pickles as (path, name).
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
from typing import Any


def _load(path: str, name: str):
    if not os.path.isfile(path):
        raise FileNotFoundError(f"custom reward function file not found: {path}")
    module_name = "jaxrl_llm_custom_reward_" + hashlib.sha1(path.encode()).hexdigest()[:12]
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import custom reward file {path} (is it a .py file?)")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    if not hasattr(module, name):
        raise AttributeError(f"custom reward file {path} has no function {name!r}")
    fn = getattr(module, name)
    if not callable(fn):
        raise TypeError(f"{name!r} in custom reward file {path} is not callable")
    return fn


class CustomRewardFn:
    """`name` from the Python file `path`, callable with verl's reward signature."""

    def __init__(self, path: str | os.PathLike, name: str = "compute_score"):
        self.path = os.path.abspath(os.fspath(path))
        self.name = name
        self._fn = _load(self.path, name)

    def __call__(self, data_source: str, solution_str: str, ground_truth: Any,
                 extra_info: dict | None = None):
        return self._fn(data_source=data_source, solution_str=solution_str,
                        ground_truth=ground_truth, extra_info=extra_info)

    def __reduce__(self):
        return CustomRewardFn, (self.path, self.name)

    def __repr__(self) -> str:
        return f"CustomRewardFn(path={self.path!r}, name={self.name!r})"


def load_custom_reward_fn(path: str | os.PathLike, name: str = "compute_score") -> CustomRewardFn:
    """Loads `name` from `path` now (so a bad path or name fails at start-up, naming both)."""
    return CustomRewardFn(path, name)
