"""The streaming reward loop (verl's RewardLoop): score each trajectory the moment it finishes.

Agent rollouts finish one by one; `RewardLoop.score` is awaited by each trajectory's coroutine
right after its last turn, so scoring overlaps with the generation of the others. Each call is
one row through the `RewardManager` (its process pool, timeouts and error counting), run in a
single background thread so the event loop never blocks (the manager is not thread-safe: one
thread serialises it). Token-level placement and batching are the trainer's job.
"""
from __future__ import annotations

import asyncio
import dataclasses
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from jaxrl_llm.rewards._manager import RewardManager


@dataclasses.dataclass(frozen=True)
class RowScore:
    """One trajectory's reward: score, the scorer's extra numeric fields, failures, and when
    (`time.perf_counter()`) it was scored."""

    score: float
    extra: dict[str, float]
    num_errors: int
    num_timeouts: int
    scored_at: float


class RewardLoop:
    """`await loop.score(data_source, solution_str, ground_truth, extra_info)` -> `RowScore`."""

    def __init__(self, manager: RewardManager):
        self.manager = manager
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="reward-loop")

    async def score(self, data_source: str, solution_str: str, ground_truth: Any,
                    extra_info: dict | None) -> RowScore:
        loop = asyncio.get_running_loop()
        scores, extra, metrics = await loop.run_in_executor(
            self._executor, self.manager.score_batch, [data_source], [solution_str],
            [ground_truth], [extra_info])
        return RowScore(score=float(scores[0]), extra={k: float(v[0]) for k, v in extra.items()},
                        num_errors=int(metrics.get("reward/num_errors", 0)),
                        num_timeouts=int(metrics.get("reward/num_timeouts", 0)),
                        scored_at=time.perf_counter())

    def close(self) -> None:
        self._executor.shutdown(wait=True)
