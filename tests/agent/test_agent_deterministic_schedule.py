"""The rollouter's deterministic schedule (`Rollouter(deterministic=True)`,
`trainer.v1.deterministic_schedule`): over a stand-in server whose tokens take random time, and a
trainer that takes random time per step, which groups each take hands out and which policy
version generated every token follow the counter rule exactly (take t: positions t*k ..
t*k+k-1; a group starts in the first sync interval its position allows; a due group over the
bound is generated again), with partial rollout on; a state saved after any step and restored
into a new rollouter continues with the same takes."""
import json
import random
import time

import pytest

from agent_helpers import TokenServer, make_runner, prompt_groups
from jaxrl_llm import agent
from rollout import SamplingParams

K = 4


def _rollouter(server, tok, s, *, partial=True, deterministic=True, bound=None):
    return agent.Rollouter(make_runner(server, tok), sampling=SamplingParams(temperature=1.0),
                           groups_per_sync=K, staleness_threshold=s, partial_rollout=partial,
                           max_off_policy_threshold=None if bound is None else bound + 1,
                           deterministic=deterministic)


def _steps(r, server, first, last, jitter, fed):
    """Steps first .. last-1 of a trainer that feeds ahead, takes K, trains (a random pause),
    syncs. Returns [(step, version, [(index, token versions, tokens)])] and the fed count."""
    out = []
    for step in range(first, last):
        while fed < (step + 3) * K:
            r.feed(prompt_groups(fed, K, seed=None))
            fed += K
        groups = r.take(K, timeout=60)
        out.append((step, r.version, [(g.prompt.index, [o.response_versions for _, o, *_ in g.results],
                                       [o.response_ids for _, o, *_ in g.results]) for g in groups]))
        jitter()  # "training": the rollouter runs on meanwhile, for a random time (a perturbation)
        r.pause()
        server.version += 1
        r.resume(server.version)
    return out, fed


def _expected_version(index, s, bound):
    """The version that generates group `index` under the rule: it may start in interval a (base
    a*K, max_groups floor((1+s)K)), is due at take d = index // K, and is generated again at d
    when d - a is over the bound."""
    max_groups = int((1 + s) * K + 1e-9)
    a = max(0, (index - max_groups) // K + 1)
    d = index // K
    return d if bound is not None and d - a > bound else a


@pytest.mark.parametrize("s, bound", [(1.5, None), (1.5, 1), (0.5, 0)])
def test_takes_and_versions_follow_the_counters_whatever_the_timing(char_tok, s, bound):
    runs = []
    for seed in (0, 1):
        rnd = random.Random(seed)
        server = TokenServer(max_len=12, delay=0.002 * (1 + seed))
        r = _rollouter(server, char_tok, s, bound=bound)
        try:
            steps, _ = _steps(r, server, 0, 6, lambda: time.sleep(rnd.uniform(0, 0.03)), 0)
            stats = r.stats()
        finally:
            r.close()
        runs.append(steps)
        for step, version, groups in steps:
            assert version == step
            assert [i for i, _, _ in groups] == list(range(step * K, step * K + K))
            for index, versions, _ in groups:
                want = _expected_version(index, s, bound)
                assert all(v == [want] * len(v) for v in versions), (index, versions, want)
        if bound is not None and bound < s:
            assert stats["groups_dropped_stale"] > 0  # the bound really dropped due groups
    assert runs[0] == runs[1]


def test_a_sync_waits_for_running_groups_even_with_partial_rollout(char_tok):
    """Counter-based versions need whole groups per version: the pause waits (a running group
    is finished when it returns, none spans the sync)."""
    server = TokenServer(max_len=12, delay=0.005)
    r = _rollouter(server, char_tok, 1.0)
    try:
        r.feed(prompt_groups(0, 8, seed=None))
        r.take(K, timeout=60)
        r.pause()
        assert r.stats()["running"] == 0
        server.version = 1
        r.resume(1)
        groups = r.take(K, timeout=60)
    finally:
        r.close()
    assert all(g.min_version == g.max_version == 0 for g in groups)


@pytest.mark.parametrize("save_after", [1, 3])
def test_a_restored_state_continues_with_the_same_takes(char_tok, save_after):
    s, total = 1.5, 5
    server = TokenServer(max_len=12)
    r = _rollouter(server, char_tok, s, bound=1)
    try:
        whole, _ = _steps(r, server, 0, total, lambda: None, 0)
    finally:
        r.close()
    server = TokenServer(max_len=12)
    r = _rollouter(server, char_tok, s, bound=1)
    try:
        head, fed = _steps(r, server, 0, save_after, lambda: None, 0)
        state = json.loads(json.dumps(r.state()))  # the checkpoint's JSON, while groups run
    finally:
        r.close()
    assert state["taken"] == save_after * K
    server = TokenServer(max_len=12)
    server.version = save_after
    r = _rollouter(server, char_tok, s, bound=1, deterministic=True)
    try:
        r.resume(save_after)  # the restored server's version
        r.restore(state)
        tail, _ = _steps(r, server, save_after, total, lambda: None, fed)
    finally:
        r.close()
    assert head + tail == whole


@pytest.mark.parametrize("kwargs", [dict(refill=lambda n: []), dict(max_failed_groups=1),
                                    dict(group_filter=lambda g: True)])
def test_evicting_groups_is_refused(char_tok, kwargs):
    with pytest.raises(ValueError, match="deterministic schedule: groups may not be evicted"):
        agent.Rollouter(make_runner(TokenServer(), char_tok), sampling=SamplingParams(temperature=1.0),
                        groups_per_sync=K, staleness_threshold=1.0, partial_rollout=True,
                        deterministic=True, **kwargs)


def test_a_state_written_without_the_schedule_is_refused(char_tok):
    """Its takes went by finish order, so "positions below `taken` were trained" does not hold."""
    r = _rollouter(TokenServer(), char_tok, 1.0, deterministic=False)
    try:
        r.feed(prompt_groups(0, 8, seed=None))
        r.take(K, timeout=60)
        state = r.state()
    finally:
        r.close()
    assert state["deterministic"] is False
    r = _rollouter(TokenServer(), char_tok, 1.0)
    try:
        with pytest.raises(ValueError, match="written without the deterministic schedule.*"
                                             "trainer.v1.deterministic_schedule=False"):
            r.restore(state)
    finally:
        r.close()
