"""The rollouter's replay buffer: verl's `drop` / `wait` off-policy strategies, failed and
filtered groups evicted and refilled within a budget, the off-policy and length-bias metrics,
and checkpoints that keep the new bookkeeping. Stand-in servers, no model."""
import json
import threading
import time

import pytest

from agent_helpers import GatedServer, TokenServer, make_runner, prompt_groups
from jaxrl_llm import agent
from jaxrl_llm.agent import _replay
from jaxrl_llm.agent._loop import AgentLoopOutput
from jaxrl_llm.rewards import RowScore
from rollout import SamplingParams


def _rollouter(server, tok, *, reward_loop=None, **kw):
    kw = {"groups_per_sync": 2, "staleness_threshold": 1.0, "partial_rollout": True, **kw}
    return agent.Rollouter(make_runner(server, tok, reward_loop), sampling=SamplingParams(temperature=1.0), **kw)


def _sync(r, server, version):
    r.pause()
    server.version = version
    r.resume(version)


def _wait_for(r, pred, timeout=30):
    with r._cv:
        assert r._cv.wait_for(pred, timeout), "the rollouter never got there"


def _indices(groups):
    return sorted(g.prompt.index for g in groups)


# -- drop / wait ------------------------------------------------------------------------------
def _long_tail_run(char_tok, strategy):
    """T = 2 (a group may be trained one version after it started), 2 groups per sync, s = 1.
    Groups 0 and 3 are long (10 tokens, held at the server until released), 1, 2, 4, 5 short
    (2 tokens); a group generated again is short. Version 0 starts 0-3 and trains 1, 2; version
    1 starts 4, 5, which finish at once while 0 and 3 still run."""
    server = GatedServer(released={1, 2, 4, 5}, lengths={0: 10, 3: 10})
    r = _rollouter(server, char_tok, max_off_policy_threshold=2, max_off_policy_strategy=strategy)
    taken = []
    try:
        r.feed(prompt_groups(0, 6, n=1, seed=None))
        server.wait_arrived(4)  # 0-3 started at version 0 (the budget: (1 + 1) * 2)
        taken.append(r.take_batch(2, timeout=30))
        _sync(r, server, 1)
        server.wait_arrived(6)  # 4, 5 started at version 1
        server.lengths = {}
        if strategy == "wait":
            # 4 and 5 finish, but handing them out would leave 0 and 3 nothing but a take at
            # version 2, over the bound: the take waits for them instead
            _wait_for(r, lambda: len(r.queue) == 2)
            with pytest.raises(TimeoutError):
                r.take_batch(2, timeout=0.3)
            server.release(0, 3)
        taken.append(r.take_batch(2, timeout=30))
        _sync(r, server, 2)
        server.release(0, 3)
        taken.append(r.take_batch(2, timeout=30))
        stats = r.stats()
    finally:
        r.close()
    return taken, stats


def test_wait_trains_the_group_that_reaches_the_bound_and_drops_nothing(char_tok):
    taken, stats = _long_tail_run(char_tok, "wait")
    assert [_indices(t.groups) for t in taken] == [[1, 2], [0, 3], [4, 5]]
    for version, t in enumerate(taken):
        assert all(version - g.min_version <= 1 for g in t.groups)  # T - 1 = 1
        assert t.metrics["training/off_policy/dropped_samples"] == 0
    assert stats["groups_dropped_stale"] == 0 and stats["groups_started"] == 6
    # 0 and 3 started at version 0 and finished at version 1: two versions in one trajectory
    assert taken[1].metrics["training/off_policy/trajectory_spans/max"] == 2
    assert taken[1].metrics["training/off_policy/trajectory_staleness_worst/max"] == 1
    assert taken[1].metrics["training/off_policy/trajectory_staleness/max"] == 0
    # trained 10-token groups; finished in the interval: 4, 5 (2 tokens), 0, 3 (10): mean 6
    assert taken[1].metrics["training/off_policy/length_bias"] == pytest.approx(10 / 6)


def test_drop_drops_the_stale_groups_and_generates_them_again(char_tok):
    taken, stats = _long_tail_run(char_tok, "drop")
    assert [_indices(t.groups) for t in taken] == [[1, 2], [4, 5], [0, 3]]
    assert stats["groups_dropped_stale"] == 2 and stats["groups_started"] == 8
    assert taken[2].metrics["training/off_policy/dropped_samples"] == 2
    # 0 and 3 had tokens from version 0 when met at version 2
    assert taken[2].metrics["training/off_policy/dropped_samples_staleness/max"] == 2
    assert taken[2].metrics["training/off_policy/dropped_samples_staleness/mean"] == 2
    # generated again at version 2: all their tokens are new
    assert all(g.min_version == g.max_version == 2 for g in taken[2].groups)
    assert taken[2].metrics["training/off_policy/trajectory_staleness_worst/max"] == 0
    # the long first tries (10 tokens) were dropped, the short second ones (2) trained:
    # 2 / mean(10, 10, 2, 2) -- the bias toward short responses that drop-and-regenerate has
    assert taken[2].metrics["training/off_policy/length_bias"] == pytest.approx(2 / 6)


@pytest.mark.parametrize("s, threshold, trigger", [(1.5, 2, 1), (2.0, 2, 2), (3.0, 3, 1), (0.5, 1, 1)])
def test_wait_keeps_the_bound_under_random_lengths_without_dropping(char_tok, s, threshold, trigger):
    server = TokenServer()
    k = 4
    r = agent.Rollouter(make_runner(server, char_tok), sampling=SamplingParams(temperature=1.0),
                        groups_per_sync=k * trigger, staleness_threshold=s, partial_rollout=True,
                        max_off_policy_threshold=threshold, max_off_policy_strategy="wait")
    seen, worst, fed = set(), [], 0
    try:
        for step in range(8):
            while fed < (step + 3) * k + r.max_groups:
                r.feed(prompt_groups(fed, k))
                fed += k
            for g in r.take(k, timeout=60):
                assert g.prompt.index not in seen
                seen.add(g.prompt.index)
                worst.append(r.version - g.min_version)
            if (step + 1) % trigger == 0:
                _sync(r, server, server.version + 1)
        stats = r.stats()
    finally:
        r.close()
    assert max(worst) <= threshold - 1
    assert stats["groups_dropped_stale"] == 0


def test_wait_after_an_early_sync_drops_the_group_over_the_bound_rather_than_train_it(char_tok):
    """The trainer syncs after 1 of its 2 groups (as before validation): the other version-0
    group is over T = 1 at version 1; it is generated again, never trained stale."""
    server = TokenServer()
    r = _rollouter(server, char_tok, staleness_threshold=0.0, partial_rollout=False,
                   max_off_policy_threshold=1, max_off_policy_strategy="wait")
    try:
        r.feed(prompt_groups(0, 2))
        first = r.take(1, timeout=30)
        _sync(r, server, 1)
        second = r.take_batch(1, timeout=30)
    finally:
        r.close()
    assert _indices(first + second.groups) == [0, 1]
    assert second.metrics["training/off_policy/dropped_samples"] == 1
    assert all(g.min_version == 1 for g in second.groups)


# -- refill -----------------------------------------------------------------------------------
class FlakyReward:
    """A reward loop whose scoring fails (an error counted, as the reward manager reports it) for
    samples with `extra_info["reward_fails"]`; the score is the response's length."""

    async def score(self, data_source, text, ground_truth, info, trajectory=None):
        return RowScore(score=float(len(text)), extra={}, num_errors=int(bool(info.get("reward_fails"))),
                        num_timeouts=0, scored_at=0.0)

    def close(self):
        pass


def test_refill_keeps_the_batch_size_with_failing_and_filtered_groups(char_tok):
    # group 1's agent loop raises, group 2's reward fails, the filter removes group 3
    server = TokenServer(fail_seeds={1})
    asked = []

    def refill(n):
        asked.append(n)
        start = 100 + len(asked) - 1
        return prompt_groups(start, n, seed=start)

    bad_reward = prompt_groups(2, 1, seed=2, extra_info={"reward_fails": True})
    r = _rollouter(server, char_tok, reward_loop=FlakyReward(), groups_per_sync=4, staleness_threshold=0.0,
                   partial_rollout=False, refill=refill, group_filter=lambda g: g.prompt.index != 3,
                   max_failed_groups=2)
    try:
        r.feed(prompt_groups(0, 2, seed=None) + bad_reward + prompt_groups(3, 2, seed=None))
        taken = r.take_batch(4, timeout=30)
        stats = r.stats()
    finally:
        r.close()
    # the budget of 4 groups a sync interval: the three evicted slots went to refills, not to 4
    assert _indices(taken.groups) == [0, 100, 101, 102]
    assert asked == [1, 1, 1]
    assert (stats["groups_failed"], stats["groups_filtered"], stats["groups_refilled"]) == (2, 1, 3)
    assert (taken.metrics["training/replay/failed_groups"], taken.metrics["training/replay/filtered_groups"],
            taken.metrics["training/replay/refilled_groups"]) == (2, 1, 3)
    assert all(len(g.results) == 2 for g in taken.groups)


def _waiting_in_take(r, timeout=30):
    """True once a thread waits on the rollouter's condition (a take waiting for groups)."""
    deadline = time.monotonic() + timeout
    while not r._cv._waiters:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.001)
    return True


def test_a_take_waits_while_an_evicted_slot_is_being_refilled(char_tok):
    """Between an eviction and its refill nothing runs and nothing waits; the take must not call
    that stuck. Group 1 fails while the take waits; the refill answers only once the take is
    waiting again."""
    server = GatedServer(released={0, 2, 3, 10}, fail_seeds={1})

    def refill(n):
        assert _waiting_in_take(r, timeout=5)
        return prompt_groups(10, n, n=1, seed=10)

    r = _rollouter(server, char_tok, groups_per_sync=4, staleness_threshold=0.0, refill=refill,
                   max_failed_groups=1)
    try:
        r.feed(prompt_groups(0, 4, n=1, seed=None))
        _wait_for(r, lambda: len(r.queue) == 3)
        release = threading.Thread(target=lambda: _waiting_in_take(r) and server.release(1))
        release.start()
        taken = r.take(4, timeout=30)
        release.join()
    finally:
        r.close()
    assert _indices(taken) == [0, 2, 3, 10]


def test_without_refill_the_waiting_prompts_take_the_evicted_slots(char_tok):
    server = TokenServer(fail_seeds={1})
    r = _rollouter(server, char_tok, groups_per_sync=4, staleness_threshold=0.0, partial_rollout=False,
                   max_failed_groups=1)
    try:
        r.feed(prompt_groups(0, 6, seed=None))
        first = r.take(4, timeout=30)
    finally:
        r.close()
    assert _indices(first) == [0, 2, 3, 4]


def test_a_take_that_can_never_complete_says_so(char_tok):
    server = TokenServer(fail_seeds={1})
    r = _rollouter(server, char_tok, groups_per_sync=4, staleness_threshold=0.0, partial_rollout=False,
                   max_failed_groups=1)
    try:
        r.feed(prompt_groups(0, 4, seed=None))
        with pytest.raises(RuntimeError, match="no more can come.*feed more prompts"):
            r.take(4, timeout=30)
    finally:
        r.close()


@pytest.mark.parametrize("kw, fails, match", [
    (dict(max_failed_groups=1), {1, 2}, "2 trajectory groups failed.*max_failed_groups=1"),
    (dict(max_failed_groups=5, max_failed_fraction=0.25), {1, 2}, r"the 1 allowed.*max_failed_fraction=0.25"),
    (dict(group_filter=lambda g: g.prompt.index % 2 == 0, max_filtered_groups=1), set(),
     "filter removed 2 .*max_filtered_groups=1"),
])
def test_past_the_eviction_budget_take_raises(char_tok, kw, fails, match):
    server = TokenServer(fail_seeds=fails)
    r = _rollouter(server, char_tok, groups_per_sync=4, staleness_threshold=0.0, partial_rollout=False,
                   config_prefix="trainer.v1.sampler.", **kw)
    try:
        r.feed(prompt_groups(0, 8, seed=None))
        with pytest.raises(agent.ReplayBudgetError, match=match) as e:
            r.take(4, timeout=30)
    finally:
        r.close()
    assert "trainer.v1.sampler." in str(e.value) and "\n" not in str(e.value)


# -- metrics ----------------------------------------------------------------------------------
def _group(index, started, trajectories, scores=None):
    results = []
    for j, (n, versions) in enumerate(trajectories):
        out = AgentLoopOutput(prompt_ids=[1], response_ids=[5] * n, response_mask=[1] * n,
                              response_logprobs=[0.0] * n, num_turns=2, metrics={}, extra_fields={},
                              response_versions=versions)
        score = None if scores is None else RowScore(score=scores[j], extra={}, num_errors=0,
                                                     num_timeouts=0, scored_at=0.0)
        results.append(("single_turn_agent", out, 0.0, score, 0.0))
    return agent.TrajectoryGroup(prompt_groups(index, 1, n=len(trajectories))[0], results, started, 0.0)


def test_off_policy_metrics_on_hand_built_groups():
    # at version 5: trajectories (oldest, newest token version) = (3, 4), (4, 4), (5, 5), and
    # one without model tokens, counted at its group's start version 5
    groups = [_group(0, 3, [(3, [3, 3, 4]), (4, [4, -1, 4, 4])]), _group(1, 5, [(1, [5]), (0, [])])]
    m = _replay.off_policy_metrics(groups, version=5)
    assert m == {
        "training/off_policy/trajectory_spans/mean": 1.25, "training/off_policy/trajectory_spans/max": 2.0,
        "training/off_policy/trajectory_spans/min": 1.0,
        "training/off_policy/trajectory_staleness/mean": 0.5, "training/off_policy/trajectory_staleness/max": 1.0,
        "training/off_policy/trajectory_staleness/min": 0.0,
        "training/off_policy/trajectory_staleness_worst/mean": 0.75,
        "training/off_policy/trajectory_staleness_worst/max": 2.0,
        "training/off_policy/trajectory_staleness_worst/min": 0.0}
    # trained lengths 3, 4, 1, 0 (mean 2) against 40 tokens in 8 generated trajectories (mean 5)
    assert _replay.length_bias(groups, 40, 8) == {"training/off_policy/length_bias": 0.4}
    assert _replay.length_bias(groups, 0, 0) == {}


def test_dapo_group_filter_keeps_groups_whose_scores_differ():
    keep = _replay.dapo_group_filter("score")
    assert keep(_group(0, 0, [(1, [0]), (1, [0])], scores=[1.0, 0.0]))
    assert not keep(_group(0, 0, [(1, [0]), (1, [0])], scores=[1.0, 1.0]))
    assert keep(_group(0, 0, [(1, [0])], scores=[1.0]))  # a group of one, as verl
    with pytest.raises(ValueError, match="unknown group filter metric"):
        _replay.dapo_group_filter("seq_reward")


def test_wait_feasibility_counts_each_start_version_against_its_deadline():
    # bound 1, 2 groups a version, at version 1 with 2 taken: two version-0 groups would miss
    # their last take, version-1 ones have one more interval
    assert not _replay.wait_feasible([0, 0], version=1, bound=1, consumed=2, per_sync=2)
    assert _replay.wait_feasible([1, 1], version=1, bound=1, consumed=2, per_sync=2)
    assert not _replay.wait_feasible([1, 1, 1], version=1, bound=1, consumed=2, per_sync=2)
    assert _replay.wait_feasible([0, 0], version=1, bound=1, consumed=0, per_sync=2)
    assert _replay.wait_feasible([-3], version=1, bound=1, consumed=2, per_sync=2)  # lost anyway


# -- checkpoints ------------------------------------------------------------------------------
def test_state_round_trip_keeps_finished_and_reissues_pending_with_the_new_bookkeeping(char_tok):
    asked = []

    def refill(n):
        asked.append(n)
        return prompt_groups(10, n, n=1, seed=10)

    server = GatedServer(released={0, 1}, fail_seeds={1})
    r = _rollouter(server, char_tok, groups_per_sync=4, staleness_threshold=0.0, refill=refill,
                   max_failed_groups=2)
    try:
        r.feed(prompt_groups(0, 4, n=1, seed=None))
        # 0 finishes, 1 fails and is refilled by 10; 2, 3 and 10 hang at the server
        _wait_for(r, lambda: len(r.queue) == 1 and r.counters["groups_failed"] == 1
                  and len(r._inflight) == 3)
        state = json.loads(json.dumps(r.state()))
    finally:
        r.close()
    assert [g["prompt"]["index"] for g in state["queued"]] == [0]
    assert [p["index"] for p in state["pending"]] == [2, 3, 10]
    assert state["counters"]["groups_refilled"] == 1 and state["window"]["failed"] == 1
    server2 = GatedServer(released={2, 3, 10})
    r2 = _rollouter(server2, char_tok, groups_per_sync=4, staleness_threshold=0.0, refill=refill,
                    max_failed_groups=2)
    try:
        r2.restore(state)
        taken = r2.take_batch(4, timeout=30)
        stats = r2.stats()
    finally:
        r2.close()
    assert _indices(taken.groups) == [0, 2, 3, 10]
    assert server2.arrived == 3  # the queued group was kept, not generated again
    assert (stats["groups_failed"], stats["groups_refilled"]) == (1, 1)
    # the step's evictions and lengths before the checkpoint count in the next take's metrics
    assert taken.metrics["training/replay/failed_groups"] == 1
    assert taken.metrics["training/replay/refilled_groups"] == 1
    assert taken.metrics["training/off_policy/length_bias"] == pytest.approx(1.0)
    assert asked == [1]


def test_the_rollouter_refuses_a_bad_strategy_or_threshold(char_tok):
    with pytest.raises(ValueError, match="max_off_policy_strategy='keep'"):
        _rollouter(TokenServer(), char_tok, max_off_policy_strategy="keep")
    with pytest.raises(ValueError, match="max_off_policy_threshold=0"):
        _rollouter(TokenServer(), char_tok, max_off_policy_threshold=0)
