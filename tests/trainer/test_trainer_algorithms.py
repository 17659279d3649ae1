"""Every advantage estimator and policy loss the config accepts runs a trainer step; DAPO's group
filter and overlong penalty act on the trainer's batch.

One started local trainer (tiny quickstart) is shared by the whole module, so the engine and
the forward passes compile once: estimators and the DAPO options are controller-side settings
(the test swaps the trainer's config), a policy loss is the actor's (the test rebuilds the actor
role with it; only its update compiles again), and `gae` gets a critic role built next to it.
"""
import dataclasses
import math

import numpy as np
import pytest

import rollout
from jaxrl_llm.config import load_config
from jaxrl_llm.config._load import ADV_ESTIMATORS, POLICY_LOSSES
from jaxrl_llm.trainer import RLTrainer
from jaxrl_llm.workers._common import build_model
from jaxrl_llm.workers._roles import ActorWorker, CriticWorker
from jaxrl_llm.workers import HostWorker
from trainer_helpers import QUICKSTART, tiny_overrides

REQUIRED = ["actor/pg_loss", "actor/grad_norm", "critic/score/mean", "critic/advantages/mean",
            "critic/advantages/max", "response_length/mean"]


@pytest.fixture(scope="module")
def started(tmp_path_factory):
    run = load_config(f"{QUICKSTART}:tiny,local", tiny_overrides(tmp_path_factory.mktemp("algos") / "run"))
    trainer = RLTrainer(run)
    trainer.call0(HostWorker.start_rl, run.trainer.total_training_steps)
    trainer.base = run
    yield trainer
    trainer.close()


def _configure(trainer, **sections):
    """The base config with `sections` (name -> {field: value}) replaced."""
    base = trainer.base
    trainer.config = dataclasses.replace(base, **{
        name: dataclasses.replace(getattr(base, name), **fields) for name, fields in sections.items()})
    return trainer.config


def _host(trainer):
    return trainer.group.workers[0]  # the local backend's in-process HostWorker


def _assert_finite(metrics):
    for key in REQUIRED:
        assert key in metrics and math.isfinite(metrics[key]), (key, metrics.get(key))


@pytest.mark.parametrize("estimator", ADV_ESTIMATORS)
def test_one_trainer_step_with_every_estimator(started, estimator):
    run = _configure(started, algorithm={"adv_estimator": estimator})
    host = _host(started)
    if run.use_critic:  # gae: the value model the trainer would have built for this config
        host.critic = CriticWorker(build_model(run.model, vocab_size=started.tokenizer.vocab_size,
                                               mesh=host.mesh, value_head=True),
                                   run.critic, mesh=host.mesh, total_steps=run.trainer.total_training_steps)
    try:
        metrics = started.train_step()
    finally:
        host.critic = None
    _assert_finite(metrics)
    if estimator == "remax":  # the greedy baseline rollout ran
        assert metrics["timing_s/gen_max"] > 0
    if estimator == "gae":
        assert math.isfinite(metrics["critic/vf_loss"])


def test_remax_baseline_is_the_reward_of_each_prompts_greedy_response(started):
    _configure(started, algorithm={"adv_estimator": "remax"})
    examples, batch = started._train_batch({}, {})
    greedy = started.call0(HostWorker.generate, [e.prompt_ids for e in examples], n=1, seed=0,
                           max_new_tokens=started.base.data.max_response_length,
                           sampling=rollout.SamplingParams(temperature=0.0))
    texts = [started.tokenizer.decode(r[:m.sum()].tolist())
             for r, m in zip(greedy.responses, greedy.response_mask)]
    parity = np.array([len(t) % 2 for t in texts], np.float32)  # the fixture's length-parity reward
    np.testing.assert_array_equal(batch["reward_baselines"], np.repeat(parity, started.base.rollout.n))


@pytest.mark.parametrize("loss", POLICY_LOSSES)
def test_one_trainer_step_with_every_policy_loss(started, loss):
    run = _configure(started, actor={"policy_loss": loss})
    host = _host(started)
    host.actor = ActorWorker(host.actor.model(), run.actor, mesh=host.mesh,
                             total_steps=run.trainer.total_training_steps, temperature=run.rollout.temperature)
    metrics = started.train_step()
    _assert_finite(metrics)
    assert metrics["actor/grad_norm"] > 0 or metrics["critic/advantages/max"] == 0


def test_filter_groups_fills_the_batch_with_groups_whose_reward_varies(started):
    _configure(started, algorithm={"filter_groups": dataclasses.replace(
        started.base.algorithm.filter_groups, enable=True, metric="seq_reward")})
    metrics = {}
    examples, batch = started._train_batch({}, metrics)
    size, n = started.base.data.train_batch_size, started.base.rollout.n
    assert len(examples) == size and batch["responses"].shape[0] == size * n
    seq = batch["token_level_scores"].sum(-1).reshape(size, n)
    assert (seq.max(1) != seq.min(1)).all()  # every kept group has a reward spread
    assert len(np.unique(batch["group_ids"])) == size  # groups of different rounds stay apart
    rounds = metrics["train/num_gen_batches"]
    assert metrics["filter_groups/kept_groups"] >= size
    assert metrics["filter_groups/kept_groups"] + metrics["filter_groups/filtered_groups"] == rounds * size
    _assert_finite(started.train_step())


def test_filter_groups_stops_after_max_num_gen_batches(started, monkeypatch):
    _configure(started, algorithm={"filter_groups": dataclasses.replace(
        started.base.algorithm.filter_groups, enable=True, metric="score", max_num_gen_batches=2)})
    calls = []

    def constant(sources, texts, truths, infos):  # every response scores the same: no group kept
        calls.append(len(texts))
        return np.ones(len(texts), np.float32), {}, {}

    monkeypatch.setattr(started.reward, "score_batch", constant)
    with pytest.raises(RuntimeError, match="2 generation rounds kept 0 .*max_num_gen_batches"):
        started._train_batch({}, {})
    assert len(calls) == 2


def test_overlong_buffer_subtracts_the_linear_length_penalty(started):
    _configure(started)
    data_state = started.loader.get_state()
    _, plain = started._train_batch({}, {})
    started.loader.set_state(data_state)  # the same prompts, step and round: the same responses
    length_budget = started.base.data.max_response_length
    metrics = {}
    _configure(started, reward={"overlong_buffer": dataclasses.replace(
        started.base.reward.overlong_buffer, enable=True, len=length_budget, penalty_factor=0.5)})
    _, penalised = started._train_batch({}, metrics)
    np.testing.assert_array_equal(penalised["responses"], plain["responses"])
    lengths = plain["response_mask"].sum(-1)
    # the penalty starts at max_response_length - len = 0 tokens: -0.5 * length / len
    expected = plain["token_level_scores"].sum(-1) - 0.5 * lengths / length_budget
    np.testing.assert_allclose(penalised["token_level_scores"].sum(-1), expected, rtol=1e-6, atol=1e-6)
    assert metrics["reward_extra/overlong/mean"] == float((lengths > 0).mean())
