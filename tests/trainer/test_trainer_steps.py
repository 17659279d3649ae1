"""One GRPO / PPO step on tiny models: local and Ray backends, several 8-device meshes."""
import json
import math

import numpy as np
import pytest

from jaxrl_llm.trainer import RLTrainer
from jaxrl_llm.workers import HostWorker
from trainer_helpers import param_checksum

REQUIRED = ["actor/pg_loss", "actor/entropy", "actor/ppo_kl", "actor/pg_clipfrac", "actor/grad_norm",
            "actor/lr", "critic/score/mean", "critic/advantages/mean", "response_length/mean",
            "timing_s/gen", "timing_s/update_actor", "timing_s/step", "perf/throughput", "perf/mfu/actor"]


def _one_step(run, inspect=None):
    """(metrics, actor checksum before, after) of one step; inspect(trainer) runs after start-up."""
    trainer = RLTrainer(run)
    try:
        trainer.call0(HostWorker.start_rl, run.trainer.total_training_steps)
        if inspect is not None:
            inspect(trainer)
        before = param_checksum(trainer)
        metrics = trainer.train_step()
        after = param_checksum(trainer)
    finally:
        trainer.close()
    return metrics, before, after


@pytest.mark.parametrize("mesh", [(1, 8, 1), (2, 2, 2), (8, 1, 1), (1, 2, 4)])
def test_grpo_step_updates_params_on_each_mesh(tiny_run, mesh):
    d, f, t = mesh
    # tensor=4 needs kv heads divisible by 4 (GQA heads are split, not replicated)
    run = tiny_run(**{"mesh.data": d, "mesh.fsdp": f, "mesh.tensor": t, "model.init.num_key_value_heads": 4})
    metrics, before, after = _one_step(run)
    for key in REQUIRED:
        assert key in metrics, key
        assert math.isfinite(metrics[key]), (key, metrics[key])
    assert metrics["actor/grad_norm"] > 0
    assert before != after
    # the custom reward (length parity) gives a mix of 0 and 1 scores
    assert 0.0 <= metrics["critic/score/mean"] <= 1.0


def test_ppo_step_with_critic(tiny_run):
    run = tiny_run(**{"algorithm.adv_estimator": "gae", "algorithm.use_kl_in_reward": True,
                      "actor.use_kl_loss": True})
    metrics, before, after = _one_step(run)
    for key in ["critic/vf_loss", "critic/vf_clipfrac", "critic/values/mean", "critic/returns/mean",
                "critic/vf_explained_var", "actor/kl_loss", "actor/reward_kl_penalty", "timing_s/values",
                "timing_s/ref", "timing_s/update_critic"]:
        assert key in metrics and math.isfinite(metrics[key]), key
    assert before != after


def test_indivisible_mesh_is_a_clear_error(tiny_run):
    run = tiny_run(**{"mesh.data": 1, "mesh.fsdp": 2, "mesh.tensor": 4})  # 2 kv heads over tensor=4
    with pytest.raises(Exception, match=r"kv_heads.*not divisible by mesh axes \('tensor',\)"):
        RLTrainer(run)


@pytest.mark.parametrize("decode_attention", ["auto", "triton"])
def test_rollout_log_probs_match_recomputed_old_log_probs(tiny_run, decode_attention):
    """triton: `model.decode_attention` reaches the rollout engine (the GPU kernel, here in
    Pallas interpret mode) and its samples score as the trainer scores them."""
    def inspect(trainer):
        assert trainer.group.workers[0].engine.config.decode_attention == decode_attention

    extra = {"model.decode_attention": decode_attention}
    if decode_attention == "triton":  # its cache length must be a multiple of 16: 16 + 16 slots
        extra["data.max_response_length"] = 16
    metrics, _, _ = _one_step(tiny_run(**extra), inspect)
    assert metrics["rollout/logprob_abs_diff/mean"] < 1e-4
    # the tail of the per-token distribution too (p99, max) and the share of tokens off by > 0.1
    assert metrics["rollout/logprob_abs_diff/max"] < 1e-3
    assert metrics["rollout/logprob_abs_diff/mean"] <= metrics["rollout/logprob_abs_diff/p99"] <= metrics["rollout/logprob_abs_diff/max"]
    assert metrics["rollout/logprob_abs_diff/frac_gt_0.1"] == 0.0
    m = {k.removeprefix("rollout/"): v for k, v in metrics.items() if k.startswith("rollout/")}
    assert m["logprob_abs_diff/mean"] <= m["logprob_abs_diff/rms"] <= m["logprob_abs_diff/max"]
    # verl's probability-space figure: |p - p'| <= |log p - log p'| for p, p' <= 1, token by token
    assert 0 <= m["probs_diff/mean"] <= m["logprob_abs_diff/mean"]
    assert m["probs_diff/mean"] <= m["probs_diff/max"] <= m["logprob_abs_diff/max"]


def test_ray_backend_runs_a_grpo_job_and_writes_metrics(tiny_run, tmp_path):
    run = tiny_run("tiny", **{"trainer.total_training_steps": 1, "trainer.export_hf": False})
    assert run.trainer.backend == "ray"
    final = RLTrainer(run).fit()
    assert any(k.startswith("val-core/") for k in final)
    lines = [json.loads(x) for x in open(f"{run.trainer.default_local_dir}/metrics.jsonl")]
    steps = [x for x in lines if x.get("training/global_step") == 1]
    assert steps and "actor/pg_loss" in steps[-1] and np.isfinite(steps[-1]["actor/grad_norm"])
