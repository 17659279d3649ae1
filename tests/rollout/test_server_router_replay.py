"""Router replay (R3) on the request-level path: `RolloutServer` records every fed token's experts
(prefill, appended chunks, parked-KV reuse, decode) on the tiny Qwen3-MoE fixture (fp32), and each
recorded token's experts are the model's own top-k on a full forward of the sequence."""
import os

import numpy as np
import pytest

import rollout
from conftest import hook_decode  # at collection (tests/rollout/conftest.py); later, `conftest` can be another
from jaxrl_llm import models
from moe_helpers import own_top_k

FIXTURE = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "fixtures", "models", "qwen3_moe"))
SAMPLED = rollout.SamplingParams(1.0)
PROMPT, TOOL = list(range(5, 14)), [30, 31, 32]


@pytest.fixture(scope="module")
def model():
    return models.from_pretrained(FIXTURE)


@pytest.fixture(scope="module")
def engine(model):  # max_prefill_length 16: a full turn-2 prompt is a prefill plus an appended chunk
    return rollout.Engine.from_model(model, max_concurrent_decodes=2, max_prefill_length=16,
                                     max_target_length=48, record_experts=True)


def _check(model, out, prompt):
    seq = list(prompt) + list(out.token_ids)
    ex = out.routed_experts
    assert ex is not None and ex.shape[:1] == (len(seq),) and ex.dtype == np.int8
    assert (ex[-1] == -1).all()  # the last generated token is never fed
    np.testing.assert_array_equal(np.sort(ex[:-1], -1), own_top_k(model, seq)[:-1])


@pytest.mark.parametrize("reuse", [True, False])
def test_two_session_turns_record_the_models_own_experts(model, engine, reuse):
    with rollout.RolloutServer(engine, steps_per_sync=4, reuse_prefix=reuse) as server:
        first = server.generate("t0", PROMPT, sampling=SAMPLED, max_new_tokens=8, session_id="s", seed=1)
        _check(model, first, PROMPT)
        prompt2 = PROMPT + first.token_ids + TOOL  # the tool's tokens: prefilled in turn 2
        second = server.generate("t1", prompt2, sampling=SAMPLED, max_new_tokens=8, session_id="s", seed=1)
        _check(model, second, prompt2)
        n1 = len(PROMPT) + len(first.token_ids) - 1  # turn 1's fed tokens
        assert second.num_cached_tokens == (n1 if reuse else 0)
        np.testing.assert_array_equal(second.routed_experts[:n1], first.routed_experts[:n1])
        assert server.stats["append_calls"] >= 1  # turn 2 appended (reused KV, or a chunk past 16)


def test_no_recording_without_record_experts(model):
    engine = rollout.Engine.from_model(model, max_concurrent_decodes=2, max_prefill_length=16,
                                       max_target_length=48)
    with rollout.RolloutServer(engine, steps_per_sync=4) as server:
        assert server.generate("a", PROMPT, sampling=SAMPLED, max_new_tokens=3).routed_experts is None


def test_a_sync_that_re_prefills_a_held_request_records_the_new_weights_experts(model, engine, monkeypatch):
    """partial_rollout_kv="recompute": the held request's prompt and tokens so far are re-prefilled
    with the new weights, so its whole record is the new model's routing (the earlier decode
    steps' records are replaced by the re-prefill's)."""
    import jax


    other = models.from_pretrained(FIXTURE)
    gate = other.model.layers.mlp.gate  # a changed router: other top-k choices
    gate["kernel"][...] = gate["kernel"][...] + jax.random.normal(jax.random.key(5), gate["kernel"][...].shape)
    try:
        with rollout.RolloutServer(engine, steps_per_sync=2) as server:
            sync = {}
            hook_decode(monkeypatch, engine, {2: lambda: sync.setdefault("f", server.submit_update(other))})
            out = server.generate("r", PROMPT, sampling=SAMPLED, max_new_tokens=10, seed=2)
            assert sync["f"].result()["held_requests"] == 1 and server.stats["recomputed_requests"] == 1
        assert out.policy_versions[:2] == [0, 0] and out.policy_versions[-1] == 1
        _check(other, out, PROMPT)
        seq = PROMPT + out.token_ids
        assert (np.sort(out.routed_experts[:-1], -1) != own_top_k(model, seq)[:-1]).any()  # the sync mattered
    finally:
        monkeypatch.undo()
        engine.update_params(model)


def test_jetstream_prefill_after_an_existing_prefix_keeps_and_extends_the_experts(model, engine):
    """JetStream's `prefill(existing_prefix=...)` (chunked prefill over the cached tokens): the
    result's experts are the prefix's, then the newly cached tokens' (the model's own top-k on a
    full forward of the sequence), -1 past them."""
    seq = list(range(5, 25))  # 20 tokens: more than one max_prefill_length (16)
    params = engine.params
    first = engine.prefill(params=params, padded_tokens=seq[:9], true_length=9)
    rest = seq[int(first.lengths[0]):]  # from the pending token on
    both = engine.prefill(params=params, existing_prefix=first, padded_tokens=rest, true_length=len(rest))
    n = len(seq) - 1  # all but the pending last token are cached
    assert int(both.lengths[0]) == n
    ex = np.asarray(both.experts)[0]
    np.testing.assert_array_equal(np.sort(ex[:n], -1), own_top_k(model, seq)[:n])
    np.testing.assert_array_equal(ex[:8], np.asarray(first.experts)[0, :8])
    assert (ex[n:] == -1).all()
