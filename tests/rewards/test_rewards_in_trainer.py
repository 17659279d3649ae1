"""The reward model and the judge inside a training step: the HostWorker's streaming reward loop
in an async mode (colocate_async, the judge on the policy's own server) and in sync agent rollouts
(the judge on its own checkpoint's server), the step's score being the documented weighted sum."""
import dataclasses
import json
import os

import jax
import numpy as np
import pytest
from flax import nnx

import sharding
from jaxrl_llm import models
from jaxrl_llm.config import load_config
from jaxrl_llm.trainer import RLTrainer
from jaxrl_llm.workers import HostWorker

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
QUICKSTART = os.path.join(ROOT, "configs", "quickstart.py")
FIXTURES = os.path.join(ROOT, "tests", "fixtures", "rewards")
TINY = models.ModelConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, model_type="qwen2", attention_bias=True)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """A tiny value-head reward model and a tiny judge, saved with the char tokenizer."""
    root = tmp_path_factory.mktemp("ckpt")
    mesh = sharding.make_mesh((1, 1, 1), devices=jax.devices()[:1])
    rm = sharding.init_sharded(lambda: models.ValueModel(TINY, rngs=nnx.Rngs(params=3)), mesh, "train")
    models.save_pretrained(rm, str(root / "rm"), tokenizer=models.CharTokenizer())
    judge = models.init_model(dataclasses.replace(TINY, num_key_value_heads=4), seed=5)  # shards over tensor=4
    models.save_pretrained(judge, str(root / "judge"), tokenizer=models.CharTokenizer())
    return str(root / "rm"), str(root / "judge")


def _run(tmp_path, checkpoints, **extra):
    o = {"trainer.default_local_dir": str(tmp_path / "run"), "trainer.progress_bar": False,
         "trainer.plot": False, "trainer.logger": "jsonl", "trainer.async_save": False,
         "trainer.backend": "local", "trainer.export_hf": False, "trainer.val_before_train": False,
         "data.builtin_val_size": 0,
         "reward.custom_reward_function.path": os.path.join(FIXTURES, "length_parity.py"),
         "reward.model.path": checkpoints[0], "reward.model.micro_batch_size_per_device": 1,
         "reward.rule_weight": 1.0, "reward.model.weight": 2.0,
         "reward.judge.enable": True, "reward.judge.weight": 0.5,
         "reward.judge.prompt_template": "Q:{question} R:{response} grade:",
         "reward.judge.score_parser": os.path.join(FIXTURES, "judge_parsers.py") + ":reply_length",
         "reward.judge.max_prompt_length": 12, "reward.judge.max_tokens": 4, "reward.judge.log_every": 1,
         **extra}
    return load_config(f"{QUICKSTART}:tiny,local", [f"{k}={v}" for k, v in o.items()])


def _step(run):
    trainer = RLTrainer(run)
    try:
        trainer.call0(HostWorker.start_rl, 1)
        return trainer.train_step()
    finally:
        trainer.close()


def _check(m, run):
    # the batch's sequence score is the weighted sum of the three sources (means are linear)
    want = (m["reward_extra/rule_score/mean"] + 2.0 * m["reward_extra/rm_score/mean"]
            + 0.5 * m["reward_extra/judge_score/mean"])
    assert m["critic/score/mean"] == pytest.approx(want, rel=1e-5, abs=1e-5)
    assert m["reward_extra/rm_score/mean"] != 0.0 and np.isfinite(m["actor/pg_loss"])
    assert m["reward/judge/parse_failures"] == 0.0
    judged = [json.loads(line) for line in open(os.path.join(run.trainer.default_local_dir,
                                                              "judge_generations.jsonl"))]
    assert judged and all(j["parsed"] and j["score"] == len(j["judgement"]) for j in judged)


def test_colocate_async_scores_with_reward_model_and_the_policy_as_judge(tmp_path, checkpoints):
    run = _run(tmp_path, checkpoints, **{"trainer.v1.trainer_mode": "colocate_async",
                                         "trainer.v1.colocate_async.num_warmup_batches": 1.0})
    assert run.rollout_source == "colocated_buffer"
    _check(_step(run), run)


def test_sync_agent_rollout_scores_with_reward_model_and_a_judge_checkpoint(tmp_path, checkpoints):
    run = _run(tmp_path, checkpoints, **{"rollout.multi_turn.enable": True,
                                         "reward.judge.model_path": checkpoints[1]})
    _check(_step(run), run)


def test_one_step_off_scores_the_batch_with_rule_model_and_judge_combined(tmp_path, checkpoints):
    """The batch rollout (here one-step-off, which used to refuse a reward model) scores after
    generation: the reward model over the batch, the judge's requests all at once to its own
    server, combined by the same weighted sum."""
    run = _run(tmp_path, checkpoints, **{"reward.judge.model_path": checkpoints[1],
                                         "placement.one_step_off_policy": True,
                                         "mesh.fsdp": 4, "placement.mode": "separate",
                                         "placement.rollout_mesh.tensor": 4, "model.init.num_key_value_heads": 4})
    assert run.rollout_source == "one_step_off" and not run.rollout.multi_turn.enable
    _check(_step(run), run)


def test_batch_validation_scores_with_the_reward_model_not_the_rule(tmp_path, checkpoints):
    """Validation on the batch rollout combines as training does: with the reward model on and
    reward.rule_weight auto (0), the rule function (here one that always fails) is not called."""
    run = _run(tmp_path, checkpoints, **{"reward.judge.enable": False, "reward.rule_weight": -1.0,
                                         "reward.custom_reward_function.name": "broken",
                                         "data.builtin_val_size": 4})
    trainer = RLTrainer(run)
    try:
        trainer.call0(HostWorker.start_rl, 1)
        m = trainer.validate()
    finally:
        trainer.close()
    rewards_ = [v for k, v in m.items() if k.startswith("val-core/") and "/reward/" in k]
    assert rewards_ and all(np.isfinite(v) for v in rewards_)
    assert any(k.startswith("val-aux/") and "/rm_score/" in k for k in m)
