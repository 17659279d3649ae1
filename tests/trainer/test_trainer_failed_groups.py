"""The replay buffer's failed-group budget (`trainer.v1.sampler.max_failed_groups` /
`max_failed_fraction`): a group whose reward fails is evicted and its slot goes to a fed
prompt, so every step still trains `data.train_batch_size` groups and counts the evicted ones;
past the budget the step fails naming the field; the config refuses the budget where no
rollouter runs."""
import os

import numpy as np
import pytest

from jaxrl_llm.config import ConfigError, load_config
from jaxrl_llm.trainer import RLTrainer
from jaxrl_llm.workers import HostWorker
from trainer_helpers import QUICKSTART, REWARD_FN, tiny_overrides

_FAILING = os.path.join(os.path.dirname(__file__), "failing_rewards.py")
_COLOCATE = {"trainer.v1.trainer_mode": "colocate_async", "trainer.backend": "local",
             "trainer.export_hf": False, "trainer.val_before_train": False, "data.builtin_val_size": 0,
             "reward.custom_reward_function.path": _FAILING,
             "reward.custom_reward_function.name": "fails_on_multiples_of_three"}


def _trainer(tmp_path, **extra):
    return RLTrainer(load_config(f"{QUICKSTART}:tiny", tiny_overrides(tmp_path / "run", **{**_COLOCATE, **extra})))


def test_failed_groups_are_evicted_and_replaced_within_the_budget(tmp_path):
    trainer = _trainer(tmp_path, **{"trainer.v1.sampler.max_failed_groups": 8,
                                    "trainer.v1.sampler.max_failed_fraction": 1.0})
    size, n = trainer.config.data.train_batch_size, trainer.config.rollout.n
    taken, next_ = [], trainer.source.next

    def counting(step, round_=0):
        examples, gen, metrics = next_(step, round_)
        taken.append((len(examples), gen.rows))
        return examples, gen, metrics
    trainer.source.next = counting
    try:
        trainer.call0(HostWorker.start_rl, 2)
        steps = []
        for _ in range(2):
            steps.append(trainer.train_step())
            trainer.global_step += 1
        failed = trainer.group.workers[0]._rollouter.stats()["groups_failed"]
    finally:
        trainer.close()
    assert taken == [(size, size * n)] * 2  # a full batch each step
    assert sum(m["training/replay/failed_groups"] for m in steps) > 0  # evictions, counted per step
    assert failed >= sum(m["training/replay/failed_groups"] for m in steps)
    assert all(np.isfinite(m["actor/pg_loss"]) for m in steps)


def test_failed_groups_over_the_budget_fail_the_step_naming_the_field(tmp_path):
    trainer = _trainer(tmp_path, **{"trainer.v1.sampler.max_failed_groups": 1,
                                    "reward.custom_reward_function.path": REWARD_FN,
                                    "reward.custom_reward_function.name": "broken"})
    try:
        trainer.call0(HostWorker.start_rl, 1)
        with pytest.raises(Exception, match=r"trajectory groups failed .*trainer\.v1\.sampler\.max_failed_groups=1"):
            trainer.train_step()
    finally:
        trainer.close()


@pytest.mark.parametrize("extra, match", [
    ({"trainer.v1.sampler.max_failed_groups": -1}, r"trainer\.v1\.sampler\.max_failed_groups must be >= 0"),
    ({"trainer.v1.sampler.max_failed_fraction": 1.5}, r"trainer\.v1\.sampler\.max_failed_fraction must be in \[0, 1\]"),
    ({"trainer.v1.trainer_mode": "sync", "trainer.v1.sampler.max_failed_groups": 2},
     r"max_failed_groups=2: only the rollouter evicts .*trainer_mode='sync'"),
])
def test_failed_budget_config_errors(tmp_path, extra, match):
    with pytest.raises(ConfigError, match=match):
        load_config(f"{QUICKSTART}:tiny", tiny_overrides(tmp_path / "run", **{**_COLOCATE, **extra}))
