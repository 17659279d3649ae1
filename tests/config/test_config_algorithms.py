"""Config fields of the algorithms: DAPO's filter_groups / overlong_buffer, ReMax, loss modes."""
import os

import pytest

from jaxrl_llm.config import ConfigError, load_config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
QUICKSTART = os.path.join(ROOT, "configs", "quickstart.py")


def test_dapo_config_turns_on_dynamic_sampling_and_the_overlong_penalty():
    run = load_config(os.path.join(ROOT, "configs", "dapo.py"))
    fg, ob = run.algorithm.filter_groups, run.reward.overlong_buffer
    assert fg.enable and fg.metric == "acc" and fg.max_num_gen_batches == 10
    assert ob.enable and 0 < ob.len <= run.data.max_response_length and ob.penalty_factor == 1.0


def test_verl_names_for_dapo_fields_are_accepted():
    run = load_config(QUICKSTART, ["algorithm.filter_groups.enable=True",
                                   "algorithm.filter_groups.metric=seq_final_reward",
                                   "algorithm.filter_groups.max_num_gen_batches=0",
                                   "reward.overlong_buffer.enable=True", "reward.overlong_buffer.len=4",
                                   "reward.overlong_buffer.penalty_factor=0.5"])
    assert run.algorithm.filter_groups.metric == "seq_final_reward"
    assert run.reward.overlong_buffer.len == 4


@pytest.mark.parametrize("overrides, match", [
    (["algorithm.filter_groups.metric=accuracy"], r"filter_groups\.metric"),
    (["algorithm.filter_groups.enable=True", "rollout.n=1"], r"rollout\.n >= 2"),
    (["algorithm.filter_groups.enable=True", "algorithm.filter_groups.metric=seq_final_reward",
      "algorithm.use_kl_in_reward=True"], "seq_reward"),
    (["algorithm.filter_groups.max_num_gen_batches=-1"], "max_num_gen_batches"),
    (["reward.overlong_buffer.enable=True", "reward.overlong_buffer.len=0"], r"overlong_buffer\.len"),
    (["reward.overlong_buffer.enable=True", "reward.overlong_buffer.len=9"], r"max_response_length=8"),
])
def test_bad_dapo_settings_name_the_field(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_config(QUICKSTART, overrides)


def test_token_sum_loss_agg_mode_is_accepted():
    assert load_config(QUICKSTART, ["actor.loss_agg_mode=token-sum"]).actor.loss_agg_mode == "token-sum"


def test_config_choices_match_the_algorithm_registries():
    # a name the config accepts must have an implementation, and every implementation a name
    from jaxrl_llm import algos
    from jaxrl_llm.config import _load
    assert set(_load.ADV_ESTIMATORS) == set(algos.ADV_ESTIMATORS)
    assert set(_load.POLICY_LOSSES) == set(algos.POLICY_LOSSES)
    assert set(_load.LOSS_AGG_MODES) == set(algos.LOSS_AGG_MODES)
    assert set(_load.KL_PENALTIES) == set(algos.KL_PENALTIES)
