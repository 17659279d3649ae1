"""Every shipped config loads and validates; bad overrides fail naming the field."""
import glob
import json
import os

import pytest

from jaxrl_llm.config import ConfigError, RunConfig, load_config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
CONFIGS = sorted(glob.glob(os.path.join(ROOT, "configs", "*.py")))


def test_configs_directory_is_not_empty():
    assert len(CONFIGS) >= 4


@pytest.mark.parametrize("path", CONFIGS, ids=os.path.basename)
def test_every_config_file_loads_and_validates(path):
    run = load_config(path)
    assert isinstance(run, RunConfig)
    assert run.data.train_batch_size % run.actor.ppo_mini_batch_size == 0


@pytest.mark.parametrize("variant", ["local", "tiny", "tiny,local"])
def test_quickstart_variants_load(variant):
    run = load_config(os.path.join(ROOT, "configs/quickstart.py") + f":{variant}")
    assert run.trainer.backend == ("local" if "local" in variant else "ray")


@pytest.mark.parametrize("variant", ["cpu", "fp32", "tools", "tools,cpu"])
def test_smollm2_gym_variants_load(variant):
    run = load_config(os.path.join(ROOT, "configs/grpo_smollm2_gym.py") + f":{variant}")
    assert run.rollout.multi_turn.enable == ("tools" in variant)
    assert run.model.dtype == ("float32" if variant == "fp32" else "bfloat16")
    if "tools" in variant:  # the calculator is described in a system message; runs stay apart
        assert os.path.exists(run.rollout.multi_turn.tool_config_path)
        assert "<tool_call>" in json.loads(run.data.builtin_task_config)["system_prompt"]
    assert run.trainer.default_local_dir == "runs/grpo_smollm2_gym" + "".join(
        f"_{v}" for v in ("tools", "fp32", "cpu") if v in variant)
    with pytest.raises(Exception, match="unknown variant"):
        load_config(os.path.join(ROOT, "configs/grpo_smollm2_gym.py") + ":tool")


@pytest.mark.parametrize("variant", ["tiny", "tiny,local"])
def test_dapo_tiny_is_dapo_on_cpu_with_nothing_to_download(variant):
    full, run = load_config(os.path.join(ROOT, "configs/dapo.py")), \
        load_config(os.path.join(ROOT, "configs/dapo.py") + f":{variant}")
    assert run.trainer.backend == ("local" if "local" in variant else "ray")
    # no model or tokenizer to fetch, data generated into its own run folder
    assert run.model.path == "" and run.model.tokenizer == "char" and run.data.builtin_task
    assert run.trainer.default_local_dir == "runs/dapo-tiny"
    assert all(f.startswith("runs/dapo-tiny/") for f in run.data.train_files + run.data.val_files)
    assert run.model.init.hidden_size <= 32 and run.trainer.total_training_steps <= 2
    # the algorithm is the full config's
    for section, fields in [("actor", ("clip_ratio_low", "clip_ratio_high", "clip_ratio_c", "loss_agg_mode",
                                       "use_kl_loss")),
                            ("algorithm", ("adv_estimator", "use_kl_in_reward", "filter_groups"))]:
        for f in fields:
            assert getattr(getattr(run, section), f) == getattr(getattr(full, section), f), f
    assert run.reward.overlong_buffer.enable and run.reward.overlong_buffer.penalty_factor == 1.0
    with pytest.raises(Exception, match="unknown dapo variant"):
        load_config(os.path.join(ROOT, "configs/dapo.py") + ":tyni")


def test_override_changes_the_typed_value():
    run = load_config(os.path.join(ROOT, "configs/quickstart.py"),
                      ["actor.optim.lr=0.5", "rollout.n=4", "trainer.backend=local"])
    assert run.actor.optim.lr == 0.5 and run.rollout.n == 4 and run.trainer.backend == "local"


def test_misspelt_override_names_the_field():
    with pytest.raises(ConfigError, match=r"actor\.optim\.lrr.*did you mean 'lr'"):
        load_config(os.path.join(ROOT, "configs/quickstart.py"), ["actor.optim.lrr=1e-3"])


def test_misspelt_section_names_the_field():
    with pytest.raises(ConfigError, match=r"unknown config field 'actr\.ppo_epochs'"):
        load_config(os.path.join(ROOT, "configs/quickstart.py"), ["actr.ppo_epochs=2"])


def test_bad_value_type_is_reported():
    with pytest.raises(ConfigError, match="actor.optim.lr"):
        load_config(os.path.join(ROOT, "configs/quickstart.py"), ["actor.optim.lr=fast"])


@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
@pytest.mark.parametrize("field", ["actor.optim.lr", "actor.optim.clip_grad", "reward.timeout_s"])
def test_non_finite_numbers_are_rejected(field, value):
    with pytest.raises(ConfigError, match=rf"{field.replace('.', '[.]')} must be a finite number"):
        load_config(os.path.join(ROOT, "configs/quickstart.py"), [f"{field}={value}"])


@pytest.mark.parametrize("overrides, field", [
    (["actor.ppo_micro_batch_size_per_device=0"], "actor.ppo_micro_batch_size_per_device"),
    (["sft.batch_size=0"], "sft.batch_size"),
    (["trainer.max_nonfinite_steps=0"], "trainer.max_nonfinite_steps"),
    (["reward.max_error_fraction=1.5"], "reward.max_error_fraction"),
    (["data.train_batch_size=30"], "actor.ppo_mini_batch_size"),
    (["rollout.n=1"], "rollout.n"),
    (["algorithm.adv_estimator=grpoo"], "algorithm.adv_estimator"),
    (["actor.loss_agg_mode=mean"], "actor.loss_agg_mode"),
    (["rollout.top_p=0.0"], "rollout.top_p"),
    (["trainer.backend=slurm"], "trainer.backend"),
    (["rollout.multi_turn.default_agent_loop=openai_agent"], "rollout.multi_turn.openai_agent_path"),
])
def test_impossible_combination_names_the_field(overrides, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        load_config(os.path.join(ROOT, "configs/quickstart.py"), overrides)


def test_config_choices_are_the_algorithm_registries():
    # the config module keeps its own copies (it does not import JAX code); they must not drift
    from jaxrl_llm import algos
    from jaxrl_llm.algos import _rollout_correction
    from jaxrl_llm.config import _load
    assert set(_load.ADV_ESTIMATORS) == set(algos.ADV_ESTIMATORS)
    assert set(_load.POLICY_LOSSES) == set(algos.POLICY_LOSSES)
    assert set(_load.LOSS_AGG_MODES) == set(algos.LOSS_AGG_MODES)
    assert set(_load.KL_PENALTIES) == set(algos.KL_PENALTIES)
    assert _load.ROLLOUT_IS_LEVELS == _rollout_correction.ROLLOUT_IS_LEVELS
    assert _load.ROLLOUT_RS_LEVELS == _rollout_correction.ROLLOUT_RS_LEVELS
