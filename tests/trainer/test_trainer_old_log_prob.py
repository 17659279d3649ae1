"""Where old_log_probs come from (`jaxrl_llm/trainer/_old_log_prob.py`): the pass is skipped when
nothing reads its result (same weights and metrics as with it), runs whenever something does, and
bypass mode (verl's `algorithm.rollout_correction.bypass_mode`) takes the engine's log-probs:
equal to the recomputed path when engine and trainer agree, different when they do not."""
import dataclasses
import re

import jax
import numpy as np
import pytest

from jaxrl_llm.config import ConfigError, validate
from jaxrl_llm.trainer import RLTrainer
from jaxrl_llm.trainer import _batch as B
from jaxrl_llm.trainer._old_log_prob import old_log_prob_readers, old_log_prob_source
from jaxrl_llm.workers import HostWorker

_ONE_MINI_BATCH = {"actor.ppo_mini_batch_size": 8}  # = data.train_batch_size of the tiny config
_FORCE_PASS = {"actor.skip_redundant_old_log_prob": False}
_BYPASS = {"algorithm.rollout_correction.bypass_mode": True}
_MISMATCH = ("actor/entropy_rollout", "rollout/logprob_abs_diff/", "rollout/probs_diff/")
_NOT_COMPARED = ("timing_s/", "timing_per_token_ms/", "perf/", "rollout/sync_", "training/old_log_prob_skipped") + _MISMATCH


def _steps(run, steps=2, engine_passes=None):
    """(metrics of each step, actor params as numpy leaves, old-log-prob passes run); the batch
    of each engine pass is appended to `engine_passes`."""
    trainer = RLTrainer(run)
    try:
        trainer.call0(HostWorker.start_rl, run.trainer.total_training_steps)
        worker, passes = trainer.group.workers[0], []
        real = worker.compute_old_log_prob
        worker.compute_old_log_prob = lambda batch: passes.append(1) or real(batch)
        real_engine = worker.compute_engine_log_prob
        if engine_passes is not None:
            worker.compute_engine_log_prob = lambda batch: engine_passes.append(batch) or real_engine(batch)
        metrics = []
        for _ in range(steps):
            metrics.append(trainer.train_step())
            trainer.global_step += 1
        params = [np.asarray(x) for x in jax.tree.leaves(jax.device_get(worker.actor.params))]
    finally:
        trainer.close()
    return metrics, params, len(passes)


def _assert_same_params(a, b, rel=1e-5):
    for x, y in zip(a, b, strict=True):
        np.testing.assert_allclose(x, y, rtol=rel, atol=1e-7)


def _max_rel_diff(a, b):
    return max(float(np.abs(x - y).max() / max(np.abs(y).max(), 1e-12)) for x, y in zip(a, b, strict=True))


def test_redundant_pass_is_skipped_with_the_same_weights_and_metrics(tiny_run):
    """One mini-batch, one epoch: the update's first (only) mini-batch takes pi_old from its own
    forward, so the pass's result is never read. Skipping it changes nothing but the pass's
    own diagnostics and timing (rel 1e-5 over 2 steps, the second one after a weight sync)."""
    skip, skip_params, skip_passes = _steps(tiny_run(**_ONE_MINI_BATCH))
    full, full_params, full_passes = _steps(tiny_run(**_ONE_MINI_BATCH, **_FORCE_PASS))
    assert (skip_passes, full_passes) == (0, 2)
    for s, f in zip(skip, full):
        assert s["training/old_log_prob_skipped"] == 1.0 and f["training/old_log_prob_skipped"] == 0.0
        assert "timing_s/old_log_prob" not in s and "timing_s/old_log_prob" in f
        assert "rollout/logprob_abs_diff/mean" not in s and f["rollout/logprob_abs_diff/mean"] < 1e-4
        assert f["actor/grad_norm"] > 0 and f["actor/ppo_kl"] == 0.0  # an update, at ratio 1
        compared = [k for k in f if not k.startswith(_NOT_COMPARED)]
        assert sorted(k for k in s if not k.startswith(_NOT_COMPARED)) == sorted(compared)
        assert len(compared) > 20
        for k in compared:
            assert s[k] == pytest.approx(f[k], rel=1e-5, abs=1e-7), k
    _assert_same_params(skip_params, full_params)


@pytest.mark.parametrize("overrides, reader", [
    ({}, None),
    ({"actor.ppo_mini_batch_size": 4}, "several mini-batches"),
    ({"actor.ppo_epochs": 2}, "actor.ppo_epochs > 1"),
    ({"algorithm.use_kl_in_reward": True}, "algorithm.use_kl_in_reward"),
    ({"algorithm.rollout_correction.rollout_is": "token"}, "algorithm.rollout_correction"),
    ({"algorithm.rollout_correction.rollout_token_veto_threshold": 1e-4}, "algorithm.rollout_correction"),
    (_FORCE_PASS, "actor.skip_redundant_old_log_prob=False"),
])
def test_the_pass_runs_whenever_something_reads_it(tiny_run, overrides, reader):
    run = tiny_run(**{**_ONE_MINI_BATCH, **overrides})
    rows, mini_rows = run.data.train_batch_size * run.rollout.n, run.actor.ppo_mini_batch_size * run.rollout.n
    source = old_log_prob_source(run, rows=rows, mini_rows=mini_rows)
    assert source == ("update" if reader is None else "pass")
    readers = old_log_prob_readers(run, rows=rows, mini_rows=mini_rows)
    assert (reader is None and readers == ()) or any(r.startswith(reader) for r in readers)
    # bypass mode never computes them (rollout correction refuses bypass mode: not combined here)
    if "rollout_correction" not in str(overrides):
        bypass = dataclasses.replace(run, rollout=dataclasses.replace(run.rollout, use_rollout_log_probs=True))
        assert old_log_prob_source(bypass, rows=rows, mini_rows=mini_rows) == "rollout"


def test_the_pass_runs_in_a_step_with_two_mini_batches(tiny_run):
    metrics, _, passes = _steps(tiny_run(), steps=1)  # tiny: 8 prompts, mini-batches of 4
    assert passes == 1 and metrics[0]["training/old_log_prob_skipped"] == 0.0
    assert "timing_s/old_log_prob" in metrics[0] and "rollout/logprob_abs_diff/mean" in metrics[0]


def test_bypass_mode_equals_the_recomputed_path_only_when_engine_and_trainer_agree(tiny_run, monkeypatch):
    """fp32 on CPU: the engine's log-probs are the trainer's to ~1e-6, so pi_old = the engine's
    (2 mini-batches: both read it) trains the same weights as the pass (rel 1e-5). An engine
    whose log-probs are off by 0.5 nats per token (as stale weights or a low-precision engine
    would be) changes what bypass mode trains (the recomputed path never reads them but for
    its diagnostics)."""
    full, full_params, full_passes = _steps(tiny_run())
    bypass, bypass_params, bypass_passes = _steps(tiny_run(**_BYPASS))
    assert (full_passes, bypass_passes) == (2, 0)
    for f, b in zip(full, bypass):
        assert b["training/old_log_prob_skipped"] == 1.0 and "timing_s/old_log_prob" not in b
        assert f["rollout/logprob_abs_diff/mean"] < 1e-4
        for k in ("actor/pg_loss", "actor/ppo_kl", "actor/grad_norm", "critic/score/mean"):
            assert b[k] == pytest.approx(f[k], rel=1e-5, abs=1e-6), k
    _assert_same_params(bypass_params, full_params)

    real = B.rollout_batch

    def off_engine(*args, **kwargs):
        batch = real(*args, **kwargs)
        batch.rollout_log_probs = batch.rollout_log_probs - 0.5 * batch.response_mask
        return batch
    monkeypatch.setattr(B, "rollout_batch", off_engine)
    off_bypass, off_bypass_params, _ = _steps(tiny_run(**_BYPASS))
    assert off_bypass[0]["actor/ppo_kl"] == pytest.approx(-0.5, abs=0.05)  # the mismatch is in the ratio
    assert _max_rel_diff(off_bypass_params, full_params) > 1e-3


def test_bypass_mode_is_an_alias_of_use_rollout_log_probs(tiny_run):
    for overrides in (_BYPASS, {"rollout.use_rollout_log_probs": True}):
        run = tiny_run(**overrides)
        assert run.rollout.use_rollout_log_probs and run.algorithm.rollout_correction.bypass_mode
    run = tiny_run()
    assert not run.rollout.use_rollout_log_probs and not run.algorithm.rollout_correction.bypass_mode
    with pytest.raises(ConfigError, match=re.escape("bypass_mode")):
        tiny_run(**_BYPASS, **{"algorithm.rollout_correction.rollout_is": "token"})
    built = dataclasses.replace(run, rollout=dataclasses.replace(run.rollout, use_rollout_log_probs=True))
    with pytest.raises(ConfigError, match=re.escape("bypass_mode=False is an alias of rollout.use_rollout_log_probs")):
        validate(built)


_BF16 = {"model.dtype": "bfloat16", "rollout.batch_invariant": True}
_ENGINE_PASS = {"actor.old_log_prob_pass": "engine"}


@pytest.mark.parametrize("variant, extra", [
    ("tiny,local", {}),
    ("tiny,local,moe", {"actor.router_replay.mode": "replay", "mesh.data": 2, "mesh.fsdp": 4}),  # Qwen3-MoE, R3
])
def test_the_engine_pass_gives_the_engines_log_probs_bit_for_bit_in_bf16(tiny_run, variant, extra):
    """actor.old_log_prob_pass='engine', bf16 compute and KV cache, 2 steps (the second after a
    weight sync): pi_old is the engine's replay of each response, equal to the rollout's
    log-probs to the bit (rollout/logprob_abs_diff/max == 0), where the trainer's forward differs
    from them; the update reads it in both mini-batches and trains. Dense, and MoE with router
    replay (the update routes by the engine's recorded experts)."""
    calls = []
    engine, _, trainer_passes = _steps(tiny_run(variant, **_BF16, **_ENGINE_PASS, **extra), engine_passes=calls)
    assert trainer_passes == 0 and len(calls) == 2
    for m, batch in zip(engine, calls):
        assert m["training/old_log_prob_skipped"] == 0.0 and "actor/entropy_rollout" not in m
        assert m["rollout/logprob_abs_diff/max"] == 0.0 and m["rollout/probs_diff/max"] == 0.0
        assert m["actor/grad_norm"] > 0
        mask = batch.response_mask > 0
        np.testing.assert_array_equal(batch.old_log_probs[mask], batch.rollout_log_probs[mask])
    assert engine[0]["actor/ppo_kl"] != 0.0  # the trainer's forward is not the engine's: ratio != 1
    if extra:
        assert "rollout/router_replay/mismatch_frac" not in engine[0]  # no trainer pass to compare
        return
    trainer, _, _ = _steps(tiny_run(**_BF16), steps=1)
    assert trainer[0]["rollout/logprob_abs_diff/max"] > 0.0  # the trainer's forward differs (CPU: ~5e-7)


@pytest.mark.parametrize("extra, match", [
    ({}, "rollout.batch_invariant=False"),
    ({"rollout.batch_invariant": True, "trainer.v1.trainer_mode": "colocate_async"}, "trainer_mode='colocate_async'"),
    ({"rollout.batch_invariant": True, "rollout.quantization": "fp8"}, "rollout.quantization='fp8'"),
    ({"rollout.batch_invariant": True, **_BYPASS}, "bypass mode"),
])
def test_the_engine_pass_refuses_what_it_cannot_replay(tiny_run, extra, match):
    with pytest.raises(ConfigError, match=re.escape(match)):
        tiny_run(**_ENGINE_PASS, **extra)
    with pytest.raises(ConfigError, match="actor.old_log_prob_pass"):
        tiny_run(**{"actor.old_log_prob_pass": "gpu"})
