"""A rollout replica in its own process, killed with SIGKILL under load: a router over one
`ProcessReplica` (its child builds tiny_engine's model and engine) and one in-process replica.
The weight sync reaches the child; the kill (at a point the child reports: after a decode loop,
with its requests in flight) hands those requests to the other replica with the tokens a run
without the kill gives; the router restarts the replica at its current weights and sends it
requests again. Plus the restart paths with in-process replicas: weights from `restart_params`
or from the sync the replica missed, max_restarts, a restart that fails (dropped with a
warning), a failed restart tried again while max_restarts allows, requests waiting while the
only replica restarts, a late failure of a replaced replica, a child whose factory fails, and
one that never reports ready (an error naming start_timeout_s).

One child costs about 3 s (a fresh interpreter importing JAX, then its programs from the
compilation cache; measured on 2 shared cores), so one test kills one child and restarts one,
with an in-process replica beside it, rather than running two children.
"""
import functools
import logging
import os
import signal
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import _replica_child
import rollout
import sharding
from conftest import TINY, greedy_reference

GREEDY = rollout.SamplingParams(0.0)
SAMPLED = rollout.SamplingParams(1.0, 20, 0.95)
TOOL = [11, 12, 13]


def local_engine(model, stop_id):
    return rollout.Engine.from_model(
        model, mesh=sharding.make_mesh((1, 1, 1), devices=[jax.devices()[0]]),
        max_concurrent_decodes=4, max_prefill_length=16, max_target_length=32, temperature=0.0,
        stop_token_ids=(stop_id,), pad_token_id=0, layer_layout="per_layer")


@pytest.fixture(scope="module")
def other_weights(tiny_model):
    """tiny_model with another final-norm scale (other logits)."""
    other = nnx.clone(tiny_model)
    scale = np.random.default_rng(4).uniform(0.2, 3.0, tiny_model.config.hidden_size)
    other.model.norm.scale[...] = jnp.asarray(scale, jnp.float32)
    return other


class Placed(rollout.ProcessReplica):
    """A ProcessReplica that logs which requests it was sent (`placed`: shared with the test)."""

    def __init__(self, factory, placed):
        super().__init__(factory)
        self.placed = placed

    def submit(self, request_id, prompt_ids, **kwargs):
        future = super().submit(request_id, prompt_ids, **kwargs)
        self.placed.append(request_id)
        return future


def reference(engine, calls):
    with rollout.RolloutServer(engine, steps_per_sync=4) as srv:
        futures = {c["request_id"]: srv.submit(**c) for c in calls}
        return {k: f.result() for k, f in futures.items()}


def test_a_killed_replica_process_hands_its_requests_over_and_restarts_at_the_current_weights(
        tiny_model, other_weights, stop_id, prompts, caplog):
    factory = functools.partial(_replica_child.tiny_server, TINY, stop_id)
    placed, children = [], []

    def start(index=0):
        children.append(Placed(factory, placed))
        return children[-1]

    kw = dict(sampling=GREEDY, max_new_tokens=6)
    ref_engine = local_engine(other_weights, stop_id)
    try:
        proc = start()
        router = rollout.ReplicaRouter(
            [proc, rollout.RolloutServer(local_engine(tiny_model, stop_id), steps_per_sync=4)],
            restart=start)

        def spread(tag):  # one request per replica (least in flight: 0, then 1)
            router.suspend()
            futures = [router.submit(f"{tag}{i}", prompts[i], **kw) for i in range(2)]
            router.resume()
            return [f.result() for f in futures]

        with router, caplog.at_level(logging.WARNING, logger="rollout._router"):
            # a weight sync through the router reaches the child: its tokens change as the local one's
            assert router.update_params(other_weights, version=3)["replicas"] == 2
            assert proc.policy_version == 3
            for i, out in enumerate(spread("v3-")):
                assert out.token_ids == greedy_reference(other_weights, prompts[i], 6, (stop_id,)), i
                assert out.policy_versions == [3] * len(out.token_ids)
            assert placed == ["v3-0"]
            # a request the child refuses raises in the caller, the replica stays up
            router.suspend()
            dup = router.submit("dup", prompts[0], **kw)
            with pytest.raises(ValueError, match="already pending or running"):
                proc.submit("dup", prompts[0], seed=0, row=0, step_offset=0, session_id=None, **kw)
            router.resume()
            assert dup.result().token_ids and placed[-1] == "dup"
            # an on_tokens that raises is dropped; the request and the replica go on
            bad = proc.submit("bad", prompts[0], sampling=SAMPLED, max_new_tokens=12, seed=0, row=0,
                              step_offset=0, session_id=None, on_tokens=lambda ids: 1 / 0)
            assert len(bad.result(timeout=120).token_ids) > 4  # a guard against a hang
            router.generate("chat-0", prompts[1], session_id="chat", seed=2, row=7, **kw)  # turn 1 on 0
            assert placed[-1] == "chat-0" and proc.error is None

            # 8 sampled requests (seed 0: none ends within 4 tokens), 4 on the child, turn 2 of
            # "chat" among them; the child holds after one decode loop (4 tokens each), is killed
            calls = [dict(request_id=f"q{i}", prompt_ids=prompts[i % 6], sampling=SAMPLED,
                          max_new_tokens=12, session_id=f"s{i}" if i % 2 else None, seed=0, row=i)
                     for i in range(7)]
            turn1 = reference(ref_engine, [dict(
                request_id="chat-0", prompt_ids=prompts[1], session_id="chat", seed=2, row=7, **kw)])
            calls.insert(0, dict(request_id="chat-1", prompt_ids=prompts[1] + turn1["chat-0"].token_ids + TOOL,
                                 sampling=SAMPLED, max_new_tokens=8, session_id="chat", seed=0, row=8))
            loops = proc.run_in_child(_replica_child.arm_hold)
            router.suspend()
            given = {c["request_id"]: [] for c in calls}  # streamed: (the giving thread, ids)
            futures = {c["request_id"]: router.submit(**c, on_tokens=lambda ids, k=c["request_id"]: given[k].append(
                (threading.current_thread().name, list(ids)))) for c in calls}
            on_child = [c["request_id"] for c in calls if c["request_id"] in placed]
            assert len(on_child) == 4 and "chat-1" in on_child and router.in_flight() == [4, 4]
            router.resume()
            assert proc.run_in_child(_replica_child.wait_held) == (loops + 1, 4)
            assert router.in_flight()[0] == 4  # held: none of them ended
            os.kill(proc.pid, signal.SIGKILL)
            outs = {k: f.result(timeout=120) for k, f in futures.items()}  # a guard against a hang
            assert router.wait_restarts(timeout=120)

            assert proc.process.exitcode == -signal.SIGKILL and "died" in str(proc.error)
            assert proc.policy_version == 3 and not proc.suspended  # as last read
            with pytest.raises(RuntimeError, match="died"):
                proc.submit("late", prompts[0], seed=0, row=0, step_offset=0, session_id=None, **kw)
            new = children[1]
            assert router.replicas[0] is new and router.live_replicas == [0, 1]
            assert new.policy_version == 3 == router.policy_version
            placed.clear()
            for session in ["chat"] + [c["session_id"] for c in calls if c["session_id"]]:
                router.release_session(session)  # else their parked slots keep new requests off replica 1
            for i, out in enumerate(spread("back-")):  # the new child serves, with the weights of v3
                assert out.token_ids == greedy_reference(other_weights, prompts[i], 6, (stop_id,)), i
            assert placed == ["back-0"]
            metrics, stats = router.metrics(), router.stats
        assert not any(c.process.is_alive() for c in children)
    finally:
        for child in children:
            child.close()
    want = reference(ref_engine, calls)
    for k, out in outs.items():  # what the dead child had generated is regenerated, the same
        assert (out.token_ids, out.finish_reason) == (want[k].token_ids, want[k].finish_reason), k
        np.testing.assert_allclose(out.log_probs, want[k].log_probs, atol=1e-5)
        assert out.policy_versions == [3] * len(out.token_ids)
    assert outs["chat-1"].num_cached_tokens == 0  # its KV died with the child: prefilled in full
    assert all(len(want[k].token_ids) > 4 for k in on_child)  # 4 tokens each died with the child
    # streaming: the child's loop reached the caller over the pipe; the retry on replica 1 gave
    # only the tokens after those, so each token came once and the outputs start with them
    for k, out in outs.items():
        got = [t for _, ids in given[k] for t in ids]
        assert got == out.token_ids[:len(got)], k
    for k in on_child:
        threads = [name for name, _ in given[k]]
        assert threads[0] == "rollout-replica-dispatch" and len(given[k][0][1]) >= 4, (k, given[k])
    assert stats["dead_replicas"] == 1 and stats["restarted_replicas"] == 1
    assert stats["retried_requests"] == 4
    assert metrics["rollout/router/dead_replicas"] == 1.0
    assert metrics["rollout/router/restarted_replicas"] == 1.0
    assert metrics["rollout/router/live_replicas"] == 2.0
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("replica 0 failed" in w and "4 in-flight requests retried" in w and "restarting it" in w
               for w in warnings), warnings
    assert any("replica 0 restarted at policy version 3" in w for w in warnings), warnings


@pytest.fixture(scope="module")
def engines(tiny_model, stop_id):
    return [local_engine(tiny_model, stop_id) for _ in range(2)]  # device 0: tiny_engine's programs


def test_an_in_process_replica_restarts_with_restart_params_and_a_failed_restart_drops_it(
        engines, tiny_model, other_weights, stop_id, prompts, caplog):
    """mark_dead on replica 1; a sync to version 2 runs while it restarts (its factory held by
    the test) and reaches the live replica only; the successor (a new RolloutServer) then gets
    restart_params(1) at version 2 and serves; the second death exceeds max_restarts=1 and drops
    it; a restart that raises drops the replica with a warning, the run going on."""
    asked, gate = [], threading.Event()

    def restart(i):
        gate.wait()
        return rollout.RolloutServer(engines[i], steps_per_sync=4)

    servers = [rollout.RolloutServer(e, steps_per_sync=4) for e in engines]
    router = rollout.ReplicaRouter(servers, restart=restart,
                                   restart_params=lambda i: asked.append(i) or other_weights)
    kw = dict(sampling=GREEDY, max_new_tokens=6)
    with router, caplog.at_level(logging.WARNING, logger="rollout._router"):
        router.mark_dead(1, "test")
        assert router.update_params(other_weights, version=2)["replicas"] == 1
        assert asked == [] and router.policy_version == 2
        gate.set()
        assert router.wait_restarts(timeout=120)
        assert asked == [1] and router.live_replicas == [0, 1]
        assert router.replicas[1].server is not servers[1] and router.replicas[1].policy_version == 2
        router.suspend()
        futures = [router.submit(f"r{i}", prompts[i], **kw) for i in range(2)]
        router.resume()
        for i, f in enumerate(futures):
            assert f.result().token_ids == greedy_reference(other_weights, prompts[i], 6, (stop_id,)), i
        router.mark_dead(1, "again")  # max_restarts=1: dropped
        assert router.wait_restarts(timeout=120) and router.live_replicas == [0]
        stats = router.stats
    assert (stats["dead_replicas"], stats["restarted_replicas"]) == (2, 1)
    assert any("dropped for good (max_restarts reached)" in r.getMessage() for r in caplog.records)

    def broken(i):
        raise RuntimeError("no device for it")

    caplog.clear()
    with rollout.ReplicaRouter([rollout.RolloutServer(e, steps_per_sync=4) for e in engines],
                               restart=broken) as router, \
            caplog.at_level(logging.WARNING, logger="rollout._router"):
        router.mark_dead(0, "test")
        assert router.wait_restarts(timeout=120) and router.live_replicas == [1]
        assert router.generate("after", prompts[0], **kw).token_ids  # the run goes on
        assert router.stats["failed_restarts"] == 1
    assert any("restart failed" in r.getMessage() and "no device for it" in r.getMessage()
               for r in caplog.records)
    for e in engines:
        e.update_params(tiny_model)


def test_a_failed_restart_is_tried_again_while_max_restarts_allows(engines, prompts, caplog):
    """max_restarts=2: replica 0's first restart raises, the second builds it, and it serves
    again (a warning for the retry; failed_restarts 1, restarted_replicas 1). A factory that
    always raises gets its 2 attempts, then the replica is dropped for good and the run goes on."""
    calls = []

    def flaky(i):
        calls.append(i)
        if len(calls) == 1:
            raise RuntimeError("device still busy")
        return rollout.RolloutServer(engines[i], steps_per_sync=4)

    kw = dict(sampling=GREEDY, max_new_tokens=4)
    with rollout.ReplicaRouter([rollout.RolloutServer(e, steps_per_sync=4) for e in engines],
                               restart=flaky, max_restarts=2) as router, \
            caplog.at_level(logging.WARNING, logger="rollout._router"):
        router.mark_dead(0, "test")
        assert router.wait_restarts(timeout=120) and router.live_replicas == [0, 1]
        assert calls == [0, 0]
        assert router.generate("back", prompts[0], **kw).token_ids and router.in_flight() == [0, 0]
        stats = router.stats
    assert (stats["failed_restarts"], stats["restarted_replicas"], stats["dead_replicas"]) == (1, 1, 1)
    warnings = [r.getMessage() for r in caplog.records]
    assert any("restart failed" in w and "device still busy" in w and "trying again in 1 s (restart 2 of 2)" in w
               for w in warnings), warnings

    def broken(i):
        calls.append(i)
        raise RuntimeError("no device for it")

    calls.clear()
    caplog.clear()
    with rollout.ReplicaRouter([rollout.RolloutServer(e, steps_per_sync=4) for e in engines],
                               restart=broken, max_restarts=2) as router, \
            caplog.at_level(logging.WARNING, logger="rollout._router"):
        router.mark_dead(0, "test")
        assert router.wait_restarts(timeout=120) and router.live_replicas == [1]
        assert calls == [0, 0] and router.stats["failed_restarts"] == 2
        assert router.generate("after", prompts[0], **kw).token_ids
    assert any("dropped for good (max_restarts=2 attempts used)" in r.getMessage() for r in caplog.records)


def test_restart_delay_doubles_per_failure_up_to_a_minute():
    from rollout._router_restart import restart_delay
    assert [restart_delay(1.0, n) for n in (1, 2, 3, 7, 20)] == [1.0, 2.0, 4.0, 60.0, 60.0]
    assert restart_delay(0.0, 5) == 0.0 and restart_delay(100.0, 3) == 100.0  # a larger base is kept


def test_failed_restarts_wait_longer_each_time_and_close_cuts_the_wait(engines):
    """A factory that keeps failing is retried after restart_backoff_s, then twice that (not at
    once, as before: a spinning retry loop); close() during a long wait returns at once and no
    attempt follows it."""
    times = []

    def broken(i):
        times.append(time.monotonic())
        raise RuntimeError("device still busy")

    servers = lambda: [rollout.RolloutServer(e, steps_per_sync=4) for e in engines]  # noqa: E731
    with rollout.ReplicaRouter(servers(), restart=broken, max_restarts=3, restart_backoff_s=0.2) as router:
        router.mark_dead(0, "test")
        assert router.wait_restarts(timeout=120) and router.live_replicas == [1]
    assert len(times) == 3, times
    assert times[1] - times[0] >= 0.2 and times[2] - times[1] >= 0.4, np.diff(times)

    times.clear()
    router = rollout.ReplicaRouter(servers(), restart=broken, max_restarts=2, restart_backoff_s=600)
    router.mark_dead(0, "test")
    assert not router.wait_restarts(timeout=0.5) and len(times) == 1  # waiting out its 600 s
    closer = threading.Thread(target=router.close)
    closer.start()
    closer.join(timeout=60)
    assert not closer.is_alive() and len(times) == 1
    for bad in (-1, float("nan"), True):
        with pytest.raises(ValueError, match="restart_backoff_s must be a number of seconds >= 0"):
            rollout.ReplicaRouter(servers(), restart_backoff_s=bad)


def test_requests_wait_while_the_only_replica_restarts(engines, tiny_model, stop_id, prompts):
    """One replica, restarting (its factory held by the test): requests queued before and
    submitted during the restart wait in the router, then run on the new replica with the tokens
    the old one would have given; none fails with "no live replica"."""
    gate = threading.Event()

    def slow(i):
        gate.wait()
        return rollout.RolloutServer(engines[0], steps_per_sync=4)

    kw = dict(sampling=GREEDY, max_new_tokens=6)
    with rollout.ReplicaRouter([rollout.RolloutServer(engines[0], steps_per_sync=4)], restart=slow) as router:
        router.suspend()
        first = router.submit("a", prompts[0], **kw)
        router.mark_dead(0, "test")
        second = router.submit("b", prompts[1], **kw)  # validated by the dead replica, queued
        assert router.live_replicas == [] and not first.done() and not second.done()
        assert router.metrics()["rollout/router/restarting_replicas"] == 1.0
        gate.set()
        assert router.wait_restarts(timeout=120) and router.live_replicas == [0]
        for i, f in enumerate((first, second)):
            assert f.result(timeout=120).token_ids == greedy_reference(tiny_model, prompts[i], 6, (stop_id,))


class Stalling(rollout.LocalReplica):
    """A LocalReplica whose submit of request "slow" waits for `release`, then raises (a replica
    that answers late that it has failed)."""

    def __init__(self, server):
        super().__init__(server)
        self.entered, self.release = threading.Event(), threading.Event()

    def submit(self, request_id, prompt_ids, **kwargs):
        if request_id == "slow":
            self.entered.set()
            self.release.wait()
            raise RuntimeError("late failure of the old replica")
        return super().submit(request_id, prompt_ids, **kwargs)


def test_a_late_failure_of_a_replaced_replica_leaves_its_successor_alone(engines, prompts):
    old = Stalling(rollout.RolloutServer(engines[0], steps_per_sync=4))
    router = rollout.ReplicaRouter([old, rollout.RolloutServer(engines[1], steps_per_sync=4)],
                                   restart=lambda i: rollout.RolloutServer(engines[0], steps_per_sync=4))
    kw = dict(sampling=GREEDY, max_new_tokens=4)
    with router:
        caller = threading.Thread(target=lambda: router.submit("slow", prompts[0], **kw))
        caller.start()  # dispatching "slow" to replica 0 blocks in its submit
        assert old.entered.wait(timeout=120)
        router.mark_dead(0, "test")
        assert router.wait_restarts(timeout=120) and router.replicas[0] is not old
        old.release.set()
        caller.join()
        assert router.live_replicas == [0, 1] and router.stats["dead_replicas"] == 1
        assert router.generate("after", prompts[1], **kw).token_ids


def test_a_factory_that_does_not_build_a_server_fails_the_start_with_its_reason():
    with pytest.raises(RuntimeError, match=r"failed to start:(.|\n)*returned int, not a RolloutServer"):
        rollout.ProcessReplica(_replica_child.not_a_server)


def test_a_child_that_never_reports_ready_fails_the_start_naming_the_timeout():
    """The factory never returns: after start_timeout_s the child is killed and reaped and the
    start fails with one error naming the limit (before, the constructor waited for good)."""
    with pytest.raises(RuntimeError, match=r"did not report ready within start_timeout_s=0.5 s and was "
                                           r"killed \(exit code -9\).*raise ProcessReplica's start_timeout_s"):
        rollout.ProcessReplica(_replica_child.never_ready, start_timeout_s=0.5)
    with pytest.raises(ValueError, match="start_timeout_s must be"):
        rollout.ProcessReplica(_replica_child.never_ready, start_timeout_s=0)


def test_a_replica_restarted_without_restart_params_gets_the_tree_of_the_sync_it_missed(
        engines, tiny_model, other_weights, stop_id, prompts, caplog):
    """restart_params=None: a shared tree synced while replica 1 restarts is the one it gets (at
    that version; a sync that raised in the caller's replica_params does not hold it up); a
    per-replica callable is asked for live replicas only, so a replica that
    missed such a sync has no weights: dropped with a warning naming restart_params."""
    gate = threading.Event()

    def restart(i):
        gate.wait()
        return rollout.RolloutServer(engines[i], steps_per_sync=4)

    kw = dict(sampling=GREEDY, max_new_tokens=6)
    router = rollout.ReplicaRouter([rollout.RolloutServer(e, steps_per_sync=4) for e in engines],
                                   restart=restart)
    with router, caplog.at_level(logging.WARNING, logger="rollout._router"):
        with pytest.raises(ZeroDivisionError):  # the caller's callable: no sync left running
            router.update_params(replica_params=lambda i: 1 / 0)
        router.mark_dead(1, "test")
        router.update_params(other_weights, version=4)
        gate.set()
        assert router.wait_restarts(timeout=120) and router.live_replicas == [0, 1]
        assert router.replicas[1].policy_version == 4
        router.suspend()
        futures = [router.submit(f"r{i}", prompts[i], **kw) for i in range(2)]
        router.resume()
        for i, f in enumerate(futures):
            assert f.result().token_ids == greedy_reference(other_weights, prompts[i], 6, (stop_id,)), i
        gate.clear()
        router.mark_dead(0, "test")
        router.update_params(replica_params=lambda i: other_weights, version=5)
        gate.set()
        assert router.wait_restarts(timeout=120) and router.live_replicas == [1]
    assert any("restart failed" in r.getMessage() and "pass restart_params" in r.getMessage()
               for r in caplog.records)
    for e in engines:
        e.update_params(tiny_model)
