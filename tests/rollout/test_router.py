"""ReplicaRouter over 2 in-process replicas, each a RolloutServer over its own engine on its own
CPU device: stickiness and parked-KV reuse, least-in-flight balance, the bound per replica, tokens
equal to one server's, weight-sync and sleep fan-out, replica death (the scheduler failing
mid-decode, and a replica the caller drops), no replica left, request errors, and the agent
runner over a router.

Where a test needs placements that do not depend on timing it suspends the replicas, submits,
then resumes (a suspended replica takes requests but runs none); where it needs a replica to fail
at a known point it hooks that engine's `decode_loop`. No sleeps.
"""
import asyncio
import collections
import logging
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import rollout
import sharding
from conftest import greedy_reference, hook_decode

GREEDY = rollout.SamplingParams(0.0)
SAMPLED = rollout.SamplingParams(1.0, 20, 0.95)


@pytest.fixture(scope="module")
def engines(tiny_model, stop_id):
    """Two engines like tiny_engine (4 slots, bucket 16, 32 positions), on CPU devices 0 and 1.
    (An engine on a device no test used yet compiles all its programs again, ~10 s on 2 shared
    cores; one on device 0 reuses tiny_engine's from the compilation cache.)"""
    return [rollout.Engine.from_model(
        tiny_model, mesh=sharding.make_mesh((1, 1, 1), devices=[jax.devices()[d]]),
        max_concurrent_decodes=4, max_prefill_length=16, max_target_length=32, temperature=0.0,
        stop_token_ids=(stop_id,), pad_token_id=0, layer_layout="per_layer") for d in (0, 1)]


class Recording(rollout.LocalReplica):
    """A LocalReplica that logs where each request went and its peak of requests in flight."""

    def __init__(self, server, index, placed):
        super().__init__(server)
        self.index, self.placed = index, placed
        self.outstanding = self.peak = 0
        self._lock = threading.Lock()

    def submit(self, request_id, prompt_ids, **kwargs):
        future = super().submit(request_id, prompt_ids, **kwargs)
        with self._lock:
            self.outstanding += 1
            self.peak = max(self.peak, self.outstanding)
            self.placed[request_id].append(self.index)
        future.add_done_callback(self._done)
        return future

    def _done(self, _):
        with self._lock:
            self.outstanding -= 1


def make_router(engines, n=2, steps_per_sync=4, **kwargs):
    placed = collections.defaultdict(list)
    replicas = [Recording(rollout.RolloutServer(e, steps_per_sync=steps_per_sync), i, placed)
                for i, e in enumerate(engines[:n])]
    return rollout.ReplicaRouter(replicas, **kwargs), replicas, placed


def reference(tiny_engine, calls):
    """What one RolloutServer gives for the same requests (dicts of submit kwargs)."""
    with rollout.RolloutServer(tiny_engine, steps_per_sync=4) as srv:
        futures = {c["request_id"]: srv.submit(**c) for c in calls}
        return {k: f.result() for k, f in futures.items()}


def mixed_calls(prompts, count, seed=5):
    """Requests of mixed prompt lengths, budgets and sampling, each its own (seed, row)."""
    rng = np.random.default_rng(seed)
    return [dict(request_id=f"q{i}", prompt_ids=prompts[i % len(prompts)],
                 sampling=SAMPLED if i % 3 == 2 else GREEDY,
                 max_new_tokens=int(rng.integers(2, 17)), seed=seed, row=i) for i in range(count)]


def assert_same_tokens(outs, want):
    assert sorted(outs) == sorted(want)
    for k, out in outs.items():
        assert out.token_ids == want[k].token_ids, k
        np.testing.assert_allclose(out.log_probs, want[k].log_probs, atol=1e-5)
        assert out.finish_reason == want[k].finish_reason, k


# ---------------------------------------------------------------- routing
def test_sessions_stay_on_their_replica_and_reuse_its_parked_kv(engines, tiny_engine, prompts):
    """4 sessions x 3 turns on 2 replicas: first turns spread 0, 1, 0, 1 (least in flight, ties
    lowest index); every later turn goes to its session's replica and reuses the parked KV; the
    tokens are one server's."""
    tool = [11, 12, 13]
    router, replicas, placed = make_router(engines)

    async def session(s, first):
        outs, asked = [await asyncio.wrap_future(first)], [list(prompts[s])]
        for turn in (1, 2):
            asked.append(asked[-1] + outs[-1].token_ids + tool)
            outs.append(await router.agenerate(f"s{s}-{turn}", asked[-1], sampling=GREEDY,
                                               max_new_tokens=3, session_id=f"s{s}", seed=1,
                                               row=10 * s + turn))
        router.release_session(f"s{s}")
        return outs, asked

    with router:
        router.suspend()
        firsts = [router.submit(f"s{s}-0", prompts[s], sampling=GREEDY, max_new_tokens=3,
                                session_id=f"s{s}", seed=1, row=10 * s) for s in range(4)]
        assert [placed[f"s{s}-0"] for s in range(4)] == [[0], [1], [0], [1]]
        router.resume()

        async def all_sessions():
            return await asyncio.gather(*(session(s, firsts[s]) for s in range(4)))

        results = asyncio.run(all_sessions())
        metrics, stats = router.metrics(), router.stats
    for s, (outs, _) in enumerate(results):
        assert [placed[f"s{s}-{t}"] for t in range(3)] == [[s % 2]] * 3
        assert outs[0].num_cached_tokens == 0
        assert all(o.num_cached_tokens > 0 for o in outs[1:]), s  # the parked KV of its replica
    assert stats["reused_tokens"] == sum(o.num_cached_tokens for outs, _ in results for o in outs) > 0
    assert (stats["session_requests"], stats["sticky_requests"]) == (8, 8)
    assert metrics["rollout/router/stickiness"] == 1.0
    assert metrics["rollout/replica/0/prefix_hit_rate"] > 0
    with rollout.RolloutServer(tiny_engine, steps_per_sync=4) as one:  # the same turns, one server
        for s, (outs, asked) in enumerate(results):
            for turn, (out, ids) in enumerate(zip(outs, asked)):
                want = one.generate(f"s{s}-{turn}", ids, sampling=GREEDY, max_new_tokens=3,
                                    session_id=f"s{s}", seed=1, row=10 * s + turn)
                assert out.token_ids == want.token_ids, (s, turn)


def test_least_in_flight_sends_new_requests_away_from_a_busy_replica(engines, tiny_engine, prompts):
    """A replica held up by a long request gets the next request only once the others have as
    many in flight (a round robin would send it there first); the tokens are one server's."""
    router, replicas, placed = make_router(engines)
    calls = mixed_calls(prompts, 6)
    calls[0].update(max_new_tokens=20, sampling=GREEDY)  # the long one
    with router:
        replicas[0].server.suspend()  # replica 0 sits on its request
        first = [router.submit(**c) for c in calls[:2]]
        assert [placed[c["request_id"]] for c in calls[:2]] == [[0], [1]]
        first[1].result()
        assert router.in_flight() == [1, 0]
        router.suspend()  # the rest placed before any of them can end
        later = [router.submit(**c) for c in calls[2:]]
        # least in flight, ties to the lowest index (a round robin would start at replica 0)
        assert [placed[c["request_id"]] for c in calls[2:]] == [[1], [0], [1], [0]]
        router.resume()
        outs = {c["request_id"]: f.result() for c, f in zip(calls, first + later)}
        metrics = router.metrics()
    assert_same_tokens(outs, reference(tiny_engine, calls))
    assert [metrics[f"rollout/replica/{i}/requests"] for i in range(2)] == [3.0, 3.0]
    assert metrics["rollout/router/imbalance_requests"] == 1.0
    tokens = [sum(len(o.token_ids) for k, o in outs.items() if placed[k] == [i]) for i in range(2)]
    assert metrics["rollout/router/imbalance_tokens"] == pytest.approx(max(tokens) / np.mean(tokens))


def test_bound_per_replica_queues_the_rest_in_the_router(engines, tiny_engine, prompts):
    """max_inflight_per_replica=2 on 2 replicas: 4 requests dispatched, 8 wait in the router's
    queue and run as slots free up; no replica ever has more than 2; tokens are one server's."""
    router, replicas, placed = make_router(engines, n=2, max_inflight_per_replica=2)
    calls = mixed_calls(prompts, 12, seed=8)
    with router:
        router.suspend()
        futures = [router.submit(**c) for c in calls]
        assert router.in_flight() == [2, 2]
        metrics = router.metrics()
        assert metrics["rollout/router/queue"] == 8.0
        assert [metrics[f"rollout/replica/{i}/in_flight"] for i in range(2)] == [2.0, 2.0]
        router.resume()
        outs = {c["request_id"]: f.result() for c, f in zip(calls, futures)}
        stats = router.stats
    assert [r.peak for r in replicas] == [2, 2]
    assert stats["waited_requests"] == 8 and stats["requests_finished"] == 12
    assert all(len(p) == 1 for p in placed.values()) and len(placed) == 12
    assert {p[0] for p in placed.values()} == {0, 1}
    assert_same_tokens(outs, reference(tiny_engine, calls))
    with pytest.raises(ValueError, match="max_inflight_per_replica"):
        rollout.ReplicaRouter(replicas, max_inflight_per_replica=0)


def test_abort_and_cancel_reach_queued_and_dispatched_requests(engines, prompts):
    router, replicas, placed = make_router(engines, n=2, max_inflight_per_replica=1)
    kw = dict(sampling=GREEDY, max_new_tokens=4)
    with router:
        router.suspend()
        running = router.submit("run", prompts[0], **kw)
        other = router.submit("other", prompts[1], **kw)
        queued = router.submit("queued", prompts[2], **kw)
        cancelled = router.submit("cancelled", prompts[3], **kw)
        assert "queued" not in placed and router.in_flight() == [1, 1]
        assert cancelled.cancel() and router.abort("queued")
        assert router.abort("run")  # its slot frees: nothing queued is left to take it
        assert not router.abort("queued") and not router.abort("never")
        out = queued.result()
        assert (out.finish_reason, out.token_ids, out.num_prompt_tokens) == ("abort", [], len(prompts[2]))
        router.resume()
        assert running.result().finish_reason == "abort"
        assert other.result().finish_reason in ("stop", "length")
        assert "cancelled" not in placed  # it never reached a replica
        again = router.generate("run", prompts[0], **kw)  # the id is free again
        assert again.finish_reason in ("stop", "length")


def test_request_errors_raise_at_submit_and_are_not_retried(engines, prompts):
    router, replicas, placed = make_router(engines, n=2)
    kw = dict(sampling=GREEDY, max_new_tokens=4)
    with router:
        with pytest.raises(ValueError, match="empty"):
            router.submit("a", [], **kw)
        with pytest.raises(ValueError, match="max_target_length"):
            router.submit("a", list(range(1, 30)), **kw)
        with pytest.raises(ValueError, match="step_offset"):
            router.submit("a", [1], step_offset=-1, **kw)
        with pytest.raises(TypeError, match="SamplingParams"):
            router.submit("a", [1], sampling=0.0, max_new_tokens=2)
        router.suspend()
        router.submit("a", [1, 2], **kw)
        with pytest.raises(ValueError, match="already pending or running"):
            router.submit("a", [1, 2], **kw)
        router.resume()
        assert dict(placed) == {"a": [0]}
        assert router.stats.get("dead_replicas", 0) == 0 and router.live_replicas == [0, 1]


class Refusing(Recording):
    """A replica that refuses request "bad" as a bad request (what a remote one may say late)."""

    def submit(self, request_id, prompt_ids, **kwargs):
        if request_id == "bad":
            raise ValueError("request 'bad': refused by the replica")
        return super().submit(request_id, prompt_ids, **kwargs)


def test_a_request_error_from_a_replica_fails_that_request_only(engines, prompts):
    placed = collections.defaultdict(list)
    replicas = [Refusing(rollout.RolloutServer(e, steps_per_sync=4), i, placed)
                for i, e in enumerate(engines)]
    with rollout.ReplicaRouter(replicas) as router:
        bad = router.submit("bad", prompts[0], sampling=GREEDY, max_new_tokens=4)
        with pytest.raises(ValueError, match="refused by the replica"):
            bad.result()
        assert router.live_replicas == [0, 1] and router.in_flight() == [0, 0]
        assert router.generate("good", prompts[0], sampling=GREEDY, max_new_tokens=4).token_ids
        assert placed["good"] == [0] and router.stats.get("retried_requests", 0) == 0


# ---------------------------------------------------------------- eviction-aware placement
TOOL = [11, 12, 13]


@pytest.mark.parametrize("reserve", [None, 0])
def test_a_parked_session_keeps_its_kv_while_a_new_session_waits(engines, tiny_model, prompts, stop_id,
                                                                  reserve):
    """More sessions than slots on one replica (4 slots, bound 4): 3 long requests run, session
    a's first turn ends and parks, new session b waits in the router. With the default
    parked_reserve (2) b stays there (3 in flight + a parked fill the 4 slots), a's next turn reuses
    a's KV (hit rate > 0, no eviction), and b runs once a slot frees. parked_reserve=0 (the
    router before the reserve) sends b at once (3 in flight < 4): the replica, with no free slot,
    evicts a's parked KV and a's next turn is prefilled in full (hit rate 0). No timing: b's
    dispatch happens on the scheduler thread as a's turn ends, before the next decode loop, and
    the long requests (no stop token in their 12 tokens) end 2 decode loops later; were the test
    thread slower than that, b would find free slots and a would still keep its KV. The bound
    holds and every later turn goes to its session's replica."""
    long = next(p for p in prompts if len(p) <= 8 and stop_id not in greedy_reference(tiny_model, p, 12))
    router, replicas, placed = make_router(engines, n=1, parked_reserve=reserve)
    kw = dict(sampling=GREEDY, seed=2)
    with router:
        assert router.reserves == [2 if reserve is None else 0]
        router.metrics()
        router.suspend()
        longs = [router.submit(f"long{k}", long, max_new_tokens=12, row=k, **kw) for k in range(3)]
        a0 = router.submit("a0", prompts[1], max_new_tokens=2, session_id="a", row=3, **kw)
        b0 = router.submit("b0", prompts[2], max_new_tokens=2, session_id="b", row=4, **kw)
        assert router.in_flight() == [4] and "b0" not in placed  # b waits for the bound
        router.resume()
        first = a0.result()
        a1 = router.generate("a1", prompts[1] + first.token_ids + TOOL, max_new_tokens=3, session_id="a",
                             row=5, **kw)
        outs = [f.result() for f in longs] + [b0.result()]
        router.release_session("a")
        router.release_session("b")
        metrics, stats = router.metrics(), router.stats
    assert all(o.finish_reason == "length" for o in outs[:3]) and outs[3].finish_reason in ("stop", "length")
    assert replicas[0].peak == 4 and stats["waited_requests"] >= 1  # the bound
    assert placed["a1"] == placed["a0"] == [0] and metrics["rollout/router/stickiness"] == 1.0
    assert (stats["session_requests"], stats["sticky_requests"]) == (1, 1)
    if reserve is None:
        assert a1.num_cached_tokens == len(prompts[1]) + len(first.token_ids) - 1  # a's KV, all of it
        assert stats.get("evictions", 0) == 0 and metrics["rollout/replica/0/prefix_hit_rate"] > 0
    else:
        assert a1.num_cached_tokens == 0 and stats["evictions"] >= 1
        assert metrics["rollout/replica/0/prefix_hit_rate"] == 0


def test_a_new_request_prefers_a_replica_with_a_free_slot(engines, prompts):
    """Replica 0 holds 3 parked sessions (more than its reserve of 2) and 1 request in flight: all
    4 slots taken, so a new request there would evict a parked session. Replica 1 has 1 in flight
    and free slots: the next new request goes there, although least-in-flight alone would pick
    replica 0 (a tie, lowest index). Session turns still go home, and releasing sessions frees
    their reserve."""
    router, replicas, placed = make_router(engines, n=2)
    kw = dict(sampling=GREEDY, max_new_tokens=2, seed=3)
    with router:
        replicas[1].server.suspend()
        held = router.submit("held", prompts[0], row=0, **kw)  # replica 0 (tie), then
        assert placed["held"] == [0]
        replicas[0].server.suspend()
        other = router.submit("other", prompts[0], row=1, **kw)  # replica 1 (least in flight): held there
        replicas[0].server.resume()
        held.result()
        for s in range(3):  # sessions s0..s2 on replica 0 (fewer in flight), each parked there
            router.generate(f"s{s}", prompts[s + 1], session_id=f"s{s}", row=2 + s, **kw)
        assert [placed[f"s{s}"] for s in range(3)] == [[0]] * 3
        router.suspend()
        router.submit("busy", prompts[4], row=6, **kw)  # replica 0: 0 in flight vs 1
        assert placed["busy"] == [0] and router.in_flight() == [1, 1]
        metrics = router.metrics()
        assert [metrics[f"rollout/replica/{i}/parked"] for i in range(2)] == [3.0, 0.0]
        new = router.submit("new", prompts[5], row=7, **kw)
        assert placed["new"] == [1]  # a free slot there; replica 0 would evict s0
        turn = router.submit("s0-1", prompts[1] + [9], session_id="s0", row=8, **kw)
        assert placed["s0-1"] == [0]  # a session's turn goes home (its parked slot), within the bound
        router.resume()
        for f in (other, new, turn):
            f.result()
        for s in range(3):
            router.release_session(f"s{s}")
        assert router.metrics()["rollout/replica/0/parked"] == 0.0
    with pytest.raises(ValueError, match="parked_reserve=4 must be below"):
        rollout.ReplicaRouter(replicas, parked_reserve=4)
    with pytest.raises(ValueError, match="parked_reserve must be an int"):
        rollout.ReplicaRouter(replicas, parked_reserve=-1)


def test_the_reserve_keeps_new_requests_within_the_slots_and_zero_turns_it_off(engines, prompts):
    """max_inflight_per_replica=6 on a replica of 4 slots: with the reserve on, 4 requests are
    sent (a fifth would wait in the replica's own queue and, admitted as a session parks, evict
    it); parked_reserve=0 sends 6, as the bound says."""
    for reserve, sent in ((None, 4), (0, 6)):
        router, replicas, placed = make_router(engines, n=1, max_inflight_per_replica=6, parked_reserve=reserve)
        with router:
            router.suspend()
            futures = [router.submit(**c) for c in mixed_calls(prompts, 8)]
            assert router.in_flight() == [sent] and len(placed) == sent
            router.resume()
            assert all(f.result().finish_reason in ("stop", "length") for f in futures)
        assert replicas[0].peak == sent


def test_a_caller_waiting_for_every_first_turn_still_progresses(engines, prompts):
    """6 sessions on one replica of 4 slots, the caller waiting for all 6 first turns before any
    second turn (a batch-style loop): the reserve (2 slots) never blocks a replica with nothing in
    flight, so every first turn runs. The second turns, sent in session order while the replica
    holds: s0 and s1 (KV evicted by s4 and s5's first turns) take the 2 unreserved slots, s2 and
    s3 (their KV about to go to s0 and s1) wait, s4 and s5 (the 2 sessions in the reserve) go to
    their parked KV. Before the reserve, s0..s3 went first and evicted everyone: no reuse."""
    router, replicas, placed = make_router(engines, n=1)
    kw = dict(sampling=GREEDY, max_new_tokens=2, seed=4)
    with router:
        router.suspend()
        firsts = [router.submit(f"s{s}-0", prompts[s], session_id=f"s{s}", row=s, **kw) for s in range(6)]
        router.resume()
        outs = [f.result() for f in firsts]
        router.suspend()
        seconds = [router.submit(f"s{s}-1", prompts[s] + outs[s].token_ids + TOOL, session_id=f"s{s}",
                                 row=10 + s, **kw) for s in range(6)]
        assert [placed[f"s{s}-1"] for s in range(6)] == [[0], [0], [], [], [0], [0]]
        router.resume()
        cached = [f.result().num_cached_tokens for f in seconds]
        stats = router.stats
    assert replicas[0].peak <= 4 and stats["requests_finished"] == 12
    assert [c > 0 for c in cached] == [False] * 4 + [True] * 2


# ---------------------------------------------------------------- fan-out
@pytest.fixture
def other_weights(tiny_model, engines):
    """tiny_model with another final-norm scale (other logits); the engines get theirs back."""
    other = nnx.clone(tiny_model)
    scale = np.random.default_rng(4).uniform(0.2, 3.0, tiny_model.config.hidden_size)
    other.model.norm.scale[...] = jnp.asarray(scale, jnp.float32)
    yield other
    for e in engines:
        e.update_params(tiny_model)


def test_weight_sync_reaches_every_replica_at_one_version(engines, tiny_model, other_weights,
                                                          prompts, stop_id):
    """A shared tree and per-replica trees (a callable called for each live replica, a list)
    reach all replicas at the same version; the tokens after it are the new weights' on every
    replica; sleep and wake fan out too (the engines' weights come back from a per-replica sync)."""
    router, replicas, placed = make_router(engines)
    kw = dict(sampling=GREEDY, max_new_tokens=6)

    def spread():  # one request per replica (placed 0, 1)
        router.suspend()
        futures = [router.submit(f"v{router.policy_version}-{i}", prompts[i], **kw) for i in range(2)]
        router.resume()
        return [f.result() for f in futures]

    with router:
        stats = router.update_params(other_weights)
        assert stats["policy_version"] == 1 and stats["replicas"] == 2
        assert router.policy_version == 1 and [r.policy_version for r in replicas] == [1, 1]
        for i, out in enumerate(spread()):
            assert out.token_ids == greedy_reference(other_weights, prompts[i], 6, (stop_id,)), i
            assert out.policy_versions == [1] * len(out.token_ids)
        asked = []
        router.update_params(replica_params=lambda i: asked.append(i) or tiny_model, version=5)
        assert asked == [0, 1] and [r.policy_version for r in replicas] == [5, 5]
        for i, out in enumerate(spread()):
            assert out.token_ids == greedy_reference(tiny_model, prompts[i], 6, (stop_id,)), i
        slept = router.sleep()
        assert router.asleep and all(r.asleep for r in replicas)
        assert slept["kv_bytes"] > 0 and slept["weights_released"]
        with pytest.raises(RuntimeError, match="update_params"):
            router.wake()  # the per-layer engines released their weights
        router.update_params(replica_params=[other_weights] * 2)
        assert router.wake() == {"recomputed_requests": 0, "recomputed_tokens": 0}
        assert not router.asleep and not router.suspended and router.policy_version == 6
        for i, out in enumerate(spread()):
            assert out.token_ids == greedy_reference(other_weights, prompts[i], 6, (stop_id,)), i
        assert router.metrics()["rollout/replica/1/policy_version"] == 6.0
        with pytest.raises(ValueError, match="exactly one of"):
            router.update_params()
        with pytest.raises(ValueError, match="one per replica"):
            router.update_params(replica_params=[tiny_model])
        with pytest.raises(ValueError, match="in_flight"):
            router.update_params(tiny_model, in_flight="later")


# ---------------------------------------------------------------- replica death
def test_a_replica_failing_mid_decode_has_its_requests_retried_on_the_others(
        engines, tiny_engine, prompts, monkeypatch):
    """Replica 1's scheduler raises in its 2nd decode loop with 4 requests (one a session turn)
    in flight: they run again on replica 0 with the tokens a healthy run gives (the session's
    turn prefilled in full there, its next turn reusing that KV), and the metrics count the death
    and the retries."""
    router, replicas, placed = make_router(engines)
    calls = mixed_calls(prompts, 8, seed=3)
    for c in calls:
        c["max_new_tokens"] = 12  # 3 decode loops: nothing ends before the failure
    calls[1].update(session_id="chat")  # on replica 1
    hook_decode(monkeypatch, engines[1], {2: lambda: (_ for _ in ()).throw(RuntimeError("device lost"))})
    with router:
        router.suspend()
        futures = [router.submit(**c) for c in calls]
        assert [placed[c["request_id"]][0] for c in calls] == [0, 1] * 4
        router.resume()
        outs = {c["request_id"]: f.result() for c, f in zip(calls, futures)}
        assert router.live_replicas == [0]
        on_one = [c["request_id"] for c in calls if placed[c["request_id"]][0] == 1]
        assert all(len(placed[k]) == 2 and placed[k][1] == 0 for k in on_one)
        nxt = calls[1]["prompt_ids"] + outs["q1"].token_ids
        turn2 = router.generate("q1-next", nxt, sampling=GREEDY, max_new_tokens=3, session_id="chat")
        metrics, stats = router.metrics(), router.stats
    want = reference(tiny_engine, calls)
    assert_same_tokens(outs, want)
    # the retried turn was prefilled in full on its new replica, which then holds the session
    assert (outs["q1"].num_cached_tokens, outs["q1"].num_computed_prompt_tokens) == \
        (0, len(calls[1]["prompt_ids"]))
    assert placed["q1-next"] == [placed["q1"][1]] and turn2.num_cached_tokens > 0
    retried = sum(len(want[k].token_ids) > 4 for k in on_one)  # those still running in loop 2
    assert retried >= 1
    assert stats["dead_replicas"] == 1 and stats["retried_requests"] == retried
    assert metrics["rollout/router/dead_replicas"] == 1.0
    assert metrics["rollout/router/retried_requests"] == float(retried)
    assert metrics["rollout/replica/1/alive"] == 0.0 and metrics["rollout/router/live_replicas"] == 1.0
    assert metrics["rollout/router/stickiness"] == 0.5  # the retried turn moved; the next one stuck
    assert stats["requests_finished"] == 9


def test_a_replica_marked_dead_by_the_caller_hands_its_requests_over(engines, tiny_engine, prompts):
    router, replicas, placed = make_router(engines, n=2)
    calls = mixed_calls(prompts, 4, seed=11)
    with router:
        replicas[0].server.suspend()  # replica 0 hangs (as far as the router can tell)
        futures = [router.submit(**c) for c in calls]
        router.mark_dead(0, "its host stopped answering")
        outs = {c["request_id"]: f.result() for c, f in zip(calls, futures)}
        assert all(p[-1] == 1 for p in placed.values())
        assert router.stats["retried_requests"] == 2 and router.live_replicas == [1]
        with pytest.raises(IndexError):
            router.mark_dead(2)
    assert_same_tokens(outs, reference(tiny_engine, calls))


def test_no_live_replica_left_fails_every_request_with_one_clear_error(engines, prompts, monkeypatch):
    router, replicas, placed = make_router(engines, n=2)
    submitted = threading.Event()  # both replicas fail only once all 5 are in (else a late submit
                                   # meets the dead router first: CI30 under load)

    def boom(i):
        assert submitted.wait(60)
        raise RuntimeError(f"boom {i}")

    for i, e in enumerate(engines[:2]):
        hook_decode(monkeypatch, e, {1: lambda i=i: boom(i)})
    futures = [router.submit(f"r{i}", prompts[i], sampling=GREEDY, max_new_tokens=4) for i in range(5)]
    submitted.set()
    for f in futures:
        with pytest.raises(RuntimeError, match=r"no live rollout replica.*boom 0.*boom 1"):
            f.result(timeout=120)  # a guard against a hang, not a timing assertion
    with pytest.raises(RuntimeError, match="no live rollout replica"):
        router.submit("late", prompts[0], sampling=GREEDY, max_new_tokens=4)
    with pytest.raises(RuntimeError, match="no live rollout replica"):
        router.update_params(engines[0].params)
    assert router.stats["dead_replicas"] == 2
    router.close()


# ---------------------------------------------------------------- streaming (on_tokens)
def streaming(router, calls):
    """Submits `calls` with on_tokens; returns their futures and each one's calls as
    (future done at the call, token ids)."""
    given, futures = collections.defaultdict(list), {}
    for c in calls:
        rid = c["request_id"]
        futures[rid] = router.submit(**c, on_tokens=lambda ids, rid=rid: given[rid].append(
            (rid in futures and futures[rid].done(), list(ids))))
    return futures, given


def assert_streamed_prefix(given, outs):
    """Each request's streamed tokens, concatenated, are the start of its output (so no token came
    twice or out of order, and the output's tail is what was not streamed)."""
    for rid, out in outs.items():
        got = [t for _, ids in given[rid] for t in ids]
        assert got == out.token_ids[:len(got)], rid
        assert all(ids for _, ids in given[rid]) and not any(done for done, _ in given[rid]), rid


def long_greedy(tiny_model, prompts, stop_id, n=12, other=None):
    """The first prompt whose greedy run goes `n` tokens without the stop token (and, with
    `other` weights, also under those, its first tokens differing)."""
    for p in prompts:
        ref = greedy_reference(tiny_model, p, n, (stop_id,))
        alt = ref if other is None else greedy_reference(other, p, n, (stop_id,))
        if len(ref) == len(alt) == n and (other is None or alt[:4] != ref[:4]):
            return p, ref
    raise AssertionError("no such prompt")


def test_on_tokens_streams_through_the_router_from_both_replicas(engines, tiny_engine, prompts):
    """submit(on_tokens=...) over 2 replicas: each request gets its tokens while it runs, in
    order, once; its output starts with them and equals one server's."""
    router, replicas, placed = make_router(engines)
    calls = [dict(request_id=f"s{i}", prompt_ids=prompts[i], sampling=SAMPLED, max_new_tokens=14,
                  seed=9, row=i) for i in range(4)]
    with router:
        router.suspend()  # placements 0, 1, 0, 1
        futures, given = streaming(router, calls)
        router.resume()
        outs = {k: f.result() for k, f in futures.items()}
    assert_same_tokens(outs, reference(tiny_engine, calls))
    assert_streamed_prefix(given, outs)
    long = [k for k, o in outs.items() if len(o.token_ids) > 8]  # ran past 2 decode loops
    assert {placed[k][0] for k in long} == {0, 1}
    assert all(given[k] for k in long)


def test_on_tokens_streams_on_across_a_weight_sync_that_holds_the_requests(engines, tiny_model, prompts,
                                                                           monkeypatch):
    """A sync (in_flight="hold") lands on both replicas mid-request: the held requests stay where
    they are and stream on, each token once, the output starting with every token given and
    recording both versions."""
    router, replicas, placed = make_router(engines)
    synced = []
    hook_decode(monkeypatch, engines[0], {
        2: lambda: synced.append(router.submit_update(tiny_model, in_flight="hold"))})
    calls = [dict(request_id=f"w{i}", prompt_ids=prompts[i], sampling=SAMPLED, max_new_tokens=14,
                  seed=9, row=i) for i in range(2)]
    with router:
        router.suspend()  # placements 0, 1
        futures, given = streaming(router, calls)
        router.resume()
        outs = {k: f.result() for k, f in futures.items()}
        assert synced[0].result()["policy_version"] == 1
    assert_streamed_prefix(given, outs)
    assert [placed[k] for k in outs] == [[0], [1]]  # nothing was re-submitted
    crossed = [k for k, o in outs.items() if set(o.policy_versions) == {0, 1}]
    assert crossed and all(len(given[k]) >= 2 for k in crossed)


def test_on_tokens_gives_each_token_once_across_a_replica_failure(engines, tiny_engine, tiny_model,
                                                                  prompts, stop_id, monkeypatch):
    """Replica 1 dies in its 2nd decode loop after streaming its requests' first tokens; they are
    retried on replica 0, which samples them again: the caller gets each token once (those it had
    are not given again) and the output starts with them."""
    router, replicas, placed = make_router(engines)
    prompt, _ = long_greedy(tiny_model, prompts, stop_id)
    calls = [dict(request_id=f"f{i}", prompt_ids=prompt if i % 2 else prompts[i], sampling=GREEDY,
                  max_new_tokens=16, seed=1, row=i) for i in range(4)]
    hook_decode(monkeypatch, engines[1], {2: lambda: (_ for _ in ()).throw(RuntimeError("device lost"))})
    with router:
        router.suspend()
        futures, given = streaming(router, calls)
        router.resume()
        outs = {k: f.result() for k, f in futures.items()}
        assert router.live_replicas == [0] and placed["f1"] == [1, 0]
    assert_same_tokens(outs, reference(tiny_engine, calls))
    assert_streamed_prefix(given, outs)
    before = [ids for done, ids in given["f1"]]
    assert len(before) >= 2 and len(before[0]) >= 4  # replica 1's loop, then the retry's new ones


def test_a_retry_that_samples_other_tokens_than_streamed_fails_clearly(
        engines, tiny_model, other_weights, prompts, stop_id, monkeypatch):
    """A streamed request whose retry cannot continue the stream (replica 0 has other weights: a
    sync in between) fails with one clear error instead of an output that contradicts it, as soon
    as the retry's first tokens show it (aborted there, not run to its budget)."""
    rng = np.random.default_rng(1)  # more candidates: few prompts run 16 tokens under both weights
    candidates = prompts + [[int(t) for t in rng.integers(8, 96, size=6)] for _ in range(24)]
    prompt, _ = long_greedy(tiny_model, candidates, stop_id, n=16, other=other_weights)
    engines[0].update_params(other_weights)  # the fixture gives the engines tiny_model back
    router, replicas, placed = make_router(engines)
    hook_decode(monkeypatch, engines[1], {2: lambda: (_ for _ in ()).throw(RuntimeError("device lost"))})
    with router:
        router.suspend()
        pad = router.submit("pad", prompts[2], sampling=GREEDY, max_new_tokens=2)
        futures, given = streaming(router, [dict(request_id="x", prompt_ids=prompt, sampling=GREEDY,
                                                 max_new_tokens=16)])
        router.resume()
        with pytest.raises(RuntimeError, match="'x'.*sampled other tokens"):
            futures["x"].result()
        assert pad.result().finish_reason in ("stop", "length")
        assert replicas[0].stats["generated_tokens"] <= 2 + 8  # pad's, the retry's first 2 loops
    assert placed["x"] == [1, 0] and given["x"]


class _Dropped(logging.Handler):
    """Sets `event` when the router logs a replica's death (its requests are re-queued by then)."""

    def __init__(self, event):
        super().__init__(logging.WARNING)
        self.event = event

    def emit(self, record):
        if "failed" in record.getMessage():
            self.event.set()


@pytest.mark.parametrize("where", ["replica", "queue"])
def test_an_abort_landing_before_a_retry_caught_up_keeps_the_streamed_tokens(
        engines, tiny_model, prompts, stop_id, monkeypatch, where):
    """Replica 1 dies after streaming; the retry is aborted before it sampled anything, either
    waiting on (suspended) replica 0 or in the router's queue (replica 0 at its bound of 1): the
    router runs it again up to the streamed tokens, so the abort's output still starts with (here:
    is) every token the caller was given."""
    prompt, ref = long_greedy(tiny_model, prompts, stop_id)
    router, replicas, placed = make_router(engines, max_inflight_per_replica=1 if where == "queue" else None)
    moved, real = threading.Event(), replicas[0].submit

    def submit(request_id, prompt_ids, **kwargs):
        future = real(request_id, prompt_ids, **kwargs)
        if request_id == "x":
            moved.set()
        return future

    monkeypatch.setattr(replicas[0], "submit", submit)
    handler = _Dropped(threading.Event() if where == "replica" else moved)
    logging.getLogger("rollout._router").addHandler(handler)
    hook_decode(monkeypatch, engines[1], {2: lambda: (_ for _ in ()).throw(RuntimeError("device lost"))})
    try:
        with router:
            replicas[0].server.suspend()
            pad = router.submit("pad", prompts[2], sampling=GREEDY, max_new_tokens=2)
            futures, given = streaming(router, [dict(request_id="x", prompt_ids=prompt, sampling=GREEDY,
                                                     max_new_tokens=12)])
            assert moved.wait(120)  # a guard against a hang, not a timing assertion
            assert router.abort("x")
            replicas[0].server.resume()
            out = futures["x"].result()
            assert pad.result().finish_reason in ("stop", "length")
    finally:
        logging.getLogger("rollout._router").removeHandler(handler)
    got = [t for _, ids in given["x"] for t in ids]
    assert out.finish_reason == "abort" and got and out.token_ids == got == ref[:len(got)]
    assert len(out.log_probs) == len(got)
    assert placed["x"] == ([1, 0, 0] if where == "replica" else [1, 0])


# ---------------------------------------------------------------- the agent code, unchanged
def test_agent_runner_over_a_router_equals_one_server(engines, tiny_engine):
    """AgentRunner's single-turn loop (session, release_session, agenerate) gives the same
    responses and log-probs over a router as over one server: nothing in the agent code changes."""
    from jaxrl_llm import agent
    from jaxrl_llm.config import MultiTurnConfig
    from jaxrl_llm.models import CharTokenizer

    mt = MultiTurnConfig(enable=False, default_agent_loop="single_turn_agent", max_assistant_turns=0,
                         max_user_turns=0, max_parallel_calls=1, max_tool_response_length=256,
                         tool_response_truncate_side="middle", tool_timeout_s=5.0,
                         tool_memory_limit_gb=4.0, tool_workers=1, sandbox="process",
                         tool_config_path="", function_tool_path="", interaction_config_path="",
                         format="hermes", tokenization_sanity_check_mode="strict")
    samples = [agent.AgentSample(raw_prompt=[{"role": "user", "content": f"{i}+1="}],
                                 data_source="arithmetic", ground_truth=str(i + 1), extra_info={},
                                 agent_name="", row=i) for i in range(6)]

    def run(server):
        runner = agent.AgentRunner(server, CharTokenizer(), mt, max_prompt_length=16,
                                   max_response_length=12, pad_token_id=0, tools={}, interactions={})
        return runner.run(samples, sampling=SAMPLED, seed=4)

    router, replicas, placed = make_router(engines)
    with router:
        routed = run(router)
        assert {p[0] for p in placed.values()} == {0, 1} and len(placed) == 6
    with rollout.RolloutServer(tiny_engine, steps_per_sync=4) as one:
        single = run(one)
    assert np.asarray(single["response_mask"]).sum() >= 6  # every trajectory generated tokens
    for key in ("responses", "response_mask", "rollout_log_probs"):
        np.testing.assert_allclose(np.asarray(routed[key]), np.asarray(single[key]), atol=1e-5, err_msg=key)
