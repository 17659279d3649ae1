"""The replay buffer's rules, as pure functions over finished groups: verl V1's off-policy
strategies (`drop` / `wait`), the eviction budgets of refilled groups, DAPO's group filter, and
the metrics a take reports. `Rollouter` (in `_rollouter.py`) applies them under its lock; nothing
here touches threads, the server or device arrays.

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

import collections
import math
from collections.abc import Callable, Sequence

import numpy as np

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
