"""Scores a batch of responses, isolating scorer failures so the run goes on.

A scorer that raises, returns something that is not a number finite in float32 / a
{"score": ...} dict, hangs past `timeout_s`, runs out of its memory limit, or kills its process
gives reward 0 and is counted in `reward/num_errors` or `reward/num_timeouts`. Three circuit
breakers stop the run instead (`RewardFunctionError`, naming the reward function): more than
`max_error_fraction` of a batch failed (with the first failure), `max_consecutive_timeouts`
calls in a row timed out, or `max_consecutive_worker_deaths` workers in a row died while scoring
(with their exit codes). Custom reward functions always run in sandboxed worker processes, even
with `num_workers=0` (then one worker); with `num_workers=0` the built-in scorers run in this
process (our code: no sandbox, no timeout). Turning scores into token-level rewards is the
trainer's job.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from jaxrl_llm.rewards._pool import (ConsecutiveDeaths, ConsecutiveTimeouts, WorkerPool,
                                     reward_source)
from jaxrl_llm.rewards._registry import get_scorer, score_one
from jaxrl_llm.sandbox import Sandbox, make_sandbox

logger = logging.getLogger(__name__)


class RewardFunctionError(RuntimeError):
    """The reward function fails too often for its scores to mean anything: the run stops."""


class RewardManager:
    """Scores batches with the built-in scorers by `data_source`, or `custom_fn` for every row.

    num_workers > 0: a pool of processes (created on the first batch, reused, a hung or dead
    worker replaced) contained by `sandbox` (a `jaxrl_llm.sandbox.Sandbox` or its kind), with a
    per-call timeout of `timeout_s` seconds and an address-space limit of `memory_limit_gb` per
    worker (0 = none). num_workers == 0: the built-in scorers run in this process (no sandbox,
    no timeout: they are ours and fast); a `custom_fn` still gets a pool of one worker, so user
    code can never hang, kill or exhaust the trainer nor read its environment. `custom_fn`:
    `load_custom_reward_fn(path, name)` or a function at the top level of a .py file (workers
    import the file themselves). `max_error_fraction` (1 = off), `max_consecutive_timeouts` and
    `max_consecutive_worker_deaths` (0 = off) are the circuit breakers. Not thread-safe.
    """

    def __init__(self, *, num_workers: int = 4, timeout_s: float = 10.0,
                 custom_fn: Callable[..., Any] | None = None, sandbox: Sandbox | str = "auto",
                 max_error_fraction: float = 1.0, max_consecutive_timeouts: int = 0,
                 max_consecutive_worker_deaths: int = 0, memory_limit_gb: float = 0.0):
        if num_workers < 0:
            raise ValueError(f"num_workers must be >= 0, got {num_workers}")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        if not 0 <= max_error_fraction <= 1:
            raise ValueError(f"max_error_fraction must be in [0, 1], got {max_error_fraction}")
        self.num_workers = num_workers if custom_fn is None else max(num_workers, 1)
        self.timeout_s = timeout_s
        reward_source(custom_fn)  # one the workers cannot load is an error now
        self.custom_fn = custom_fn
        self.max_error_fraction = max_error_fraction
        self.max_consecutive_timeouts = max_consecutive_timeouts
        self.max_consecutive_worker_deaths = max_consecutive_worker_deaths
        self.memory_limit_gb = memory_limit_gb
        # made now, so that a sandbox that cannot run here fails at start-up
        self.sandbox = (None if self.num_workers == 0 else
                        make_sandbox(sandbox) if isinstance(sandbox, str) else sandbox)
        self._pool: WorkerPool | None = None

    def describe(self) -> str:
        """The reward function, as an error message names it."""
        if self.custom_fn is not None:
            return f"custom reward function {self.custom_fn!r}"
        return "built-in scorer"

    def score_batch(self, data_sources: Sequence[str], solution_strs: Sequence[str],
                    ground_truths: Sequence[Any], extra_infos: Sequence[dict | None] | None = None,
                    ) -> tuple[np.ndarray, dict[str, np.ndarray], dict[str, float]]:
        """Returns (scores float32[b], extra {key: float32[b]}, metrics).

        `extra` holds the numeric non-"score" keys of dict results (0.0 for rows without the
        key, e.g. failed ones); metrics has reward/num_errors and reward/num_timeouts.
        """
        b = len(solution_strs)
        extra_infos = [None] * b if extra_infos is None else list(extra_infos)
        lengths = {"data_sources": len(data_sources), "solution_strs": b,
                   "ground_truths": len(ground_truths), "extra_infos": len(extra_infos)}
        if len(set(lengths.values())) != 1:
            raise ValueError(f"score_batch needs equal lengths, got {lengths}")
        if self.custom_fn is None:
            for source in set(data_sources):
                get_scorer(source)  # an unknown data_source is a config error: raise now
        tasks = list(zip(data_sources, solution_strs, ground_truths, extra_infos))
        try:
            outcomes = self._run(tasks)
        except ConsecutiveTimeouts as e:
            raise RewardFunctionError(
                f"{self.describe()} timed out {e.count} times in a row (reward.timeout_s="
                f"{self.timeout_s}, reward.max_consecutive_timeouts={self.max_consecutive_timeouts}); "
                "stopping instead of waiting out every row. Make it faster or raise the "
                "timeout.") from None
        except ConsecutiveDeaths as e:
            raise RewardFunctionError(
                f"{self.describe()}: its worker process died {e.count} times in a row while "
                f"scoring (last exit codes {e.exit_codes}; a negative code is the signal that "
                f"killed it, -9 often the memory limit; reward.max_consecutive_worker_deaths="
                f"{self.max_consecutive_worker_deaths}); stopping instead of replacing it "
                "forever. Call it on one row by hand to see why.") from None
        scores, extra, metrics = self._assemble(outcomes)
        self._check_failures(outcomes, data_sources)
        return scores, extra, metrics

    def _check_failures(self, outcomes: list[tuple], data_sources: Sequence[str]) -> None:
        failed = [i for i, (status, _, _) in enumerate(outcomes) if status != "ok"]
        if len(failed) > self.max_error_fraction * len(outcomes):
            i = failed[0]
            raise RewardFunctionError(
                f"{len(failed)} of {len(outcomes)} scores of the batch failed, more than "
                f"reward.max_error_fraction={self.max_error_fraction}: {self.describe()} "
                f"(data_source {data_sources[i]!r}) is broken; first failure, row {i}: "
                f"{outcomes[i][1]}")

    def _run(self, tasks: list[tuple]) -> list[tuple]:
        if self.num_workers == 0:  # built-in scorers only (a custom_fn always gets a pool)
            outcomes = []
            for task in tasks:
                try:
                    outcomes.append(("ok", *score_one(self.custom_fn, *task)))
                except Exception as e:  # noqa: BLE001 - a failing scorer is a counted 0
                    outcomes.append(("error", f"{type(e).__name__}: {e}", None))
            return outcomes
        if self._pool is None:
            self._pool = WorkerPool(self.num_workers, self.custom_fn, sandbox=self.sandbox,
                                    memory_limit_gb=self.memory_limit_gb,
                                    max_consecutive_timeouts=self.max_consecutive_timeouts,
                                    max_consecutive_deaths=self.max_consecutive_worker_deaths)
        return self._pool.run(tasks, self.timeout_s)

    @staticmethod
    def _assemble(outcomes: list[tuple]):
        b = len(outcomes)
        scores = np.zeros(b, dtype=np.float32)
        extra: dict[str, np.ndarray] = {}
        counts = {"error": 0, "timeout": 0}
        first_failure = None
        for i, (status, value, extras) in enumerate(outcomes):
            if status != "ok":
                counts[status] += 1
                first_failure = first_failure or f"row {i}: {value}"
                continue
            scores[i] = value
            for key, v in extras.items():
                extra.setdefault(key, np.zeros(b, dtype=np.float32))[i] = v
        if first_failure is not None:
            logger.warning("reward: %d errors, %d timeouts in a batch of %d (scored 0); first: %s",
                           counts["error"], counts["timeout"], b, first_failure)
        metrics = {"reward/num_errors": float(counts["error"]),
                   "reward/num_timeouts": float(counts["timeout"])}
        return scores, extra, metrics

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()
            self._pool = None

    def __enter__(self) -> "RewardManager":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
