"""The streaming reward loop (verl's RewardLoop): score each trajectory the moment it finishes.

Agent rollouts finish one by one; `RewardLoop.score` is awaited by each trajectory's coroutine
right after its last turn, so scoring overlaps with the generation of the others. Up to three
sources score a trajectory, concurrently:
- the rule scorers / custom function: one row through the `RewardManager` (its process pool,
  timeouts and error counting), run in a single background thread so the event loop never
  blocks (the manager is not thread-safe: one thread serialises it);
- a discriminative reward model (`RewardModelService`): a value-head forward batched over the
  trajectories waiting at that moment;
- a generative judge (`Judge`): a request to a rollout server.
Their scores combine by `combine_scores` (weighted sum; a source with weight 0 is not run).
Token-level placement and batching of the training batch are the trainer's job.
"""
from __future__ import annotations

import asyncio
import dataclasses
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from jaxrl_llm.rewards._judge import Judge, Judgement, RewardWeights, combine_scores
from jaxrl_llm.rewards._manager import RewardManager
from jaxrl_llm.rewards._model import RewardModelService


@dataclasses.dataclass(frozen=True)
class RowScore:
    """One trajectory's reward: the combined score, the scorer's extra numeric fields (plus
    `rule_score` / `rm_score` / `judge_score` of each source that ran when more than the rule
    runs), failures, when (`time.perf_counter()`) it was scored, and the judge's `Judgement`."""

    score: float
    extra: dict[str, float]
    num_errors: int
    num_timeouts: int
    scored_at: float
    judgement: Judgement | None = None


@dataclasses.dataclass(frozen=True)
class Trajectory:
    """What the model and the judge read besides the response text: the prompt and response
    token ids (response with tool / user tokens, as trained on), the question (the prompt's last
    user message) and the whole decoded response (every turn)."""

    prompt_ids: tuple[int, ...]
    response_ids: tuple[int, ...]
    question: str
    response_text: str


class RewardLoop:
    """`await loop.score(data_source, solution_str, ground_truth, extra_info, trajectory=...)` ->
    `RowScore`. model / judge: optional; they need `trajectory`."""

    def __init__(self, manager: RewardManager, *, model: RewardModelService | None = None,
                 judge: Judge | None = None, weights: RewardWeights = RewardWeights()):
        self.manager, self.model, self.judge, self.weights = manager, model, judge, weights
        self.uses_rule = weights.rule != 0 or (model is None and judge is None)
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="reward-loop")

    async def score(self, data_source: str, solution_str: str, ground_truth: Any,
                    extra_info: dict | None, *, trajectory: Trajectory | None = None) -> RowScore:
        if (self.model is not None or self.judge is not None) and trajectory is None:
            raise ValueError("RewardLoop with a reward model or judge needs the trajectory= to score")
        parts = [self._rule(data_source, solution_str, ground_truth, extra_info) if self.uses_rule
                 else _none()]
        parts.append(self.model.score(trajectory.prompt_ids, trajectory.response_ids)
                     if self.model is not None else _none())
        parts.append(self.judge.judge(trajectory.question, trajectory.response_text, ground_truth)
                     if self.judge is not None else _none())
        rule, rm, judged = await asyncio.gather(*parts)
        extra, errors, timeouts = {}, 0, 0
        if rule is not None:
            rule_score, extra, errors, timeouts = rule
        if self.model is not None or self.judge is not None:
            extra = dict(extra)
            if rule is not None:
                extra["rule_score"] = rule_score
            if rm is not None:
                extra["rm_score"] = rm
            if judged is not None:
                extra["judge_score"] = judged.score
        score = combine_scores(self.weights, rule=rule_score if rule is not None else None, model=rm,
                               judge=judged.score if judged is not None else None)
        return RowScore(score=score, extra=extra, num_errors=errors, num_timeouts=timeouts,
                        scored_at=time.perf_counter(), judgement=judged)

    async def _rule(self, data_source, solution_str, ground_truth, extra_info):
        loop = asyncio.get_running_loop()
        scores, extra, metrics = await loop.run_in_executor(
            self._executor, self.manager.score_batch, [data_source], [solution_str],
            [ground_truth], [extra_info])
        return (float(scores[0]), {k: float(v[0]) for k, v in extra.items()},
                int(metrics.get("reward/num_errors", 0)), int(metrics.get("reward/num_timeouts", 0)))

    def close(self) -> None:
        self._executor.shutdown(wait=True)
        if self.model is not None:
            self.model.close()


async def _none():
    return None
