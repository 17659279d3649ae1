"""RolloutServer and the engine's prefix reuse: parity with full prefill, the driver and greedy
full forwards; sessions; concurrency from asyncio and threads; abort; weight sync; errors.

Shapes are kept few (the session engine's 4 slots, one prefill bucket) so the compiles are shared.
Where a test needs the scheduler at a known point it hooks the engine's `decode_loop` (a call on
the scheduler thread just before the i-th loop), never sleeps.
"""
import asyncio
import threading

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import rollout
from conftest import greedy_reference, hook_decode, trainer_log_probs

GREEDY = rollout.SamplingParams(0.0)


def _padded(tokens, size=16):
    out = np.zeros(size, np.int32)
    out[:len(tokens)] = tokens
    return out


def _no_stop_prompt(model, prompts, stop_id, steps):
    """A prompt whose greedy continuation has no stop token in its first `steps` tokens."""
    for p in prompts:
        if stop_id not in greedy_reference(model, p, steps):
            return p
    pytest.fail("no test prompt runs long enough without the stop token")


# ---------------------------------------------------------------- engine prefix reuse
def test_prefill_with_existing_prefix_then_decode_equals_full_prefill(tiny_model, tiny_engine,
                                                                      prompts, stop_id):
    e = tiny_engine
    seq = prompts[3] + prompts[5]  # 21 tokens: the whole sequence exceeds max_prefill_length
    first = e.prefill(params=e.params, padded_tokens=_padded(seq[:7]), true_length=7)
    rest = seq[6:]  # from index first.lengths on: starts with the pending token
    prefix = e.prefill(params=e.params, existing_prefix=first, padded_tokens=_padded(rest),
                       true_length=len(rest))
    assert int(prefix.lengths[0]) == len(seq) - 1 and int(prefix.tokens[0]) == seq[-1]
    state = e.insert(prefix, e.init_decode_state(), 2)
    got = []
    for _ in range(8):
        state, result = e.generate(e.params, state)
        s = result.convert_to_numpy().get_result_at_slot(2)
        if s.valid[0, 0]:
            got.append(int(s.tokens[0, 0]))
    assert len(got) >= 1
    assert got == greedy_reference(tiny_model, seq, len(got), (stop_id,))
    with pytest.raises(ValueError, match="pending token"):
        e.prefill(params=e.params, existing_prefix=first, padded_tokens=_padded(seq[7:]),
                  true_length=5)


# ---------------------------------------------------------------- server
def test_session_turns_reuse_parked_kv_and_match_a_server_without_reuse(tiny_model, tiny_engine,
                                                                        prompts, stop_id):
    """Turn 2 computes only the tokens its parked slot lacks and generates what a full prefill
    does; a prompt that rewrites history, or a released session, is prefilled in full."""
    kw = dict(sampling=GREEDY, max_new_tokens=5, session_id="chat")
    turns = []
    with rollout.RolloutServer(tiny_engine, steps_per_sync=4) as srv:
        one = srv.generate("t1", prompts[1], **kw)
        turn2 = prompts[1] + one.token_ids + [11, 12, 13]  # + a tool's reply
        two = srv.generate("t2", turn2, **kw)
        turns += [one, two]
        known = len(prompts[1]) + len(one.token_ids)
        assert (two.num_cached_tokens, two.num_computed_prompt_tokens) == (known - 1, 3 + 1)
        assert srv.stats["reused_tokens"] == known - 1
        assert srv.stats["prefill_tokens"] == len(prompts[1]) + 4
        edited = prompts[0] + [20, 21]  # does not extend the session's tokens
        three = srv.generate("t3", edited, **kw)
        assert three.num_cached_tokens == 0 and three.num_computed_prompt_tokens == len(edited)
        assert three.token_ids == greedy_reference(tiny_model, edited, len(three.token_ids), (stop_id,))
        srv.release_session("chat")
        four = srv.generate("t4", edited + three.token_ids, **kw)
        assert four.num_cached_tokens == 0
        assert srv.stats["reuse_misses"] == 1
    with rollout.RolloutServer(tiny_engine, steps_per_sync=4, reuse_prefix=False) as plain:
        ref = [plain.generate("t1", prompts[1], **kw), plain.generate("t2", turn2, **kw)]
        assert ref[1].num_cached_tokens == 0 and plain.stats.get("reused_tokens", 0) == 0
    assert [t.token_ids for t in turns] == [r.token_ids for r in ref]
    np.testing.assert_allclose(turns[1].log_probs, ref[1].log_probs, atol=1e-5)
    assert two.token_ids == greedy_reference(tiny_model, turn2, len(two.token_ids), (stop_id,))


@pytest.mark.parametrize("sampling", [GREEDY, rollout.SamplingParams(1.0, 20, 0.95)])
def test_server_rows_equal_driver_rows_for_the_same_seed(tiny_driver, tiny_engine, prompts, sampling):
    batch = tiny_driver.generate(prompts, n=2, max_new_tokens=8, sampling=sampling, seed=5)
    with rollout.RolloutServer(tiny_engine, steps_per_sync=4) as srv:
        futures = {r: srv.submit(f"r{r}", prompts[r // 2], sampling=sampling, max_new_tokens=8,
                                 seed=5, row=r) for r in reversed(range(12))}  # another order
        outs = {r: f.result() for r, f in futures.items()}
    for r, out in outs.items():
        n = batch.response_lengths[r]
        assert out.token_ids == batch.responses[r, :n].tolist(), r
        np.testing.assert_allclose(out.log_probs, batch.rollout_log_probs[r, :n], atol=1e-5)
        assert out.finish_reason == batch.finish_reasons[r]
        assert out.num_prompt_tokens == len(prompts[r // 2]) and out.policy_versions == [0] * n
    if not sampling.greedy:
        assert outs[0].token_ids != outs[1].token_ids  # rows are separate streams


def test_many_concurrent_async_and_thread_requests_each_equal_their_solo_result(
        tiny_model, tiny_driver, tiny_engine, stop_id):
    """72 requests (64 coroutines, 8 threads) with mixed prompt lengths, budgets and sampling
    parameters on 4 slots: each equals its solo result (greedy: full forwards; sampled: the
    driver's row with the same seed)."""
    rng = np.random.default_rng(1)
    sampled = rollout.SamplingParams(0.7, 5, 1.0)
    reqs, rows = [], []  # rows: the sampled requests, each the driver's row of its rank
    for i in range(72):
        prompt = [int(t) for t in rng.integers(1, 96, size=int(rng.integers(1, 15)))]
        reqs.append(dict(prompt=prompt, max_new=int(rng.integers(1, 13)), row=len(rows),
                         sampling=sampled if i % 5 == 4 else GREEDY))
        rows += [i] if i % 5 == 4 else []
    with rollout.RolloutServer(tiny_engine, steps_per_sync=3) as srv:
        def call(i):
            r = reqs[i]
            return dict(request_id=f"q{i}", prompt_ids=r["prompt"], sampling=r["sampling"],
                        max_new_tokens=r["max_new"], seed=9, row=r["row"])

        async def many():
            return await asyncio.gather(*[srv.agenerate(**call(i)) for i in range(64)])

        thread_out = {}
        threads = [threading.Thread(target=lambda i=i: thread_out.__setitem__(i, srv.generate(**call(i))))
                   for i in range(64, 72)]
        for t in threads:
            t.start()
        outs = dict(enumerate(asyncio.run(many())))
        for t in threads:
            t.join()
        outs.update(thread_out)
        assert srv.stats["requests_finished"] == 72
    driver = tiny_driver.generate([reqs[i]["prompt"] for i in rows], n=1, max_new_tokens=12,
                                  sampling=sampled, seed=9)
    for i, out in sorted(outs.items()):
        r = reqs[i]
        if i in rows:
            j = r["row"]
            want = driver.responses[j, :driver.response_lengths[j]].tolist()[:r["max_new"]]
        else:
            want = greedy_reference(tiny_model, r["prompt"], r["max_new"], (stop_id,))
        assert out.request_id == f"q{i}" and out.token_ids == want, i
        assert len(out.log_probs) == len(want)
        assert out.finish_reason == ("stop" if want[-1] == stop_id else "length")


def test_abort_running_and_pending_requests(tiny_model, tiny_engine, prompts, stop_id, monkeypatch):
    prompt = _no_stop_prompt(tiny_model, prompts, stop_id, 6)
    with rollout.RolloutServer(tiny_engine, steps_per_sync=4) as srv:
        queued = {}

        def during_first_loop():  # the scheduler is busy: "queued" stays pending
            assert srv.abort("long")
            queued["f"] = srv.submit("queued", prompts[2], sampling=GREEDY, max_new_tokens=4)
            assert srv.abort("queued")

        hook_decode(monkeypatch, tiny_engine, {1: during_first_loop})
        out = srv.generate("long", prompt, sampling=GREEDY, max_new_tokens=20)
        assert out.finish_reason == "abort"
        assert out.token_ids == greedy_reference(tiny_model, prompt, 4)  # the one loop's 4 steps
        pending = queued["f"].result()
        assert (pending.finish_reason, pending.token_ids, pending.num_computed_prompt_tokens) == ("abort", [], 0)
        assert not srv.abort("long") and not srv.abort("never-submitted")
        again = srv.generate("long", prompt, sampling=GREEDY, max_new_tokens=6)  # id free again
        assert again.token_ids == greedy_reference(tiny_model, prompt, 6)
        assert srv.stats["requests_aborted"] == 2


@pytest.fixture
def other_weights(tiny_model, tiny_engine):
    """tiny_model with another final-norm scale: same KV cache for any tokens, other logits.
    The engine gets its own weights back afterwards."""
    other = nnx.clone(tiny_model)
    scale = np.random.default_rng(4).uniform(0.2, 3.0, tiny_model.config.hidden_size)
    other.model.norm.scale[...] = jnp.asarray(scale, jnp.float32)
    yield other
    tiny_engine.update_params(tiny_model)


def test_update_params_hold_keeps_tokens_and_continues_with_new_weights(
        tiny_model, tiny_engine, other_weights, prompts, stop_id, monkeypatch):
    prompt = _no_stop_prompt(tiny_model, prompts, stop_id, 8)
    with rollout.RolloutServer(tiny_engine, steps_per_sync=4) as srv:
        sync = {}
        hook_decode(monkeypatch, tiny_engine,
                     {2: lambda: sync.setdefault("f", srv.submit_update(other_weights))})
        out = srv.generate("r", prompt, sampling=GREEDY, max_new_tokens=16)
        assert sync["f"].result()["policy_version"] == 1 and srv.policy_version == 1
    before, after = out.token_ids[:8], out.token_ids[8:]  # two loops of 4 steps, then the sync
    assert before == greedy_reference(tiny_model, prompt, 8)
    assert len(after) >= 1 and out.policy_versions == [0] * 8 + [1] * len(after)
    assert out.policy_version == 1 and sync["f"].result()["held_requests"] == 1
    assert after == greedy_reference(other_weights, prompt + before, len(after), (stop_id,))
    assert after != greedy_reference(tiny_model, prompt + before, len(after))  # weights matter
    np.testing.assert_allclose(out.log_probs[8:], trainer_log_probs(other_weights, prompt + before, after, 0.0),
                               atol=1e-5)


def test_update_params_finish_lets_running_requests_end_first(
        tiny_model, tiny_engine, other_weights, prompts, stop_id, monkeypatch):
    with rollout.RolloutServer(tiny_engine, steps_per_sync=2) as srv:
        later = {}

        def during_first_loop():
            later["sync"] = srv.submit_update(other_weights, version=7, in_flight="finish")
            later["req"] = srv.submit("after", prompts[1], sampling=GREEDY, max_new_tokens=6)

        hook_decode(monkeypatch, tiny_engine, {1: during_first_loop})
        first = srv.generate("before", prompts[0], sampling=GREEDY, max_new_tokens=6)
        second = later["req"].result()
        assert later["sync"].result()["held_requests"] == 0 and srv.policy_version == 7
    assert first.token_ids == greedy_reference(tiny_model, prompts[0], 6, (stop_id,))
    assert (first.policy_version, set(first.policy_versions)) == (0, {0})
    assert second.token_ids == greedy_reference(other_weights, prompts[1], 6, (stop_id,))
    assert (second.policy_version, set(second.policy_versions)) == (7, {7})
    assert second.token_ids != greedy_reference(tiny_model, prompts[1], 6, (stop_id,))


def test_requests_are_validated_at_submit_and_long_prompts_prefill_in_chunks(
        tiny_model, tiny_engine, prompts, stop_id, monkeypatch):
    with rollout.RolloutServer(tiny_engine, steps_per_sync=4) as srv:
        kw = dict(sampling=GREEDY, max_new_tokens=4)
        with pytest.raises(ValueError, match="max_target_length"):
            srv.submit("a", list(range(1, 30)), **kw)
        with pytest.raises(ValueError, match="empty"):
            srv.submit("a", [], **kw)
        with pytest.raises(ValueError, match=r"outside \[0, 96\)"):
            srv.submit("a", [1, 96], **kw)
        with pytest.raises(ValueError, match="max_new_tokens"):
            srv.submit("a", [1], sampling=GREEDY, max_new_tokens=0)
        with pytest.raises(TypeError, match="SamplingParams"):
            srv.submit("a", [1], sampling=0.0, max_new_tokens=2)
        with pytest.raises(ValueError, match="row"):
            srv.submit("a", [1], row=-1, **kw)
        with pytest.raises(ValueError, match="in_flight"):
            srv.submit_update(tiny_model, in_flight="later")
        dup = {}

        def during_first_loop():  # "a" is running: a second "a" is refused
            with pytest.raises(ValueError, match="already pending or running"):
                srv.submit("a", [1, 2], **kw)
            dup["checked"] = True

        hook_decode(monkeypatch, tiny_engine, {1: during_first_loop})
        srv.generate("a", [1, 2], **kw)
        assert dup == {"checked": True}
        long = prompts[3] + prompts[5] + prompts[1]  # 28 tokens > max_prefill_length=16
        out = srv.generate("long", long, sampling=GREEDY, max_new_tokens=3)
        assert out.num_computed_prompt_tokens == 28
        assert out.token_ids == greedy_reference(tiny_model, long, 3, (stop_id,))


def test_scheduler_error_fails_every_waiting_future_and_later_calls(tiny_engine, prompts, monkeypatch):
    srv = rollout.RolloutServer(tiny_engine, steps_per_sync=4)
    futures = [srv.submit("r0", prompts[0], sampling=GREEDY, max_new_tokens=4)]

    def boom():
        futures.extend(srv.submit(f"r{i}", prompts[i], sampling=GREEDY, max_new_tokens=4)
                       for i in range(1, 6))  # pending when the scheduler dies
        raise RuntimeError("boom in the decode loop")

    hook_decode(monkeypatch, tiny_engine, {1: boom})
    with pytest.raises(RuntimeError, match="boom in the decode loop"):
        futures[0].result()
    assert len(futures) == 6
    for f in futures[1:]:
        with pytest.raises(RuntimeError, match="boom in the decode loop"):
            f.result()
    with pytest.raises(RuntimeError, match="scheduler thread failed.*boom"):
        srv.submit("late", prompts[0], sampling=GREEDY, max_new_tokens=4)
    with pytest.raises(RuntimeError, match="scheduler thread failed"):
        srv.update_params(tiny_engine.params)
    srv.close()  # returns: the thread is gone


def test_close_aborts_what_is_left_and_refuses_new_requests(tiny_engine, prompts, monkeypatch):
    srv = rollout.RolloutServer(tiny_engine, steps_per_sync=2)
    left = {}

    def during_first_loop():
        left["queued"] = [srv.submit(f"q{i}", prompts[i], sampling=GREEDY, max_new_tokens=4)
                          for i in range(4)]
        srv.close()  # from the scheduler thread: it stops after this loop

    hook_decode(monkeypatch, tiny_engine, {1: during_first_loop})
    out = srv.generate("run", prompts[0], sampling=GREEDY, max_new_tokens=20)
    assert out.finish_reason == "abort" and len(out.token_ids) == 2
    assert [f.result().finish_reason for f in left["queued"]] == ["abort"] * 4
    srv.close()
    with pytest.raises(RuntimeError, match="closed"):
        srv.submit("new", prompts[0], sampling=GREEDY, max_new_tokens=4)
