"""The fully-async rollouter and trajectory queue over a token-by-token stand-in server: groups stay
together, the staleness bound holds under random generation lengths, partial rollout keeps a
trajectory's tokens across a sync and records their versions, and a saved state resumes to the
same next batch."""

import numpy as np
import pytest

from agent_helpers import TokenServer, make_runner, prompt_groups
from jaxrl_llm import agent
from rollout import SamplingParams


_runner, _groups = make_runner, prompt_groups


def _train(rollouter, server, *, steps, k, trigger, bound):
    """The trainer's side: take k groups per step, sync every `trigger` steps."""
    taken, fed = [], 0
    for step in range(steps):
        while fed < (step + 3) * k + rollouter.max_groups:  # keep prompts waiting
            rollouter.feed(_groups(fed, k))
            fed += k
        taken.append((rollouter.version, rollouter.take(k, max_staleness=bound, timeout=60)))
        if (step + 1) % trigger == 0:
            rollouter.pause()
            server.version += 1
            rollouter.resume(server.version)
    return taken


@pytest.mark.parametrize("s, partial, trigger", [(0.0, False, 1), (0.0, False, 2), (0.5, False, 1),
                                                 (1.0, False, 2), (0.5, True, 1), (1.5, True, 1)])
def test_staleness_never_exceeds_the_bound(char_tok, s, partial, trigger):
    server = TokenServer()
    k = 4
    r = agent.Rollouter(_runner(server, char_tok), sampling=SamplingParams(temperature=1.0),
                        groups_per_sync=k * trigger, staleness_threshold=s, partial_rollout=partial)
    bound = int(np.ceil(s))
    try:
        taken = _train(r, server, steps=8, k=k, trigger=trigger, bound=bound)
        stats = r.stats()
    finally:
        r.close()
    seen = set()
    staleness = []
    for version, groups in taken:
        assert len(groups) == k
        for g in groups:
            assert g.prompt.index not in seen  # nothing is trained twice
            seen.add(g.prompt.index)
            rows = [out.response_ids for _, out, *_ in g.results]
            assert len(rows) == g.prompt.n  # a group's n trajectories travel together
            staleness.append(version - g.min_version)
            if not partial:  # without partial rollout one policy version generates a whole group
                assert g.min_version == g.max_version
    assert max(staleness) <= bound
    if s == 0:
        assert max(staleness) == 0 and stats["groups_dropped_stale"] == 0
    else:  # the rollout really ran ahead
        assert max(staleness) >= 1
    if not partial:  # the admission budget alone keeps the bound: nothing had to be dropped
        assert stats["groups_dropped_stale"] == 0


def test_partial_rollout_keeps_tokens_and_records_versions(char_tok):
    """A request in flight at a sync continues (no restart): its early tokens carry the old
    version, the rest the new one, and the tokens are exactly those of an uninterrupted run."""
    server = TokenServer(max_len=12, delay=0.01)
    r = agent.Rollouter(_runner(server, char_tok), sampling=SamplingParams(temperature=1.0),
                        groups_per_sync=2, staleness_threshold=1.0, partial_rollout=True)
    try:
        r.feed(_groups(0, 2, n=1))
        import time
        time.sleep(0.03)  # the groups are mid-generation
        assert r.pause() < 0.01  # partial rollout: a sync does not wait for running requests
        server.version = 1
        r.resume(1)
        groups = r.take(2, max_staleness=1, timeout=30)
    finally:
        r.close()
    spans = [g for g in groups if g.min_version != g.max_version]
    assert spans, "no trajectory spanned the sync"
    for g in groups:
        out = g.results[0][1]
        rng = np.random.default_rng([7, g.prompt.first_row])
        n = int(rng.integers(1, 13))
        assert out.response_ids == rng.integers(ord("a"), ord("z") + 1, size=n).tolist()
        assert out.response_versions == sorted(out.response_versions)  # old tokens first
        assert set(out.response_versions) <= {0, 1}


def test_stale_groups_are_dropped_and_generated_again(char_tok):
    server = TokenServer(delay=0.0005)
    r = agent.Rollouter(_runner(server, char_tok), sampling=SamplingParams(temperature=1.0),
                        groups_per_sync=4, staleness_threshold=1.0, partial_rollout=False)
    try:
        r.feed(_groups(0, 8))
        first = r.take(4, timeout=30)  # 8 groups may start at version 0
        for v in (1, 2):
            r.pause()
            server.version = v
            r.resume(v)
        # version 2 with bound 1: the 4 remaining version-0 groups are too old
        again = r.take(4, max_staleness=1, timeout=30)
        stats = r.stats()
        state = r.state()
    finally:
        r.close()
    assert stats["groups_dropped_stale"] == 4
    # a resumed run's rollouter goes on counting from the checkpoint's counts
    r2 = agent.Rollouter(_runner(TokenServer(), char_tok), sampling=SamplingParams(temperature=1.0),
                         groups_per_sync=4, staleness_threshold=1.0, partial_rollout=False)
    try:
        r2.restore(state)
        assert r2.stats()["groups_dropped_stale"] == 4
    finally:
        r2.close()
    assert sorted(g.prompt.index for g in again) == sorted(set(range(8)) - {g.prompt.index for g in first})
    assert all(g.min_version == 2 for g in again)


def test_state_resumes_to_the_same_next_batch(char_tok):
    """Save after a step (queue + unfinished prompts), restore into a new rollouter: the next
    batch is the one the original run takes (s = 0, so it is deterministic)."""
    def start(server):
        return agent.Rollouter(_runner(server, char_tok), sampling=SamplingParams(temperature=1.0),
                               groups_per_sync=4, staleness_threshold=0.0, partial_rollout=False)
    server = TokenServer()
    r = start(server)
    try:
        r.feed(_groups(0, 12))
        r.take(4, max_staleness=0, timeout=30)
        r.pause()
        server.version = 1
        r.resume(1)
        r.take(1, max_staleness=0, timeout=30)  # mid-interval: one group consumed
        state = r.state()
        nxt = r.take(3, max_staleness=0, timeout=30)
    finally:
        r.close()
    assert state["consumed_since_sync"] == 1
    import json
    state = json.loads(json.dumps(state))  # it goes into the checkpoint's JSON
    server2 = TokenServer()
    server2.version = 1
    r2 = start(server2)
    try:
        r2.resume(1)
        r2.restore(state)
        again = r2.take(3, max_staleness=0, timeout=30)
    finally:
        r2.close()
    key = lambda gs: sorted((g.prompt.index, [o.response_ids for _, o, *_ in g.results]) for g in gs)  # noqa: E731
    assert key(again) == key(nxt)


def test_a_failing_agent_loop_fails_take(char_tok):
    class Broken(TokenServer):
        async def agenerate(self, *a, **k):
            raise RuntimeError("engine on fire")
    r = agent.Rollouter(_runner(Broken(), char_tok), sampling=SamplingParams(temperature=1.0),
                        groups_per_sync=2, staleness_threshold=0.0, partial_rollout=False)
    try:
        r.feed(_groups(0, 2))
        with pytest.raises(RuntimeError, match="engine on fire"):
            r.take(2, timeout=30)
    finally:
        r.close()
