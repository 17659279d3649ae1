"""`RolloutDriver.teacher_force` (actor.old_log_prob_pass='engine'): the engine's own prefill and
decode programs fed a response's tokens give, on a `batch_invariant` engine, the log-probs the
rollout reported for them bit for bit (bf16 weights and cache here), in another row order, beside
other rows, and with a MoE model's routing; a changed weight changes them (the pass is computed,
not copied)."""
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rollout
from jaxrl_llm import models

SAMPLED = rollout.SamplingParams(0.9)
FIXTURE = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "fixtures", "models", "qwen3_moe"))


def _engine(model, **kw):
    return rollout.Engine.from_model(model, max_concurrent_decodes=8, max_prefill_length=16,
                                     max_target_length=32, temperature=0.9, pad_token_id=0,
                                     stop_token_ids=(3,), dtype=jnp.bfloat16, batch_invariant=True, **kw)


@pytest.fixture(scope="module")
def prompts5():
    rng = np.random.default_rng(5)
    return [[int(t) for t in rng.integers(8, 96, size=int(s))] for s in (9, 4, 12, 6, 15)]


@pytest.fixture(scope="module", params=["dense", "moe"])
def engine(request, tiny_model):
    if request.param == "dense":
        return _engine(tiny_model)
    return _engine(models.from_pretrained(FIXTURE), record_experts=True)


def test_teacher_forced_log_probs_are_the_rollouts_bit_for_bit(engine, prompts5):
    driver = rollout.RolloutDriver(engine, steps_per_sync=4)
    out = driver.generate(prompts5, n=3, max_new_tokens=12, sampling=SAMPLED, seed=11)
    rows = len(out.responses)
    prompts = [prompts5[i] for i in out.prompt_index]
    assert out.response_lengths.min() >= 1 and len(set(out.response_lengths.tolist())) > 1
    forced = driver.teacher_force(prompts, out.responses, out.response_lengths, max_new_tokens=12,
                                  sampling=SAMPLED)
    np.testing.assert_array_equal(forced, out.rollout_log_probs)
    assert np.all(forced[out.response_mask > 0] < 0)
    # shuffled rows, some rows twice, beside another prompt's row: each row's log-probs unchanged
    perm = np.random.default_rng(0).permutation(rows)[: rows - 2]
    extra = [list(range(20, 31))]
    resp = np.concatenate([out.responses[perm], out.responses[:1]])
    lengths = np.concatenate([out.response_lengths[perm], out.response_lengths[:1]])
    again = driver.teacher_force([prompts[i] for i in perm] + extra, resp, lengths, max_new_tokens=12,
                                 sampling=SAMPLED)
    np.testing.assert_array_equal(again[:-1], out.rollout_log_probs[perm])
    assert np.any(again[-1] != out.rollout_log_probs[0])  # another prompt: other log-probs


def test_teacher_forcing_reads_the_engines_current_weights(tiny_model, prompts5):
    engine = _engine(tiny_model)
    driver = rollout.RolloutDriver(engine, steps_per_sync=4)
    out = driver.generate(prompts5[:2], n=2, max_new_tokens=6, sampling=SAMPLED, seed=1)
    prompts = [prompts5[i] for i in out.prompt_index]
    before = driver.teacher_force(prompts, out.responses, out.response_lengths, max_new_tokens=6, sampling=SAMPLED)
    params = jax.tree.map(lambda x: x * 1.01, engine.params)
    engine.update_params(params)
    after = driver.teacher_force(prompts, out.responses, out.response_lengths, max_new_tokens=6, sampling=SAMPLED)
    mask = out.response_mask > 0
    assert np.all(before[mask] == out.rollout_log_probs[mask])
    assert np.all(after[mask] != before[mask])


def test_teacher_force_refuses_what_it_cannot_replay(tiny_model, prompts5):
    plain = rollout.Engine.from_model(tiny_model, max_concurrent_decodes=4, max_prefill_length=16,
                                      max_target_length=32)
    with pytest.raises(ValueError, match="batch_invariant"):
        rollout.RolloutDriver(plain).teacher_force([prompts5[0]], np.ones((1, 4), np.int32), [4], max_new_tokens=4)
    driver = rollout.RolloutDriver(_engine(tiny_model))
    with pytest.raises(ValueError, match="stop token at position 1"):  # a multi-turn row: stop mid-way
        driver.teacher_force([prompts5[0]], np.asarray([[9, 3, 10, 3]]), [4], max_new_tokens=4)
    with pytest.raises(ValueError, match="outside"):
        driver.teacher_force([prompts5[0]], np.asarray([[9, 500]]), [2], max_new_tokens=4)
    with pytest.raises(ValueError, match="lengths must be in"):
        driver.teacher_force([prompts5[0]], np.asarray([[9, 10]]), [3], max_new_tokens=4)
    np.testing.assert_array_equal(  # nothing to score
        driver.teacher_force([prompts5[0]], np.asarray([[9, 10]]), [0], max_new_tokens=4), np.zeros((1, 2)))


def test_prompts_prefilled_in_several_fixed_row_calls_keep_their_recorded_experts(prompts5):
    """A batch_invariant engine prefills 5 prompts as two fixed-row calls joined into one prefix;
    the join keeps each prompt's recorded experts (router replay), equal to a prompt's alone."""
    engine = _engine(models.from_pretrained(FIXTURE), record_experts=True)
    driver = rollout.RolloutDriver(engine, steps_per_sync=4)
    kw = dict(n=1, max_new_tokens=4, sampling=SAMPLED, seed=3, prompt_width=16)
    together = driver.generate(prompts5, **kw).routed_experts
    alone = driver.generate(prompts5[4:], row_offset=4, **kw).routed_experts
    for r, p in enumerate(prompts5):
        assert np.all(together[r, 16 - len(p):15] >= 0)  # every prompt token but the last was routed
    np.testing.assert_array_equal(together[4], alone[0])
