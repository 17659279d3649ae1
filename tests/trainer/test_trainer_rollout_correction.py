"""algorithm.rollout_correction in the trainer: IS weights reach the actor's policy loss, rejected
tokens leave the loss mask, and the config refuses combinations that cannot work."""
import math
import re

import pytest

from jaxrl_llm.config import ConfigError
from jaxrl_llm.trainer import RLTrainer
from jaxrl_llm.workers import HostWorker

_RC = "algorithm.rollout_correction."


def _first_step(run):
    trainer = RLTrainer(run)
    try:
        trainer.call0(HostWorker.start_rl, run.trainer.total_training_steps)
        return trainer.train_step()
    finally:
        trainer.close()


def test_is_weights_scale_the_policy_loss_and_veto_empties_the_mask(tiny_run):
    plain = _first_step(tiny_run())
    # On-policy step: the engine's and the trainer's log-probs agree, so every IS weight is about
    # 1; a threshold of 1e-3 truncates them all to exactly 1e-3, which scales the policy loss and
    # its gradient (the loss itself nearly cancels under GRPO: compare the gradient norm).
    clipped = _first_step(tiny_run(**{_RC + "rollout_is": "token", _RC + "rollout_is_threshold": 1e-3}))
    assert "rollout_corr/rollout_is_mean" not in plain
    assert clipped["rollout_corr/rollout_is_mean"] == pytest.approx(1.0, abs=1e-3)
    assert abs(clipped["rollout_corr/kl"]) < 1e-4
    assert clipped["rollout_corr/rollout_is_ratio_fraction_high"] == 1.0  # every ratio > 1e-3
    assert plain["actor/grad_norm"] > 1e-3
    assert clipped["actor/grad_norm"] == pytest.approx(plain["actor/grad_norm"] * 1e-3, rel=1e-3)
    assert "timing_s/rollout_correction" in clipped
    # A veto threshold above every ratio drops every sequence from the mask: nothing to learn from.
    vetoed = _first_step(tiny_run(**{_RC + "rollout_token_veto_threshold": 1e6}))
    assert vetoed["rollout_corr/rollout_is_veto_fraction"] == 1.0
    assert vetoed["actor/pg_loss"] == 0.0
    assert math.isfinite(vetoed["actor/grad_norm"]) and vetoed["actor/grad_norm"] == 0.0


@pytest.mark.parametrize("overrides, message", [
    ({"rollout_is": "row"}, "algorithm.rollout_correction.rollout_is='row'"),
    ({"rollout_rs": "tokens"}, "algorithm.rollout_correction.rollout_rs='tokens'"),
    ({"rollout_is": "token", "rollout_is_threshold": 0.0}, "rollout_is_threshold must be > 0"),
    ({"rollout_rs": "token", "rollout_rs_threshold": 2.0, "rollout_rs_threshold_lower": 3.0},
     "rollout_rs_threshold_lower=3.0 is above"),
    ({"rollout_token_veto_threshold": -1.0}, "rollout_token_veto_threshold must be >= 0"),
])
def test_bad_rollout_correction_settings_are_named(tiny_run, overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        tiny_run(**{_RC + k: v for k, v in overrides.items()})


def test_rollout_correction_needs_recomputed_old_log_probs(tiny_run):
    with pytest.raises(ConfigError, match="use_rollout_log_probs=True makes them the same"):
        tiny_run(**{_RC + "rollout_is": "token", "rollout.use_rollout_log_probs": True})
