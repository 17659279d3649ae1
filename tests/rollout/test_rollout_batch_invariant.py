"""`batch_invariant` engines (rollout.batch_invariant): a request's tokens and log-probs are
bit-identical whatever shares its prefill and decode calls, whichever slot it lands in, in whatever
order requests arrive, and whether or not a session's earlier KV is still parked.

Without the option, on CPU a prompt prefilled among 8 differs from the same prompt prefilled among
4 in the last bits (XLA's matmul blocking depends on the number of rows): log-probs about 5e-7
apart in fp32. Decode runs every slot at one shape, so it has no such dependence (checked below).
"""
import jax
import numpy as np
import pytest

import rollout
from conftest import hook_decode  # at collection (tests/rollout/conftest.py); later, `conftest` can be another

SAMPLED = rollout.SamplingParams(1.0)
SLOTS = 8


@pytest.fixture(scope="module")
def prompts8():
    rng = np.random.default_rng(1)
    return [[int(t) for t in rng.integers(8, 96, size=int(s))] for s in (9, 7, 12, 5, 11, 3, 14, 6)]


@pytest.fixture(scope="module", params=["per_layer", "stacked"])
def engine(request, tiny_model):
    return rollout.Engine.from_model(tiny_model, max_concurrent_decodes=SLOTS, max_prefill_length=16,
                                     max_target_length=48, temperature=1.0, pad_token_id=0,
                                     layer_layout=request.param, batch_invariant=True)


def _decode(engine, placements, steps=10):
    """placements: [(prompt, slot, prefill call)]; the prompts of one call are prefilled together.
    Every request samples with the same key, so equal inputs give equal tokens. Returns
    {slot: (tokens int[steps], log-probs f32[steps])}."""
    key = np.asarray(jax.random.key_data(jax.random.key(7)), np.uint32)
    state = engine.init_decode_state()
    calls = {}
    for prompt, slot, call in placements:
        calls.setdefault(call, []).append((prompt, slot))
    for items in calls.values():
        m = len(items)
        tokens = np.zeros((m, 16), np.int32)
        for j, (p, _) in enumerate(items):
            tokens[j, :len(p)] = p
        prefix = engine.prefill_batch(engine.params, tokens, np.asarray([len(p) for p, _ in items]))
        state = engine.insert_rows(state, prefix, src=np.arange(m), dst=np.asarray([s for _, s in items]),
                                   rows=np.zeros(m), max_new=np.full(m, 30), sampling=SAMPLED,
                                   row_keys=np.stack([key] * m))
    toks, logps = [], []
    for _ in range(steps):
        state, res = engine.generate(engine.params, state)
        toks.append(np.asarray(res.data[:, 0]))
        logps.append(np.asarray(res.log_prob[:, 0]))
    toks, logps = np.stack(toks, 1), np.stack(logps, 1)
    return {slot: (toks[slot], logps[slot]) for _, slot, _ in placements}


def test_a_request_decodes_bit_identically_alone_among_others_and_in_any_slot(engine, prompts8):
    target, others = prompts8[0], prompts8[1:]
    alone = _decode(engine, [(target, 0, 0)])[0]
    cases = {
        "alone in slot 5": ([(target, 5, 0)], 5),
        "prefilled with 7 others, slot 0": ([(target, 0, 0)] + [(p, i + 1, 0) for i, p in enumerate(others)], 0),
        "prefilled last of 8, slot 6": ([(p, (i + 7) % SLOTS, 0) for i, p in enumerate(others)]
                                        + [(target, 6, 0)], 6),
        "own prefill call, 7 others decoding, slot 3": (
            [(p, (i + 4) % SLOTS, 1) for i, p in enumerate(others)] + [(target, 3, 0)], 3),
    }
    for name, (placements, slot) in cases.items():
        toks, logps = _decode(engine, placements)[slot]
        np.testing.assert_array_equal(toks, alone[0], err_msg=name)
        np.testing.assert_array_equal(logps, alone[1], err_msg=name)


def test_prefill_rows_are_bit_identical_whatever_the_call_size(engine, prompts8):
    """The KV a prompt's prefill computes: alone (padded to the fixed rows) = among 8 = among 13."""
    def kv(batch, row):
        tokens = np.zeros((len(batch), 16), np.int32)
        for j, p in enumerate(batch):
            tokens[j, :len(p)] = p
        prefix = engine.prefill_batch(engine.params, tokens, np.asarray([len(p) for p in batch]))
        axis = 0 if engine.layer_layout != "stacked" else 1
        assert jax.tree.leaves(prefix.cache)[0].shape[axis] == len(batch)  # p rows back, not padded
        n = len(batch[row]) - 1
        return [np.take(np.asarray(x), row, axis=axis)[..., :n, :, :] for x in jax.tree.leaves(prefix.cache)]

    target = prompts8[3]
    ref = kv([target], 0)
    for batch, row in [(prompts8, 3), (prompts8 + prompts8[:5], 11)]:
        for a, b in zip(kv(batch, row), ref):
            np.testing.assert_array_equal(a, b)


def _outputs(futures):
    return {r: (f.result().token_ids, f.result().log_probs) for r, f in futures.items()}


def test_server_results_do_not_depend_on_arrival_order_or_batch_mates(engine, prompts8):
    """The request-level server batches requests as they arrive: one at a time, all 8 at once in
    reverse order, or in two waves give bit-identical tokens and log-probs per request."""
    kw = dict(sampling=SAMPLED, max_new_tokens=8, seed=5)

    def submit(srv, r):
        return srv.submit(f"r{r}", prompts8[r], row=r, **kw)

    with rollout.RolloutServer(engine, steps_per_sync=4) as srv:
        alone = {r: (o.token_ids, o.log_probs) for r in range(8)
                 for o in [srv.generate(f"r{r}", prompts8[r], row=r, **kw)]}
        together = _outputs({r: submit(srv, r) for r in reversed(range(8))})
        first = {r: submit(srv, r) for r in (5, 1, 6)}
        waves = _outputs({**first, **{r: submit(srv, r) for r in (0, 2, 3, 4, 7)}})
        assert srv.stats["prefill_calls"] >= 10  # the three schedules did batch differently
    assert together == alone
    assert waves == alone


def test_session_turn_is_bit_identical_with_or_without_its_parked_kv(engine, prompts8):
    """A second turn computes the same numbers whether its session's slot is still parked or was
    evicted: batch_invariant prefills every turn in full (decode-computed KV differs in the last
    bits from a prefill's, and whether a parked slot survives depends on arrival timing)."""
    kw = dict(sampling=SAMPLED, max_new_tokens=6, seed=2)
    sessions = range(6)
    with rollout.RolloutServer(engine, steps_per_sync=4) as srv:
        ones = _outputs({r: srv.submit(f"a{r}", prompts8[r], session_id=f"s{r}", row=r, **kw)
                         for r in sessions})
        turn2 = {r: prompts8[r] + ones[r][0] + [11, 12, 13] for r in sessions}
        futures = {r: srv.submit(f"b{r}", turn2[r], session_id=f"s{r}", row=r, **kw) for r in sessions}
        assert all(f.result().num_cached_tokens == 0 for f in futures.values())
        twos = _outputs(futures)
    with rollout.RolloutServer(engine, steps_per_sync=4) as fresh:
        ref = _outputs({r: fresh.submit(f"b{r}", turn2[r], row=r, **kw) for r in reversed(sessions)})
    assert twos == ref


def test_chunked_prefill_of_long_prompts_is_bit_identical_alone_or_together(engine):
    """Prompts over max_prefill_length (16) are prefilled in part and the rest appended to the slot
    (`Engine.append_rows`): that call too computes a request's rows at one shape, alone or among 5."""
    rng = np.random.default_rng(4)
    long = [[int(t) for t in rng.integers(8, 96, size=int(s))] for s in (20, 31, 18, 25, 28)]
    kw = dict(sampling=SAMPLED, max_new_tokens=6, seed=3)
    with rollout.RolloutServer(engine, steps_per_sync=4) as srv:
        alone = {r: (o.token_ids, o.log_probs) for r in range(5)
                 for o in [srv.generate(f"r{r}", long[r], row=r, **kw)]}
        together = _outputs({r: srv.submit(f"r{r}", long[r], row=r, **kw) for r in reversed(range(5))})
        assert srv.stats["append_calls"] >= 6
    assert together == alone


def test_engine_log_probs_use_the_trainers_log_softmax_on_its_own_logits(tiny_model, monkeypatch, prompts8):
    """batch_invariant reports log_softmax(logits / T)[token] exactly as the trainer's log-prob
    pass computes it from the same logits (`sample`'s own chunked log-prob differs in the last
    bits): the logits each decode step made are captured and handed to the trainer's function."""
    from jaxrl_llm.algos import _logprobs
    from rollout import _engine

    seen = []

    def spy(logits, keys, temperature, top_k, top_p):
        jax.debug.callback(lambda *a: seen.append([np.asarray(x) for x in a]), logits, temperature)
        return rollout.sample(logits, keys, temperature, top_k, top_p)

    monkeypatch.setattr(_engine, "sample", spy)
    engine = rollout.Engine.from_model(tiny_model, max_concurrent_decodes=4, max_prefill_length=16,
                                       max_target_length=32, temperature=0.7, layer_layout="per_layer",
                                       batch_invariant=True)
    state = engine.init_decode_state()
    tokens = np.zeros((4, 16), np.int32)
    for j, p in enumerate(prompts8[:4]):
        tokens[j, :len(p)] = p
    prefix = engine.prefill_batch(engine.params, tokens, np.asarray([len(p) for p in prompts8[:4]]))
    state = engine.insert_rows(state, prefix, src=np.arange(4), dst=np.arange(4), rows=np.arange(4),
                               max_new=np.full(4, 10), sampling=rollout.SamplingParams(0.7),
                               key=jax.random.key(1))
    got, want = [], []
    for _ in range(6):
        state, res = engine.generate(engine.params, state)
        jax.effects_barrier()
        logits, temperature = seen[-1]
        tok = np.asarray(res.data[:, 0])
        got.append(np.asarray(res.log_prob[:, 0]))
        want.append(np.asarray(_logprobs.token_log_probs_from_logits(
            logits[None], tok[None], float(temperature[0])))[0])
    np.testing.assert_array_equal(np.stack(got), np.stack(want))


def test_lower_compiles_the_one_prefill_shape_a_batch_invariant_engine_runs(engine):
    """Ahead-of-time compiles (`Engine.lower`) lower the fixed-row prefill, whatever prefill_rows."""
    lowered = engine.lower(prefill_rows=16, insert_rows=4, out_rows=16, out_tokens=16, programs=["prefill"])
    _, tokens, lengths = lowered["prefill"].args_info[0]
    assert tokens.shape == (rollout.BATCH_INVARIANT_ROWS, engine.max_prefill_length)
    assert lengths.shape == (rollout.BATCH_INVARIANT_ROWS,)


@pytest.fixture(scope="module")
def engine64(tiny_model):
    return rollout.Engine.from_model(tiny_model, max_concurrent_decodes=64, max_prefill_length=16,
                                     max_target_length=32, temperature=1.0, pad_token_id=0,
                                     layer_layout="per_layer", batch_invariant=True)


def test_eight_prompts_alone_equal_the_same_prompts_among_64_requests(engine64, prompts8):
    """The issue's check: 8 prompts decoded one at a time and among 64 requests arriving at once,
    in a shuffled order (so in other slots and prefill calls), on a 64-slot engine."""
    engine = engine64
    rng = np.random.default_rng(9)
    others = [[int(t) for t in rng.integers(8, 96, size=int(rng.integers(2, 16)))] for _ in range(56)]
    kw = dict(sampling=SAMPLED, max_new_tokens=8, seed=4)
    with rollout.RolloutServer(engine, steps_per_sync=4) as srv:
        alone = {r: (o.token_ids, o.log_probs) for r in range(8)
                 for o in [srv.generate(f"a{r}", prompts8[r], row=r, **kw)]}
        requests = [(f"t{r}", prompts8[r], r) for r in range(8)] + [(f"o{i}", p, 100 + i) for i, p in enumerate(others)]
        order = rng.permutation(len(requests))
        futures = {requests[i][2]: srv.submit(requests[i][0], requests[i][1], row=requests[i][2], **kw)
                   for i in order}
        crowd = _outputs(futures)
    assert {r: crowd[r] for r in range(8)} == alone


def test_server_runs_no_prefill_call_of_padding_rows_only(engine64, prompts8, monkeypatch):
    """9 prompts arriving together take 3 fixed-row prefill calls, not the 4 that padding them to
    a power of two (16 rows) would take."""
    engine = engine64
    calls = []
    real = engine._prefill_jit
    monkeypatch.setattr(engine, "_prefill_jit", lambda *a: calls.append(a[1].shape) or real(*a))
    with rollout.RolloutServer(engine, steps_per_sync=4) as srv:
        srv.suspend()  # all 9 wait, so they are admitted together
        futures = [srv.submit(f"r{r}", (prompts8 + prompts8)[r], sampling=SAMPLED, max_new_tokens=2,
                              row=r) for r in range(9)]
        srv.resume()
        [f.result() for f in futures]
    assert calls == [(rollout.BATCH_INVARIANT_ROWS, 16)] * 3


def test_held_requests_are_refilled_at_a_sync_the_same_alone_or_beside_a_long_one(
        engine, tiny_model, prompts8, monkeypatch):
    """partial_rollout_kv="recompute": at a weight sync each held request's prefix is re-prefilled.
    Beside a long prefix (bucket 48) the short ones keep their own bucket (16), so they continue
    bit-identically to the same requests held without it."""

    rng = np.random.default_rng(5)
    long = [int(t) for t in rng.integers(8, 96, size=30)]
    kw = dict(sampling=SAMPLED, max_new_tokens=14, seed=6)

    def run(with_long):
        with rollout.RolloutServer(engine, steps_per_sync=4) as srv:
            sync = {}
            hook_decode(monkeypatch, engine, {2: lambda: sync.setdefault("f", srv.submit_update(tiny_model))})
            srv.suspend()  # admitted together, then every loop runs its 4 steps
            short = {r: srv.submit(f"s{r}", prompts8[r], row=r, **kw) for r in range(6)}
            extra = [srv.submit("long", long, row=9, **kw)] if with_long else []
            srv.resume()
            outs = _outputs(short)
            assert sync["f"].result()["held_requests"] == 6 + len(extra)
            assert srv.stats["recomputed_requests"] == 6 + len(extra)
            [f.result() for f in extra]
        monkeypatch.undo()
        return outs

    assert run(True) == run(False)


def test_rl_driver_runs_no_prefill_call_of_padding_rows_only(engine64, prompts8, monkeypatch):
    """The batch driver, as the server: 9 prompts take 3 fixed-row prefill calls (not 4, from
    padding them to 16 rows first), and their samples are those of the prompts prefilled alone."""
    engine = engine64
    calls = []
    real = engine._prefill_jit
    monkeypatch.setattr(engine, "_prefill_jit", lambda *a: calls.append(a[1].shape) or real(*a))
    prompts = (prompts8 + prompts8)[:9]
    driver = rollout.RolloutDriver(engine, steps_per_sync=4)
    params = engine.params
    kw = dict(n=1, max_new_tokens=3, sampling=SAMPLED, seed=2)
    together = driver.generate(prompts, **kw)
    assert calls == [(rollout.BATCH_INVARIANT_ROWS, 16)] * 3
    alone = driver.generate(prompts[8:], row_offset=8, **kw)
    assert params is engine.params
    for key in ("responses", "rollout_log_probs"):
        np.testing.assert_array_equal(getattr(together, key)[8:], getattr(alone, key), err_msg=key)
