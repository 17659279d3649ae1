"""rollout.quantization and rollout.kv_cache_dtype in a training step: the engine rolls out with
fp8 weights and an fp8 KV cache, token-level TIS is on by default, and the mismatch metrics reach
the step's metrics."""
import math

import jax

from jaxrl_llm.trainer import RLTrainer
from jaxrl_llm.workers import HostWorker


def test_fp8_rollout_step_reports_the_mismatch_and_applies_tis(tiny_run):
    run = tiny_run(**{"rollout.quantization": "fp8", "rollout.kv_cache_dtype": "fp8"})
    assert run.algorithm.rollout_correction.rollout_is == "token"  # on by default
    trainer = RLTrainer(run)
    try:
        trainer.call0(HostWorker.start_rl, run.trainer.total_training_steps)
        engine = trainer.group.workers[0].engine  # the local backend's host worker
        assert engine.quantization == "fp8"
        assert "float8_e4m3fn" in {str(x.dtype) for x in jax.tree.leaves(engine.params)}
        assert str(engine.kv_cache_dtype) == "float8_e4m3fn"
        assert {str(x.dtype) for x in jax.tree.leaves(engine.init_decode_state().cache)} == {"float8_e4m3fn"}
        metrics = trainer.train_step()
    finally:
        trainer.close()
    # present only when rollout correction runs (absent from a default bf16 step,
    # test_trainer_rollout_correction); on this tiny random model the fp8 mismatch is small
    for name in ("kl", "k3_kl", "log_ppl_abs_diff", "chi2_token", "rollout_is_mean"):
        assert math.isfinite(metrics[f"rollout_corr/{name}"]), name
    assert metrics["rollout_corr/k3_kl"] >= 0 and "timing_s/rollout_correction" in metrics
