"""verl V1's trainer modes (`trainer.v1.*`): today's `async_training.*` and
`placement.one_step_off_policy` resolve onto them when the config loads, an alias and its V1
field set differently is an error naming both, verl's invariant on `parameter_sync_step`, and
which rollout source each mode runs."""
import pytest

from jaxrl_llm.config import ConfigError, load_config, validate
from trainer_helpers import QUICKSTART, tiny_overrides

_SEPARATE = {"mesh.fsdp": 4, "placement.mode": "separate", "placement.rollout_mesh.tensor": 4,
             "model.init.num_key_value_heads": 4, "data.train_batch_size": 4, "actor.ppo_mini_batch_size": 2}


def _load(tmp_path, **extra):
    return load_config(f"{QUICKSTART}:tiny,local", tiny_overrides(tmp_path / "run", **extra))


def test_defaults_are_the_synchronous_trainer(tmp_path):
    run = _load(tmp_path)
    assert run.trainer.v1.trainer_mode == "sync" and run.rollout_source == "sync"


@pytest.mark.parametrize("aliases, want, source", [
    ({"async_training.enable": True, "async_training.require_batches": 2},
     dict(trainer_mode="separate_async", num_warmup_batches=0.0, parameter_sync_step=2, max_off_policy_threshold=0),
     "buffer"),
    ({"async_training.enable": True, "async_training.require_batches": 2, "async_training.staleness_threshold": 1.5,
      "async_training.partial_rollout": True},
     dict(trainer_mode="separate_async", num_warmup_batches=1.5, parameter_sync_step=2, max_off_policy_threshold=2),
     "buffer"),
    ({"placement.one_step_off_policy": True},
     dict(trainer_mode="separate_async", num_warmup_batches=1.0, parameter_sync_step=0, max_off_policy_threshold=1),
     "one_step_off"),
    ({"trainer.v1.trainer_mode": "separate_async", "trainer.v1.separate_async.parameter_sync_step": 2,
      "trainer.v1.colocate_async.num_warmup_batches": 0.5, "trainer.v1.sampler.max_off_policy_threshold": "None"},
     dict(trainer_mode="separate_async", num_warmup_batches=0.5, parameter_sync_step=2, max_off_policy_threshold=-1),
     "buffer"),
])
def test_aliases_resolve_onto_the_v1_fields(tmp_path, aliases, want, source):
    run = _load(tmp_path, **_SEPARATE, **aliases)
    v1 = run.trainer.v1
    got = dict(trainer_mode=v1.trainer_mode, num_warmup_batches=v1.colocate_async.num_warmup_batches,
               parameter_sync_step=v1.separate_async.parameter_sync_step,
               max_off_policy_threshold=v1.sampler.max_off_policy_threshold)
    assert got == want
    assert run.rollout_source == source


def test_colocate_async_runs_the_rollouter_on_the_colocated_engine(tmp_path):
    run = _load(tmp_path, **{"trainer.v1.trainer_mode": "colocate_async",
                             "trainer.v1.colocate_async.num_warmup_batches": 0.5})
    assert run.placement.mode == "colocated" and run.rollout_source == "colocated_buffer"


def test_an_alias_and_its_v1_field_agreeing_is_accepted(tmp_path):
    run = _load(tmp_path, **_SEPARATE, **{"async_training.enable": True, "async_training.require_batches": 2,
                                          "trainer.v1.trainer_mode": "separate_async",
                                          "trainer.v1.separate_async.parameter_sync_step": 2})
    assert run.trainer.v1.separate_async.parameter_sync_step == 2


@pytest.mark.parametrize("extra, match", [
    ({"async_training.enable": True, "async_training.require_batches": 2, "async_training.staleness_threshold": 0.5,
      "trainer.v1.colocate_async.num_warmup_batches": 2.0},
     r"async_training.staleness_threshold=0.5 is an alias of trainer.v1.colocate_async.num_warmup_batches=0.5, "
     r"but trainer.v1.colocate_async.num_warmup_batches=2.0 is set too"),
    ({"async_training.enable": True, "async_training.require_batches": 2,
      "trainer.v1.trainer_mode": "colocate_async"},
     r"async_training.enable=True is an alias of trainer.v1.trainer_mode='separate_async', but "
     r"trainer.v1.trainer_mode='colocate_async'"),
    ({"placement.one_step_off_policy": True, "trainer.v1.sampler.max_off_policy_threshold": 3},
     r"placement.one_step_off_policy=True is an alias of trainer.v1.sampler.max_off_policy_threshold=1"),
    ({"async_training.enable": True, "async_training.require_batches": 2,
      "async_training.trigger_parameter_sync_step": 2}, r"trigger_parameter_sync_step=2 has no trainer.v1 equivalent"),
    # verl's invariant: train_batch_size = parameter_sync_step x ppo_mini_batch_size (4 = k x 2)
    ({"trainer.v1.trainer_mode": "separate_async", "trainer.v1.separate_async.parameter_sync_step": 3},
     r"parameter_sync_step=3 x actor.ppo_mini_batch_size=2 = 6 must equal data.train_batch_size=4.*"
     r"set parameter_sync_step=2"),
    ({"async_training.enable": True}, r"parameter_sync_step=1 x actor.ppo_mini_batch_size=2 = 2 must equal"),
    ({"trainer.v1.trainer_mode": "separate_async", "placement.mode": "colocated"},
     r"trainer_mode='separate_async' .* needs placement.mode='separate'"),
    ({"trainer.v1.trainer_mode": "both"}, r"trainer.v1.trainer_mode='both' is not one of"),
    ({"trainer.v1.trainer_mode": "colocate_async"},  # _SEPARATE's placement
     r"trainer_mode='colocate_async' runs the rollout on the training devices: it needs placement.mode='colocated'"),
    ({"trainer.v1.trainer_mode": "separate_async", "trainer.v1.sampler.max_off_policy_strategy": "keep"},
     r"max_off_policy_strategy='keep' is not one of \['drop', 'wait'\]"),
    ({"trainer.v1.trainer_mode": "separate_async", "trainer.v1.sampler.max_off_policy_threshold": -2},
     r"max_off_policy_threshold must be >= 0 \(model versions\) or None / -1"),
    ({"trainer.v1.trainer_mode": "separate_async", "algorithm.filter_groups.enable": True,
      "algorithm.filter_groups.metric": "seq_reward"},
     r"trainer_mode='separate_async' filters groups in the rollouter, which offers "
     r"algorithm.filter_groups.metric 'acc' or 'score', not 'seq_reward'"),
])
def test_config_errors_name_the_fields(tmp_path, extra, match):
    with pytest.raises(ConfigError, match=match):
        _load(tmp_path, **{**_SEPARATE, **extra})


def test_a_hand_built_config_with_an_unresolved_alias_is_refused(tmp_path):
    import dataclasses

    run = _load(tmp_path, **_SEPARATE)
    raw = dataclasses.replace(run, async_training=dataclasses.replace(run.async_training, enable=True))
    with pytest.raises(ConfigError, match="async_training.enable=True is an alias of trainer.v1.trainer_mode"):
        validate(raw)


@pytest.mark.parametrize("strategy,lag", [("drop", 1), ("wait", 2), ("wait", -1)])
def test_the_sampler_settings_reach_the_rollouter(tmp_path, monkeypatch, strategy, lag):
    """`sampler.max_off_policy_strategy` is the Rollouter's keyword; `max_off_policy_threshold`
    (the largest lag K, -1 = none) reaches it as the span verl counts, K + 1 versions (None)."""
    import types

    from jaxrl_llm import agent
    from jaxrl_llm.workers import HostWorker

    run = _load(tmp_path, **_SEPARATE, **{"trainer.v1.trainer_mode": "separate_async",
                                          "trainer.v1.sampler.max_off_policy_strategy": strategy,
                                          "trainer.v1.sampler.max_off_policy_threshold": lag})
    made = {}

    def fake_rollouter(runner, **kwargs):
        made.update(kwargs)
        return "rollouter"

    monkeypatch.setattr(agent, "Rollouter", fake_rollouter)
    host = types.SimpleNamespace(config=run, _rollouter=None, _agent_runner=lambda: "runner",
                                 server=types.SimpleNamespace(policy_version=3))
    assert HostWorker._async(host) == "rollouter"
    assert made["groups_per_sync"] == run.data.train_batch_size and made["version"] == 3
    assert made["max_off_policy_strategy"] == strategy
    assert made["max_off_policy_threshold"] == (None if lag < 0 else lag + 1)
