"""verl's two switches through a whole RL step (issue 31): `model.use_remove_padding` and the
token budgets (`actor.`, `critic.`, `reward.model.use_dynamic_bsz`) reach every training pass the
host runs: old and reference log-probs, values, reward-model scores, actor and critic updates."""
import math

from flax import nnx

import sharding
from jaxrl_llm import models
from jaxrl_llm.trainer import RLTrainer
from jaxrl_llm.workers import HostWorker, _roles


def test_one_step_with_both_switches_packs_every_pass(tiny_run, tmp_path, monkeypatch):
    cfg = models.ModelConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, model_type="qwen2",
                             attention_bias=True)
    rm = sharding.init_sharded(lambda: models.ValueModel(cfg, rngs=nnx.Rngs(params=3)),
                               sharding.make_mesh((1, 8, 1)), "train")
    models.save_pretrained(rm, tmp_path / "rm", tokenizer=models.CharTokenizer())
    seen = []
    real = _roles._micro_batches

    def spy(*args, **kw):
        plan, mb = real(*args, **kw)
        seen.append(("token_index" in mb, "row_valid" in mb))
        return plan, mb

    monkeypatch.setattr(_roles, "_micro_batches", spy)
    run = tiny_run(**{"reward.model.path": tmp_path / "rm", "reward.model.use_dynamic_bsz": True,
                      "reward.model.forward_max_token_len_per_device": 512,
                      "model.use_remove_padding": True, "actor.use_dynamic_bsz": True,
                      "actor.ppo_max_token_len_per_device": 512, "critic.use_dynamic_bsz": True,
                      "critic.ppo_max_token_len_per_device": 512, "algorithm.adv_estimator": "gae",
                      "actor.use_kl_loss": True, "actor.skip_redundant_old_log_prob": False})
    trainer = RLTrainer(run)
    try:
        trainer.call0(HostWorker.start_rl, 1)
        host = trainer.group.workers[0]
        assert host.actor.remove_padding and host.ref.remove_padding and host.critic.remove_padding
        assert host.reward_model.remove_padding
        assert host.reward_model.budget == (512, "reward.model.forward_max_token_len_per_device")
        assert host.critic.update_budget == (512, "critic.ppo_max_token_len_per_device")
        metrics = trainer.train_step()
    finally:
        trainer.close()
    # old log-probs, reference log-probs, values, RM scores, actor and critic updates: all packed
    assert len(seen) >= 6 and set(seen) == {(True, True)}, seen
    assert math.isfinite(metrics["actor/pg_loss"]) and math.isfinite(metrics["critic/vf_loss"])
    assert metrics["actor/grad_norm"] > 0 and metrics["critic/score/max"] != metrics["critic/score/min"]
