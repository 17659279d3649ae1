"""rollout.quantization and rollout.kv_cache_dtype: their values, and the token-level TIS they
turn on by default (algorithm.rollout_correction.rollout_is='auto')."""
import logging
import os

import pytest

from jaxrl_llm.config import ConfigError, load_config

QUICKSTART = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "quickstart.py")
_RC = "algorithm.rollout_correction."


@pytest.mark.parametrize("quant", ["fp8", "int8"])
def test_quantized_rollout_turns_token_tis_on_by_default_and_logs_it(quant, caplog):
    with caplog.at_level(logging.INFO, logger="jaxrl_llm.config._load"):
        run = load_config(QUICKSTART, [f"rollout.quantization={quant}"])
    assert run.rollout.quantization == quant
    rc = run.algorithm.rollout_correction
    assert rc.rollout_is == "token" and rc.enabled and rc.rollout_is_threshold == 2.0
    assert f"rollout.quantization={quant}: algorithm.rollout_correction.rollout_is='token'" in caplog.text


def test_unquantized_rollout_keeps_rollout_correction_off():
    run = load_config(QUICKSTART)
    assert run.rollout.quantization == "none"
    assert run.algorithm.rollout_correction.rollout_is == "" and not run.algorithm.rollout_correction.enabled


@pytest.mark.parametrize("setting", ["", "sequence"])
def test_a_rollout_is_the_user_set_wins_over_the_quantization_default(setting):
    run = load_config(QUICKSTART, ["rollout.quantization=fp8", f"{_RC}rollout_is={setting}"])
    assert run.algorithm.rollout_correction.rollout_is == setting


def test_bypass_mode_leaves_tis_off_under_quantization_with_a_warning(caplog):
    """No old-log-prob pass to compare against: the default stays off (instead of a ConfigError)."""
    with caplog.at_level(logging.WARNING, logger="jaxrl_llm.config._load"):
        run = load_config(QUICKSTART, ["rollout.quantization=int8", "rollout.use_rollout_log_probs=True"])
    assert run.algorithm.rollout_correction.rollout_is == ""
    assert "the low-precision mismatch enters the PPO ratio" in caplog.text


def test_an_fp8_kv_cache_turns_token_tis_on_by_default_and_logs_it(caplog):
    with caplog.at_level(logging.INFO, logger="jaxrl_llm.config._load"):
        run = load_config(QUICKSTART, ["rollout.kv_cache_dtype=fp8"])
    assert run.rollout.kv_cache_dtype == "fp8" and run.rollout.quantization == "none"
    assert run.algorithm.rollout_correction.rollout_is == "token"
    assert "rollout.kv_cache_dtype=fp8: algorithm.rollout_correction.rollout_is='token'" in caplog.text
    both = load_config(QUICKSTART, ["rollout.kv_cache_dtype=fp8", "rollout.quantization=fp8"])
    assert both.algorithm.rollout_correction.rollout_is == "token"
    assert load_config(QUICKSTART).rollout.kv_cache_dtype == "auto"


@pytest.mark.parametrize("field, value, message", [
    ("rollout.quantization", "fp4", "rollout.quantization='fp4' is not one of ['none', 'fp8', 'int8']"),
    ("rollout.quantization", "FP8", "rollout.quantization='FP8' is not one of"),
    (_RC + "rollout_is", "tokens", "algorithm.rollout_correction.rollout_is='tokens'"),
    ("rollout.kv_cache_dtype", "fp16", "rollout.kv_cache_dtype='fp16' is not one of ['auto', 'fp8']"),
])
def test_bad_quantization_values_are_config_errors(field, value, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        load_config(QUICKSTART, [f"{field}={value}"])


def test_config_choices_are_the_engines_formats():
    from jaxrl_llm.config._load import ROLLOUT_QUANTIZATIONS
    from jaxrl_llm.models._quant import QUANTIZATIONS
    assert ROLLOUT_QUANTIZATIONS == QUANTIZATIONS
    from jaxrl_llm.config._load import KV_CACHE_DTYPES
    from jaxrl_llm.models import KV_CACHE_DTYPES as ENGINE_KV
    assert KV_CACHE_DTYPES == ENGINE_KV
