"""Separate placement (rollout on its own devices) and a learned reward model."""
import math

import numpy as np
from flax import nnx

import sharding
from jaxrl_llm import models
from jaxrl_llm.trainer import RLTrainer
from jaxrl_llm.workers import HostWorker


def test_separate_placement_runs_rollout_on_its_own_devices(tiny_run):
    run = tiny_run(**{"mesh.fsdp": 4, "placement.mode": "separate", "placement.rollout_mesh.tensor": 4,
                      "model.init.num_key_value_heads": 4})
    trainer = RLTrainer(run)
    try:
        trainer.call0(HostWorker.start_rl, 1)
        host = trainer.group.workers[0]
        train_devs = set(host.mesh.devices.flat)
        rollout_devs = set(host.rollout_mesh.devices.flat)
        assert len(train_devs) == 4 and len(rollout_devs) == 4 and not train_devs & rollout_devs
        engine_devs = {d for x in __import__("jax").tree.leaves(host.engine.params) for d in x.sharding.device_set}
        assert engine_devs == rollout_devs
        metrics = trainer.train_step()
    finally:
        trainer.close()
    # weights cross meshes: every byte is copied, none shared
    assert metrics["rollout/sync_zero_copy"] == 0.0
    assert metrics["rollout/sync_bytes_moved"] == metrics["rollout/sync_bytes_total"] > 0
    assert metrics["rollout/logprob_abs_diff/mean"] < 1e-4 and math.isfinite(metrics["actor/pg_loss"])


def test_reward_model_scores_replace_rule_rewards(tiny_run, tmp_path):
    tok = models.CharTokenizer()
    cfg = models.ModelConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, model_type="qwen2",
                             attention_bias=True)
    mesh = sharding.make_mesh((1, 8, 1))
    rm = sharding.init_sharded(lambda: models.ValueModel(cfg, rngs=nnx.Rngs(params=3)), mesh, "train")
    models.save_pretrained(rm, tmp_path / "rm", tokenizer=tok)
    # the rule-based function would fail on every row: with a reward model it is never called
    run = tiny_run(**{"reward.model.path": tmp_path / "rm", "reward.custom_reward_function.name": "broken",
                      "reward.model.micro_batch_size_per_device": 1})
    trainer = RLTrainer(run)
    try:
        trainer.call0(HostWorker.start_rl, 1)
        metrics = trainer.train_step()
    finally:
        trainer.close()
    assert "reward/num_errors" not in metrics
    assert metrics["critic/score/max"] != metrics["critic/score/min"]  # a real, varying model score
    assert np.isfinite(metrics["critic/score/mean"]) and metrics["actor/grad_norm"] > 0
