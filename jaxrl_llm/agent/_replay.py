"""The replay buffer between the rollouter and the trainer: its records (`PromptGroup`,
`TrajectoryGroup`, the `TrajectoryQueue` of finished groups, `TakenBatch`) and its rules, as pure
functions over finished groups: verl V1's off-policy strategies (`drop` / `wait`), the eviction
budgets of refilled groups, DAPO's group filter, and the metrics a take reports. `Rollouter` (in
`_rollouter.py`) applies the rules under its lock; nothing here runs agent loops, talks to the
server or touches device arrays.

Versions are the rollout server's policy versions (one per weight sync). A trajectory's tokens
each carry the version that sampled them (`AgentLoopOutput.response_versions`, -1 for tool and
user tokens).

`max_off_policy_threshold` T (verl's `trainer.v1.sampler.max_off_policy_threshold`): the model
versions a trained group may span, counted as verl counts them, from the version its generation
started with through the version it is trained at, both included. So a group started at version
a may be trained at versions a .. a + T - 1: the largest allowed staleness (current version minus
its oldest token's version) is K = T - 1, and T = 1 is on-policy.
"""
from __future__ import annotations

import base64
import collections
import dataclasses
import math
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from jaxrl_llm.agent._loop import AgentLoopOutput


@dataclasses.dataclass
class PromptGroup:
    """One prompt whose `n` trajectories are generated together (a GRPO group).

    index: the prompt's position in the data order (the trainer sorts a batch by it);
    sample: `AgentSample` fields except `row`; seed / first_row: the trajectories sample with
    (seed, first_row + j) like the batch driver's rows, so a group's tokens do not depend on when
    or next to what it runs."""

    index: int
    sample: dict
    seed: int
    first_row: int
    n: int


@dataclasses.dataclass
class TrajectoryGroup:
    """A finished group: `results` are the runner's per-trajectory tuples (agent name,
    `AgentLoopOutput`, finished_s, `RowScore` or None, scored_s)."""

    prompt: PromptGroup
    results: list
    started_version: int
    finished_at: float

    def token_versions(self) -> list[int]:
        return [v for _, out, *_ in self.results for v in out.response_versions if v >= 0]

    @property
    def min_version(self) -> int:
        """The oldest policy version that sampled one of its tokens (its staleness is measured
        from here)."""
        return min(self.token_versions(), default=self.started_version)

    @property
    def max_version(self) -> int:
        return max(self.token_versions(), default=self.started_version)

    def to_json(self) -> dict:
        results = [{"name": name, "out": _out_json(out), "finished_s": float(fin),
                    "score": None if score is None else _plain(dataclasses.asdict(score)),
                    "scored_s": float(scored)} for name, out, fin, score, scored in self.results]
        return {"prompt": _plain(dataclasses.asdict(self.prompt)), "results": results,
                "started_version": int(self.started_version)}

    @classmethod
    def from_json(cls, d: dict) -> "TrajectoryGroup":
        from jaxrl_llm.rewards import RowScore
        results = [(r["name"], _out_from_json(r["out"]), r["finished_s"],
                    None if r["score"] is None else RowScore(**r["score"]), r["scored_s"])
                   for r in d["results"]]
        return cls(PromptGroup(**d["prompt"]), results, int(d["started_version"]), time.perf_counter())


class TrajectoryQueue:
    """Finished groups in the order they finished; thread-safe (on `cv`, the rollouter's
    condition, when given). `take` blocks until `k` are there (or the producer failed: then it
    raises the producer's error)."""

    def __init__(self, cv: threading.Condition | None = None):
        self._groups: collections.deque[TrajectoryGroup] = collections.deque()
        self._cv = cv or threading.Condition(threading.RLock())
        self._error: BaseException | None = None

    def __len__(self) -> int:
        with self._cv:
            return len(self._groups)

    def put(self, group: TrajectoryGroup) -> None:
        with self._cv:
            self._groups.append(group)
            self._cv.notify_all()

    def fail(self, error: BaseException) -> None:
        with self._cv:
            if self._error is None:
                self._error = error
            self._cv.notify_all()

    def remove(self, groups) -> None:
        with self._cv:
            for g in groups:
                self._groups.remove(g)

    def raise_if_failed(self) -> None:
        err = self._error
        if err is not None:
            if isinstance(err, ReplayBudgetError):
                raise ReplayBudgetError(str(err)) from err
            raise RuntimeError(f"the rollouter failed: {err!r}") from err

    def take(self, k: int, *, min_version: int | None = None, timeout: float | None = None):
        """(taken, dropped): the first k groups (finish order) whose `min_version` is at least
        `min_version`, or, as soon as an older group is met, ([], the older ones met so far)
        with the others left in place (the caller generates those prompts again and retries)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cv:
            while True:
                old = [g for g in self._groups if min_version is not None and g.min_version < min_version]
                if old:
                    for g in old:
                        self._groups.remove(g)
                    return [], old
                if len(self._groups) >= k:
                    return [self._groups.popleft() for _ in range(k)], []
                self.raise_if_failed()
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError(f"only {len(self._groups)} of {k} trajectory groups finished "
                                       f"in {timeout} s")
                self._cv.wait(left)

    def snapshot(self) -> list[TrajectoryGroup]:
        with self._cv:
            return list(self._groups)


class ReplayBudgetError(RuntimeError):
    """More groups were evicted (failed or filtered) in one step than the budget allows."""


@dataclasses.dataclass
class TakenBatch:
    """What `Rollouter.take_batch` hands the trainer: the groups (oldest first under `wait`,
    else finish order) and the take's metrics (verl's `training/off_policy/*` names, see
    `_replay.off_policy_metrics` and `length_bias`, plus the step's evicted / refilled counts)."""

    groups: list[TrajectoryGroup]
    metrics: dict[str, float]
    # the counts `metrics` came from (evictions, drops, generated lengths since the last take),
    # to combine several hosts' takes (`_rollouter.merge_windows`)
    window: dict = dataclasses.field(default_factory=dict)


STRATEGIES = ("drop", "wait")


def max_staleness(threshold: int | None) -> int | None:
    """K = T - 1 (see the module docstring); None = no bound."""
    return None if threshold is None else int(threshold) - 1


def wait_feasible(starts: Sequence[int], *, version: int, bound: int, consumed: int,
                  per_sync: int) -> bool:
    """Can every open group (started at `starts`, not yet trained) still be trained within the
    bound, if the trainer goes on taking oldest first, `per_sync` groups per version, and has
    taken `consumed` at `version` so far? Earliest-deadline-first counting: for each start version
    a, the groups started at or before a must fit in the takes left up to version a + bound,
    that is `(a + bound - version + 1) * per_sync - consumed`. Groups already past the bound
    (possible only after a sync that came before `per_sync` groups were taken) are left out:
    they are dropped when met, whatever happens now."""
    open_so_far = 0
    for a, count in sorted(collections.Counter(int(s) for s in starts).items()):
        if a + bound < version:
            continue
        open_so_far += count
        if open_so_far > (a + bound - version + 1) * per_sync - consumed:
            return False
    return True


def budget(k: int, count: int | None, fraction: float | None) -> float:
    """The groups a step of `k` may evict: the smaller of `count` and `floor(fraction * k)`
    (None: no limit from that part)."""
    limits = [math.inf]
    if count is not None:
        limits.append(count)
    if fraction is not None:
        limits.append(math.floor(fraction * k + 1e-9))
    return min(limits)


def _versions(out, fallback: int) -> tuple[int, int]:
    v = [x for x in out.response_versions if x >= 0]
    return (min(v), max(v)) if v else (fallback, fallback)


def off_policy_metrics(groups, version: int) -> dict[str, float]:
    """verl's per-trajectory off-policy metrics over the trained `groups` (`TrajectoryGroup`s)
    at policy `version`: `trajectory_spans` = max - min token version + 1 (1 = one version),
    `trajectory_staleness` = version - newest token version, `trajectory_staleness_worst` =
    version - oldest token version; each as mean / max / min under `training/off_policy/`.
    A trajectory without model tokens counts at its group's start version."""
    lo, hi = [], []
    for g in groups:
        for _, out, *_ in g.results:
            a, b = _versions(out, g.started_version)
            lo.append(a)
            hi.append(b)
    if not lo:
        return {}
    lo, hi = np.asarray(lo, np.float64), np.asarray(hi, np.float64)
    m = {}
    for name, x in (("trajectory_spans", hi - lo + 1), ("trajectory_staleness", version - hi),
                    ("trajectory_staleness_worst", version - lo)):
        m.update({f"training/off_policy/{name}/mean": float(x.mean()),
                  f"training/off_policy/{name}/max": float(x.max()),
                  f"training/off_policy/{name}/min": float(x.min())})
    return m


def response_lengths(group) -> list[int]:
    """Response tokens (model, tool and user) of each of a group's trajectories."""
    return [len(out.response_ids) for _, out, *_ in group.results]


def length_bias(trained, generated_tokens: int, generated_trajectories: int) -> dict[str, float]:
    """`training/off_policy/length_bias`: mean response length of the trained trajectories over
    the mean of all trajectories that finished generating in the same interval (trained later,
    filtered, dropped as stale or evicted after scoring included). 1.0 = the trained groups are
    as long as what was generated; below 1 = training sees the short ones more often (dropping
    stale groups does that: the long ones are the stale ones). Left out when nothing finished."""
    lengths = [n for g in trained for n in response_lengths(g)]
    if not lengths or generated_trajectories <= 0 or generated_tokens <= 0:
        return {}
    return {"training/off_policy/length_bias":
            float(np.mean(lengths) / (generated_tokens / generated_trajectories))}


FILTER_METRICS = ("acc", "score")


def dapo_group_filter(metric: str = "acc") -> Callable[[object], bool]:
    """DAPO's dynamic-sampling filter for a `TrajectoryGroup`: keep it when its trajectories'
    `metric` is not the same for all (exactly max != min), or when it has one trajectory (as
    `algos.dynamic_sampling_keep_mask`). `acc`: the reward function's `acc` extra, else its
    score; `score`: the score. (The trainer-side metrics with the overlong penalty,
    `seq_reward` / `seq_final_reward`, need the trainer's penalty and are not offered here.)"""
    if metric not in FILTER_METRICS:
        raise ValueError(f"unknown group filter metric {metric!r}; the rollouter's filter offers "
                         f"{FILTER_METRICS}")

    def keep(group) -> bool:
        values = []
        for _, _, _, score, _ in group.results:
            if score is None:
                raise ValueError("the DAPO group filter needs scored trajectories; the agent runner "
                                 "has no reward loop")
            values.append(score.extra.get("acc", score.score) if metric == "acc" else score.score)
        return len(values) <= 1 or max(values) != min(values)
    return keep


def reward_failed(group) -> bool:
    """A trajectory of the group could not be scored (the reward function raised or timed out)."""
    return any(score is not None and (score.num_errors or score.num_timeouts)
               for _, _, _, score, _ in group.results)


def _out_json(out: AgentLoopOutput) -> dict:
    """An `AgentLoopOutput` as JSON; its routed_experts (router replay) as {dtype, shape, base64}."""
    experts, out = out.routed_experts, dataclasses.replace(out, routed_experts=None)
    d = _plain(dataclasses.asdict(out))
    if experts is not None:
        experts = np.ascontiguousarray(experts)
        d["routed_experts"] = {"dtype": str(experts.dtype), "shape": list(experts.shape),
                               "b64": base64.b64encode(experts.tobytes()).decode("ascii")}
    return d


def _out_from_json(d: dict) -> AgentLoopOutput:
    d = dict(d)
    e = d.get("routed_experts")
    if e is not None:
        d["routed_experts"] = np.frombuffer(base64.b64decode(e["b64"]), e["dtype"]).reshape(e["shape"]).copy()
    return AgentLoopOutput(**d)


def _plain(x: Any) -> Any:
    """JSON-able copy: numpy scalars and arrays become Python numbers and lists."""
    if isinstance(x, dict):
        return {str(k): _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    if isinstance(x, np.ndarray):
        return _plain(x.tolist())
    if isinstance(x, np.generic):
        return x.item()
    return x
