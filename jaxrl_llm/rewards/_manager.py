"""Scores a batch of responses, isolating scorer failures so the run goes on.

A scorer that raises, returns something that is not a number / {"score": ...} dict, hangs past
`timeout_s`, or kills its process gives reward 0 and is counted in `reward/num_errors` or
`reward/num_timeouts`. Turning scores into token-level rewards is the trainer's job.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from jaxrl_llm.rewards._pool import WorkerPool
from jaxrl_llm.rewards._registry import get_scorer, score_one

logger = logging.getLogger(__name__)


class RewardManager:
    """Scores batches with the built-in scorers by `data_source`, or `custom_fn` for every row.

    num_workers > 0: a pool of processes (created on the first batch, reused, a hung or dead
    worker replaced) with a per-call timeout of `timeout_s` seconds. num_workers == 0: scoring
    in this process with NO timeout protection (a hanging scorer hangs the run) — for quick
    demos only; exceptions are still caught and counted. `custom_fn` must be picklable for a
    pool (use `load_custom_reward_fn`, or a module-level function). Not thread-safe.
    """

    def __init__(self, *, num_workers: int = 4, timeout_s: float = 10.0,
                 custom_fn: Callable[..., Any] | None = None, start_method: str = "forkserver"):
        if num_workers < 0:
            raise ValueError(f"num_workers must be >= 0, got {num_workers}")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        self.num_workers = num_workers
        self.timeout_s = timeout_s
        self.custom_fn = custom_fn
        self._start_method = start_method
        self._pool: WorkerPool | None = None

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
        outcomes = self._run(tasks)
        return self._assemble(outcomes)

    def _run(self, tasks: list[tuple]) -> list[tuple]:
        if self.num_workers == 0:
            outcomes = []
            for task in tasks:
                try:
                    outcomes.append(("ok", *score_one(self.custom_fn, *task)))
                except Exception as e:  # noqa: BLE001 - a failing scorer is a counted 0
                    outcomes.append(("error", f"{type(e).__name__}: {e}", None))
            return outcomes
        if self._pool is None:
            self._pool = WorkerPool(self.num_workers, self.custom_fn, self._start_method)
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
