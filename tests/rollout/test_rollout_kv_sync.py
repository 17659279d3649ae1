"""RolloutServer at a weight sync and around training: partial_rollout_kv ("recompute" rebuilds
a held request's KV with the new weights, "keep" decodes on the old KV), suspend/resume and
sleep/wake (the KV cache and the engine's own weight copy released, held requests re-prefilled).

The scheduler is stopped at known points by hooking the engine's `decode_loop` (as in
test_rollout_server.py); shapes are the shared tiny engine's, so nothing new compiles but the
one-line `set_generated` program.
"""
import gc
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import rollout
from conftest import greedy_reference, hook_decode, trainer_log_probs

GREEDY = rollout.SamplingParams(0.0)
SAMPLED = rollout.SamplingParams(1.0)


def _no_stop_prompt(model, prompts, stop_id, steps):
    for p in prompts:
        if stop_id not in greedy_reference(model, p, steps):
            return p
    pytest.fail("no test prompt runs long enough without the stop token")


@pytest.fixture
def kv_weights(tiny_model, tiny_engine):
    """tiny_model with other K/V projections: a different KV cache for the same tokens. The
    engine gets its own weights back afterwards."""
    other = nnx.clone(tiny_model)
    attn = other.model.layers.self_attn
    rng = np.random.default_rng(7)
    for proj in (attn.k_proj, attn.v_proj):
        kernel = np.asarray(proj["kernel"][...])
        proj["kernel"][...] = jnp.asarray(kernel * 1.5 + rng.normal(0, 0.05, kernel.shape), kernel.dtype)
    yield other
    tiny_engine.update_params(tiny_model)


def _generate_with_sync_after(srv, engine, monkeypatch, weights, prompt, sampling, loops=2):
    """One request (seed 5, row 0) whose weights change after `loops` decode loops of 4 steps."""
    sync = {}
    hook_decode(monkeypatch, engine, {loops: lambda: sync.setdefault("f", srv.submit_update(weights))})
    out = srv.generate("r", prompt, sampling=sampling, max_new_tokens=16, seed=5, row=0)
    assert sync["f"].result()["held_requests"] == 1
    return out


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_recompute_sync_continues_exactly_as_a_fresh_prefill_under_the_new_weights(
        tiny_model, tiny_engine, kv_weights, prompts, stop_id, monkeypatch, sampling):
    prompt = _no_stop_prompt(tiny_model, prompts, stop_id, 8)
    with rollout.RolloutServer(tiny_engine, steps_per_sync=4, partial_rollout_kv="recompute") as srv:
        out = _generate_with_sync_after(srv, tiny_engine, monkeypatch, kv_weights, prompt, sampling)
        before, after = out.token_ids[:8], out.token_ids[8:]
        assert len(before) == 8 and len(after) >= 1 and out.policy_versions[7:9] == [0, 1]
        assert srv.stats["recomputed_requests"] == 1
        assert srv.stats["recomputed_tokens"] == len(prompt) + 8
        # a fresh request under the new weights, same key stream from step 8 on
        fresh = srv.generate("fresh", prompt + before, sampling=sampling, max_new_tokens=8, seed=5,
                             row=0, step_offset=8)
    assert after == fresh.token_ids[:len(after)]
    np.testing.assert_allclose(out.log_probs[8:], fresh.log_probs[:len(after)], atol=1e-6)
    # and what the trainer computes with the new weights (full forward, no KV cache)
    np.testing.assert_allclose(out.log_probs[8:], trainer_log_probs(kv_weights, prompt + before, after,
                                                                    sampling.temperature), atol=1e-5)
    if sampling is GREEDY:
        assert after == greedy_reference(kv_weights, prompt + before, len(after), (stop_id,))


def test_keep_sync_decodes_on_the_old_weights_kv(tiny_model, tiny_engine, kv_weights, prompts, stop_id,
                                                 monkeypatch):
    prompt = _no_stop_prompt(tiny_model, prompts, stop_id, 8)
    with rollout.RolloutServer(tiny_engine, steps_per_sync=4, partial_rollout_kv="keep") as srv:
        out = _generate_with_sync_after(srv, tiny_engine, monkeypatch, kv_weights, prompt, SAMPLED)
        assert srv.stats.get("recomputed_requests", 0) == 0
    before, after = out.token_ids[:8], out.token_ids[8:]
    assert len(before) == 8 and out.policy_versions[8:] == [1] * len(after)
    # sampled by the new weights, but conditioned on K/V the old weights computed: not the new
    # policy's log-probs for these tokens
    new_policy = trainer_log_probs(kv_weights, prompt + before, after, 1.0)
    assert np.max(np.abs(np.asarray(out.log_probs[8:]) - new_policy)) > 1e-3


@pytest.mark.parametrize("mode", ["recompute", "keep"])
def test_a_sync_drops_parked_session_kv_under_recompute_only(tiny_model, tiny_engine, kv_weights, prompts,
                                                             stop_id, mode):
    with rollout.RolloutServer(tiny_engine, partial_rollout_kv=mode) as srv:
        first = srv.generate("t1", prompts[3], sampling=GREEDY, max_new_tokens=3, session_id="s")
        srv.update_params(kv_weights)
        second = srv.generate("t2", prompts[3] + first.token_ids + [5], sampling=GREEDY,
                              max_new_tokens=3, session_id="s")
        dropped = srv.stats.get("parked_dropped", 0)
    if mode == "recompute":  # the next turn prefills in full, all of it with the new weights
        assert (second.num_cached_tokens, dropped) == (0, 1)
        assert second.token_ids == greedy_reference(kv_weights, prompts[3] + first.token_ids + [5], 3,
                                                    (stop_id,))
    else:
        assert (second.num_cached_tokens, dropped) == (len(prompts[3]) + len(first.token_ids) - 1, 0)


def test_suspend_stops_admission_and_decoding_and_a_sync_applies_at_once(
        tiny_model, tiny_engine, kv_weights, prompts, stop_id, monkeypatch):
    prompt = _no_stop_prompt(tiny_model, prompts, stop_id, 8)
    with rollout.RolloutServer(tiny_engine, steps_per_sync=4) as srv:
        first = srv.submit("a", prompt, sampling=GREEDY, max_new_tokens=16)
        _suspend_before_loop(srv, tiny_engine, monkeypatch, 2)  # holds after the second loop
        assert srv.suspended and not first.done()
        stats = srv.stats
        second = srv.submit("b", prompts[1], sampling=GREEDY, max_new_tokens=4)
        sync = srv.update_params(kv_weights, in_flight="finish")  # applied at once, as "hold"
        assert sync["held_requests"] == 1 and srv.policy_version == 1
        after_sync = srv.stats
        assert (after_sync["decode_loops"], after_sync["prefill_calls"]) == (2, stats["prefill_calls"])
        assert not first.done() and not second.done()
        srv.resume()
        out, out2 = first.result(), second.result()
    before = out.token_ids[:8]
    assert before == greedy_reference(tiny_model, prompt, 8)
    assert out.token_ids[8:] == greedy_reference(kv_weights, prompt + before, len(out.token_ids) - 8,
                                                 (stop_id,))
    assert out2.token_ids == greedy_reference(kv_weights, prompts[1], 4, (stop_id,))


def _suspend_before_loop(srv, engine, monkeypatch, i):
    """Queues a suspend from the scheduler thread just before its i-th decode loop (so it holds
    right after that loop) and waits until it holds."""
    queued, held = threading.Event(), {}

    def hook():
        held["f"] = srv.submit_suspend()
        queued.set()

    hook_decode(monkeypatch, engine, {i: hook})
    queued.wait()
    held["f"].result()


def _live_bytes() -> int:
    gc.collect()  # arrays of earlier tests' cyclic garbage would otherwise go at a random moment
    return sum(x.nbytes for x in jax.live_arrays() if not x.is_deleted())


def test_sleep_releases_the_kv_cache_and_weight_copy_and_wake_finishes_held_requests_exactly(
        tiny_model, tiny_engine, prompts, stop_id, monkeypatch):
    prompt = _no_stop_prompt(tiny_model, prompts, stop_id, 8)
    assert tiny_engine.layer_layout == "per_layer"  # the engine holds its own (relaid-out) weights
    with rollout.RolloutServer(tiny_engine, steps_per_sync=4) as srv:
        req = srv.submit("a", prompt, sampling=GREEDY, max_new_tokens=16)
        _suspend_before_loop(srv, tiny_engine, monkeypatch, 2)
        cache = jax.tree.leaves(srv._state.cache)
        weights = jax.tree.leaves(tiny_engine.params)
        live = _live_bytes()
        slept = srv.sleep()
        freed = live - _live_bytes()
        assert slept["kv_bytes"] == tiny_engine.kv_cache_bytes() and slept["weights_released"]
        assert all(x.is_deleted() for x in cache)
        del cache
        weight_bytes = sum(x.nbytes for x in weights)
        del weights  # our own references kept them alive
        assert slept["weight_bytes"] == weight_bytes
        asleep = _live_bytes()
        assert live - asleep >= slept["kv_bytes"] + weight_bytes
        assert srv.asleep and tiny_engine.params is None
        with pytest.raises(RuntimeError, match="call wake"):
            srv.resume()
        with pytest.raises(RuntimeError, match="update_params"):
            srv.wake()
        srv.update_params(tiny_model)  # weights given again while asleep
        woke = srv.wake()
        assert woke == {"recomputed_requests": 1, "recomputed_tokens": len(prompt) + 8}
        # the cache and weights are back: the engine's arrays, and the live bytes they take
        assert sum(x.nbytes for x in jax.tree.leaves(srv._state.cache)) == slept["kv_bytes"]
        assert sum(x.nbytes for x in jax.tree.leaves(tiny_engine.params)) == weight_bytes
        assert _live_bytes() - asleep >= slept["kv_bytes"] + weight_bytes
        out = req.result()
    assert not srv.asleep
    assert out.token_ids == greedy_reference(tiny_model, prompt, 16, (stop_id,))  # as if uninterrupted
    np.testing.assert_allclose(out.log_probs, trainer_log_probs(tiny_model, prompt, out.token_ids, 0.0),
                               atol=1e-5)


def test_partial_rollout_kv_and_step_offset_are_validated(tiny_engine, prompts):
    with pytest.raises(ValueError, match="partial_rollout_kv"):
        rollout.RolloutServer(tiny_engine, partial_rollout_kv="rebuild")
    with rollout.RolloutServer(tiny_engine) as srv:
        with pytest.raises(ValueError, match="step_offset"):
            srv.submit("r", prompts[0], sampling=GREEDY, max_new_tokens=2, step_offset=-1)


def test_close_while_asleep_aborts_held_requests(tiny_model, tiny_engine, prompts, stop_id, monkeypatch):
    prompt = _no_stop_prompt(tiny_model, prompts, stop_id, 8)
    srv = rollout.RolloutServer(tiny_engine, steps_per_sync=4)
    try:
        req = srv.submit("a", prompt, sampling=GREEDY, max_new_tokens=16)
        _suspend_before_loop(srv, tiny_engine, monkeypatch, 1)
        srv.sleep()
    finally:
        srv.close()
        tiny_engine.update_params(tiny_model)  # sleep released the engine's weights
    out = req.result()
    assert out.finish_reason == "abort" and out.token_ids == greedy_reference(tiny_model, prompt, 4)


def test_config_field_defaults_to_recompute_and_names_itself_when_wrong():
    import os

    from jaxrl_llm.config import ConfigError, load_config

    quickstart = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "quickstart.py")
    assert load_config(quickstart).rollout.partial_rollout_kv == "recompute"
    assert load_config(quickstart, ["rollout.partial_rollout_kv=keep"]).rollout.partial_rollout_kv == "keep"
    with pytest.raises(ConfigError, match=r"rollout\.partial_rollout_kv='rebuild'"):
        load_config(quickstart, ["rollout.partial_rollout_kv=rebuild"])


def test_sleep_keeps_shared_zero_copy_weights_and_wakes_without_a_new_sync(
        tiny_model, tiny_stacked_engine, prompts, stop_id, monkeypatch):
    """A stacked engine sharing the model's buffers: sleep frees only the KV cache (the weights are
    the trainer's), so wake needs no update_params."""
    prompt = _no_stop_prompt(tiny_model, prompts, stop_id, 8)
    assert tiny_stacked_engine.update_params(tiny_model)["zero_copy"]
    with rollout.RolloutServer(tiny_stacked_engine, steps_per_sync=4) as srv:
        req = srv.submit("a", prompt, sampling=GREEDY, max_new_tokens=12)
        _suspend_before_loop(srv, tiny_stacked_engine, monkeypatch, 1)
        slept = srv.sleep()
        assert (slept["weights_released"], slept["weight_bytes"]) == (False, 0)
        assert slept["kv_bytes"] == tiny_stacked_engine.kv_cache_bytes()
        assert srv.wake()["recomputed_requests"] == 1
        out = req.result()
    assert out.token_ids == greedy_reference(tiny_model, prompt, 12, (stop_id,))


def test_a_session_request_aborted_with_stale_kv_is_not_parked(tiny_model, tiny_engine, kv_weights, prompts,
                                                               stop_id, monkeypatch):
    """Suspended, synced (recompute: the held request's KV is stale), then aborted: its slot must
    not be parked with the old weights' KV, so the session's next turn prefills in full."""
    prompt = _no_stop_prompt(tiny_model, prompts, stop_id, 8)
    with rollout.RolloutServer(tiny_engine, steps_per_sync=4) as srv:
        first = srv.submit("t1", prompt, sampling=GREEDY, max_new_tokens=16, session_id="s")
        _suspend_before_loop(srv, tiny_engine, monkeypatch, 1)
        srv.update_params(kv_weights)
        srv.abort("t1")
        cut = first.result()
        assert cut.finish_reason == "abort" and len(cut.token_ids) == 4
        srv.resume()
        nxt = prompt + cut.token_ids + [5]
        second = srv.generate("t2", nxt, sampling=GREEDY, max_new_tokens=3, session_id="s")
    assert second.num_cached_tokens == 0
    assert second.token_ids == greedy_reference(kv_weights, nxt, 3, (stop_id,))


# ---------------------------------------------------------------- whole-prefix re-prefill
# Kept prefixes (prompt + 8 tokens decoded before the sync) far past max_prefill_length=16, of
# mixed lengths: 110, 100, 98, 50, 40, 20. With 256 tokens a call: 2 rows of bucket 128
# (110, 100), 2 of 128 (98, 50), 2 of 48 (40, 20): 3 prefill calls and no appends (the
# admission path took 1 prefill + 7 appends). With 32 tokens a call, no row longer than 32: the
# first 32 tokens of the five longest and the 20 whole (6 one-row prefill calls), the rest
# appended in 16-token chunks (6 rounds for the 110).
_LONG_PROMPTS = (102, 92, 90, 42, 32, 12)
_LONG_CALLS = {256: {"prefill_calls": 3, "append_calls": 0}, 32: {"prefill_calls": 6, "append_calls": 6}}


@pytest.fixture(scope="module")
def long_engine(tiny_model):
    """tiny_model with a 128-token KV cache and max_prefill_length=16 (the async trainer's engine:
    prompt-sized prefill buckets, long responses); no stop tokens, so requests run to budget."""
    return rollout.Engine.from_model(tiny_model, max_concurrent_decodes=8, max_prefill_length=16,
                                     max_target_length=128, temperature=1.0, layer_layout="per_layer")


def _full_forward_log_probs(model, prompt, response, pad_to=128):
    """log_softmax of the logits of one full causal forward (no KV cache), response tokens only."""
    graphdef, state = nnx.split(model)
    ids = np.zeros((1, pad_to), np.int32)
    ids[0, :len(prompt) + len(response)] = list(prompt) + list(response)
    logits = jax.jit(lambda st, x: nnx.merge(graphdef, st)(x))(state, jnp.asarray(ids))[0]
    lp = jax.nn.log_softmax(logits[len(prompt) - 1:len(prompt) + len(response) - 1], axis=-1)
    return np.asarray(jnp.take_along_axis(lp, jnp.asarray(response)[:, None], axis=-1)[:, 0])


def _hold_long_requests(srv, engine, monkeypatch, at_loop_2):
    """Admits the _LONG_PROMPTS requests in one round (the server suspended while they queue),
    runs at_loop_2() on the scheduler thread before decode loop 2 and waits for it; returns
    (prompts, futures, {"stats": the server's stats after admission})."""
    rng = np.random.default_rng(11)
    prompts = [[int(t) for t in rng.integers(1, 96, n)] for n in _LONG_PROMPTS]
    snap, queued = {}, threading.Event()

    def hook():
        snap["stats"] = srv.stats
        at_loop_2()
        queued.set()

    hook_decode(monkeypatch, engine, {2: hook})
    srv.suspend()
    futures = [srv.submit(f"r{i}", p, sampling=SAMPLED, max_new_tokens=12, seed=5, row=i)
               for i, p in enumerate(prompts)]
    srv.resume()
    queued.wait()
    return prompts, futures, snap


@pytest.mark.parametrize("via,budget", [("sync", 256), ("sleep_wake", 256), ("sync", 32)])
def test_long_held_prefixes_are_refilled_whole_in_few_calls_and_continue_as_fresh_prefills(
        tiny_model, long_engine, kv_weights, monkeypatch, via, budget):
    """Held requests of mixed lengths past max_prefill_length, rebuilt after a recompute sync (or
    a sleep, new weights and a wake): each prefix prefilled whole in prefill calls of at most
    `budget` padded tokens (a longer one up to the budget, the rest appended), and every request
    continues exactly as a fresh request of its prefix under the new weights would."""
    try:
        with rollout.RolloutServer(long_engine, steps_per_sync=4, partial_rollout_kv="recompute",
                                   recompute_tokens=budget) as srv:
            held = {}
            if via == "sync":
                at_loop_2 = lambda: held.setdefault("f", srv.submit_update(kv_weights))  # noqa: E731
            else:
                at_loop_2 = lambda: held.setdefault("f", srv.submit_suspend())  # noqa: E731
            prompts, futures, snap = _hold_long_requests(srv, long_engine, monkeypatch, at_loop_2)
            if via == "sync":
                assert held["f"].result()["held_requests"] == len(prompts)
            else:
                held["f"].result()
                srv.sleep()
                srv.update_params(kv_weights)
                woke = srv.wake()
                assert woke == {"recomputed_requests": len(prompts),
                                "recomputed_tokens": sum(len(p) + 8 for p in prompts)}
            outs = [f.result() for f in futures]
            stats = srv.stats
            calls = {k: stats.get(k, 0) - snap["stats"].get(k, 0) for k in ("prefill_calls", "append_calls")}
            assert calls == _LONG_CALLS[budget]
            assert stats["recomputed_requests"] == len(prompts)
            assert stats["recomputed_tokens"] == sum(len(p) + 8 for p in prompts)
            fresh = [srv.generate(f"f{i}", p + o.token_ids[:8], sampling=SAMPLED, max_new_tokens=4,
                                  seed=5, row=i, step_offset=8)
                     for i, (p, o) in enumerate(zip(prompts, outs))]
    finally:
        long_engine.update_params(tiny_model)
    for p, out, new in zip(prompts, outs, fresh):
        before, after = out.token_ids[:8], out.token_ids[8:]
        assert len(after) == 4
        if via == "sync":
            assert out.policy_versions == [0] * 8 + [1] * 4
        assert after == new.token_ids
        np.testing.assert_allclose(out.log_probs[8:], new.log_probs, atol=1e-5)
        np.testing.assert_allclose(out.log_probs[8:], _full_forward_log_probs(kv_weights, p + before, after),
                                   atol=1e-5)


def test_refill_plan_takes_the_longest_prefixes_first_in_rows_of_recompute_tokens():
    """`refill_plan`: a call's bucket is its longest prefix's (a refill bucket, or the KV cache
    length past the last bucket under it), tokens // bucket rows or the power of two covering
    what is left, the longest prefixes first; at least one row, whatever the budget."""
    from rollout._server import REFILL_BUCKETS, refill_bucket, refill_plan

    assert REFILL_BUCKETS[:8] == (16, 24, 32, 48, 64, 96, 128, 192)
    assert [refill_bucket(n, 4112) for n in (1, 17, 25, 97, 3000, 3073, 4096, 4097, 4111)] == \
        [16, 24, 32, 128, 3072, 4096, 4096, 4112, 4112]
    lengths = [20, 110, 40, 100, 98, 50]
    assert refill_plan(lengths, 128, 4096) == [(128, [1, 3, 4, 5, 2, 0], 8)]
    assert refill_plan(lengths, 128, 256) == [(128, [1, 3], 2), (128, [4, 5], 2), (48, [2, 0], 2)]
    assert refill_plan([127, 3], 128, 1) == [(128, [0], 1), (16, [1], 1)]
    # 128 held requests of a long-tailed length (bench_recompute's), 16,384 tokens a call
    rng = np.random.default_rng(0)
    tail = [int(min(3000, max(5, round(x)))) for x in rng.lognormal(np.log(600), 0.6, 128)]
    plan = refill_plan(tail, 4112, 16384)
    assert sorted(i for _, rows, _ in plan for i in rows) == list(range(128))
    assert all(size * bucket <= 16384 and len(rows) <= size for bucket, rows, size in plan)
    assert all(lengths_ <= bucket for bucket, rows, _ in plan for lengths_ in (tail[i] for i in rows))
    assert len(plan) == 8 and sum(size * bucket for bucket, _, size in plan) == 118528


def test_recompute_tokens_is_validated(tiny_engine):
    for bad in (0, -5, 1.5, True):
        with pytest.raises(ValueError, match="recompute_tokens"):
            rollout.RolloutServer(tiny_engine, recompute_tokens=bad)
