"""Load a config file, apply `--config.a.b=v` overrides, validate, convert to `RunConfig`.

The command line goes through `ml_collections.config_flags` exactly as users type it
(`--config=configs/x.py:variant --config.actor.optim.lr=1e-6`); tests call `load_config` with
the same strings. Validation happens here, once; library code never sees the ConfigDict.
"""
from __future__ import annotations

import dataclasses
import difflib
import logging
import math
import os
import types
import typing
from collections.abc import Mapping, Sequence
from typing import Any

from absl import flags
from ml_collections import ConfigDict, config_flags

from jaxrl_llm.sandbox import SANDBOX_KINDS

from ._schema import OLD_LOG_PROB_PASSES, ROUTER_REPLAY_MODES, RunConfig

_log = logging.getLogger(__name__)

ADV_ESTIMATORS = ("gae", "grpo", "grpo_passk", "rloo", "opo", "reinforce_plus_plus",
                  "reinforce_plus_plus_baseline", "remax", "gpg")
POLICY_LOSSES = ("vanilla", "gspo", "gpg", "cispo", "geo_mean", "sapo")
LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm",
                  "token-sum")
KL_PENALTIES = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3",
                "kl+", "k1+", "abs+", "low_var_kl+", "k3+")  # "+": k2's gradient (straight-through)
ROLLOUT_IS_LEVELS = ("token", "sequence")
ROLLOUT_QUANTIZATIONS = ("none", "fp8", "int8")  # jaxrl_llm.models._quant.QUANTIZATIONS
KV_CACHE_DTYPES = ("auto", "fp8")  # jaxrl_llm.models.KV_CACHE_DTYPES
ROLLOUT_RS_LEVELS = ("token", "sequence", "geometric")
TOOL_CALL_FORMATS = ("hermes", "llama3_json", "qwen3_coder")
BUILTIN_TASKS = ("", "arithmetic", "arithmetic_tools", "countdown")
FILTER_METRICS = ("acc", "score", "seq_reward", "seq_final_reward")


class ConfigError(ValueError):
    """A config that cannot run; the message names the field."""


def load_config(spec: str, overrides: Sequence[str] | Mapping[str, Any] = ()) -> RunConfig:
    """`spec` is `path/to/config.py` or `path/to/config.py:arg`; overrides are `a.b=v` strings."""
    return to_run_config(load_config_dict(spec, overrides))


def load_config_dict(spec: str, overrides: Sequence[str] | Mapping[str, Any] = ()) -> ConfigDict:
    if isinstance(overrides, Mapping):
        overrides = [f"{k}={v}" for k, v in overrides.items()]
    overrides = [o.removeprefix("--").removeprefix("config.") for o in overrides]
    # no bound on a token's age: None in a config file, None or -1 on the command line
    overrides = [f"{_NO_BOUND}=-1" if o in (f"{_NO_BOUND}=None", f"{_NO_BOUND}=null") else o for o in overrides]
    last = {o.split("=", 1)[0]: i for i, o in enumerate(overrides)}  # a repeated field: the last wins
    overrides = [o for i, o in enumerate(overrides) if last[o.split("=", 1)[0]] == i]
    if overrides:  # name a misspelt field ourselves; absl's message does not say which flag
        base = _parse(spec, [])
        for o in overrides:
            _check_path(base, o.split("=", 1)[0])
    return _parse(spec, overrides)


_NO_BOUND = "trainer.v1.sampler.max_off_policy_threshold"


def _parse(spec: str, overrides: list[str]) -> ConfigDict:
    argv = ["jaxrl_llm", f"--config={spec}"] + [f"--config.{o}" for o in overrides]
    fv = flags.FlagValues()
    # config_flags registers one flag per override it finds in sys_argv, so hand it ours.
    holder = config_flags.DEFINE_config_file("config", flag_values=fv, lock_config=True, sys_argv=argv)
    try:
        fv(argv)
    except (flags.Error, AttributeError, KeyError) as e:
        raise ConfigError(f"bad config {spec!r} or override value: {str(e).strip()}") from None
    return holder.value


def _check_path(cfg: ConfigDict, path: str) -> None:
    node = cfg
    for i, part in enumerate(path.split(".")):
        if not isinstance(node, ConfigDict) or part not in node:
            where = ".".join(path.split(".")[:i]) or "config"
            known = sorted(node.keys()) if isinstance(node, ConfigDict) else []
            near = difflib.get_close_matches(part, known, n=1)
            hint = f"; did you mean {near[0]!r}?" if near else f"; {where} has {known}"
            raise ConfigError(f"unknown config field {path!r}{hint}")
        node = node[part]


def _strip_optional(tp):
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return args[0] if len(args) == 1 else tp
    return tp


def _convert(tp, value, path: str):
    tp = _strip_optional(tp)
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, path)
    origin = typing.get_origin(tp)
    if origin is tuple:
        if isinstance(value, str):
            value = [v for v in value.split(",") if v] if value else []
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{path} must be a list, got {type(value).__name__} {value!r}")
        args = typing.get_args(tp)
        if args[-1] is Ellipsis and args[0] is str:  # `--config.x=a.parquet,b.parquet`
            value = [part for v in value for part in (v.split(",") if isinstance(v, str) else [v]) if part != ""]
        item_t = args[0]
        if len(args) == 2 and args[1] is not Ellipsis and len(value) != 2:
            raise ConfigError(f"{path} must have 2 items, got {value!r}")
        return tuple(_convert(item_t if args[-1] is Ellipsis else args[i], v, f"{path}[{i}]")
                     for i, v in enumerate(value))
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{path} must be true/false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{path} must be an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{path} must be a number, got {value!r}")
        if not math.isfinite(value):
            raise ConfigError(f"{path} must be a finite number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{path} must be a string, got {value!r}")
        return value
    return value


def _build(cls, value, path: str):
    if isinstance(value, ConfigDict):
        value = value.to_dict()
    if not isinstance(value, Mapping):
        raise ConfigError(f"{path or 'config'} must be a section (dict), got {value!r}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(value) - set(names))
    if unknown:
        raise ConfigError(f"unknown config field(s) {[_join(path, u) for u in unknown]}; "
                          f"{path or 'config'} has {names}")
    missing = [n for n in names if n not in value]
    if missing:
        raise ConfigError(f"missing config field(s) {[_join(path, m) for m in missing]}")
    return cls(**{n: _convert(hints[n], value[n], _join(path, n)) for n in names})


def _join(path, name):
    return f"{path}.{name}" if path else name


def to_run_config(cfg: ConfigDict | Mapping[str, Any]) -> RunConfig:
    run = _build(RunConfig, resolve_aliases(cfg), "")
    validate(run)
    return run


TRAINER_MODES = ("sync", "colocate_async", "separate_async")
OFF_POLICY_STRATEGIES = ("drop", "wait")


def resolve_aliases(cfg: ConfigDict | Mapping[str, Any]) -> dict:
    """The config as a dict with today's names mapped onto verl V1's `trainer.v1` fields, so
    that only those drive the run: `async_training.enable` -> `trainer_mode='separate_async'`,
    `staleness_threshold` s -> `colocate_async.num_warmup_batches=s` and
    `sampler.max_off_policy_threshold=ceil(s)`, `require_batches` ->
    `separate_async.parameter_sync_step`; `placement.one_step_off_policy` ->
    `separate_async` with `num_warmup_batches=1`, `max_off_policy_threshold=1`. A V1 field left
    at its default takes the alias's value; one set to another value is a ConfigError naming
    both. (A section missing here is reported by the build that follows.)

    verl's `algorithm.rollout_correction.bypass_mode` is an alias of
    `rollout.use_rollout_log_probs` (the field the trainer reads): either set makes both True,
    so the loaded config says the same under both names.

    `algorithm.rollout_correction.rollout_is='auto'` (the default) becomes 'token' (truncated
    importance sampling per token) when `rollout.quantization` is fp8/int8 or
    `rollout.kv_cache_dtype` is fp8, and the old-log-prob
    pass runs (no bypass), else '' (off); a value the user set is kept."""
    d = cfg.to_dict() if isinstance(cfg, ConfigDict) else _plain_dict(cfg)
    _resolve_bypass_mode(d)
    _resolve_rollout_is(d)
    v1 = d.get("trainer", {}).get("v1")
    if not isinstance(v1, dict) or not all(isinstance(v1.get(k), dict) for k in
                                           ("colocate_async", "separate_async", "sampler")):
        return d
    from ._defaults import base_config
    default = base_config().trainer.v1.to_dict()
    if v1["sampler"].get("max_off_policy_threshold") is None:  # None and -1 both mean no bound
        v1["sampler"]["max_off_policy_threshold"] = -1

    def alias(name: str, value, path: str, v1_value, alias_default=None) -> None:
        section, _, key = path.rpartition(".")
        node, base = (v1[section], default[section]) if section else (v1, default)
        if node.get(key, base[key]) == base[key] or node.get(key) == v1_value:
            node[key] = v1_value
        elif value == alias_default:  # the alias left at its default: the V1 field wins
            return
        else:
            raise ConfigError(f"{name}={value!r} is an alias of trainer.v1.{path}={v1_value!r}, but "
                              f"trainer.v1.{path}={node[key]!r} is set too: set only trainer.v1.{path}")

    a, p = d.get("async_training", {}), d.get("placement", {})
    if a.get("enable"):
        for name, zero in (("staleness_threshold", True), ("trigger_parameter_sync_step", False),
                           ("require_batches", False)):
            if isinstance(a.get(name), (int, float)):
                _positive(a[name], f"async_training.{name}", allow_zero=zero)
        s = a.get("staleness_threshold", 0.0)
        alias("async_training.enable", True, "trainer_mode", "separate_async")
        alias("async_training.staleness_threshold", s, "colocate_async.num_warmup_batches", float(s), 0.0)
        ahead = v1["colocate_async"]["num_warmup_batches"]  # s, or the V1 field set instead
        alias("async_training.staleness_threshold", s, "sampler.max_off_policy_threshold",
              math.ceil(ahead - 1e-9) if isinstance(ahead, (int, float)) and ahead >= 0 else ahead, 0.0)
        if a.get("trigger_parameter_sync_step", 1) != 1:
            raise ConfigError(
                f"async_training.trigger_parameter_sync_step={a['trigger_parameter_sync_step']} has no "
                "trainer.v1 equivalent (a V1 step is one sync interval): set it to 1 and make "
                "data.train_batch_size the groups trained between two syncs "
                "(trainer.v1.separate_async.parameter_sync_step x actor.ppo_mini_batch_size)")
        alias("async_training.require_batches", a.get("require_batches"), "separate_async.parameter_sync_step",
              a.get("require_batches"), 1)
    if p.get("one_step_off_policy"):
        alias("placement.one_step_off_policy", True, "trainer_mode", "separate_async")
        alias("placement.one_step_off_policy", True, "colocate_async.num_warmup_batches", 1.0)
        alias("placement.one_step_off_policy", True, "sampler.max_off_policy_threshold", 1)
    return d


def _resolve_bypass_mode(d: dict) -> None:
    """`algorithm.rollout_correction.bypass_mode` <-> `rollout.use_rollout_log_probs`: both
    default False, so a True on either side is the setting and both become True."""
    rc = d.get("algorithm", {}).get("rollout_correction")
    r = d.get("rollout")
    if isinstance(rc, dict) and isinstance(r, dict) and (rc.get("bypass_mode") or r.get("use_rollout_log_probs")):
        rc["bypass_mode"] = r["use_rollout_log_probs"] = True


def _resolve_rollout_is(d: dict) -> None:
    """`rollout_is='auto'` -> 'token' under a low-precision rollout (quantized weights or an fp8 KV
    cache: the engine's policy then differs from the trainer's by the rounding; TIS corrects it),
    else '' (logged when on)."""
    rc, r = d.get("algorithm", {}).get("rollout_correction"), d.get("rollout")
    if not isinstance(rc, dict) or not isinstance(r, dict) or rc.get("rollout_is") != "auto":
        return
    quant = r.get("quantization", "none")
    if quant not in ROLLOUT_QUANTIZATIONS or r.get("kv_cache_dtype", "auto") not in KV_CACHE_DTYPES:
        rc["rollout_is"] = ""  # validate() names the field
        return
    low = [f"rollout.quantization={quant}"] if quant != "none" else []
    low += ["rollout.kv_cache_dtype=fp8"] if r.get("kv_cache_dtype", "auto") == "fp8" else []
    what = " and ".join(low)
    on = bool(low) and not r.get("use_rollout_log_probs")
    rc["rollout_is"] = "token" if on else ""
    if on:
        _log.info("%s: algorithm.rollout_correction.rollout_is='token' (truncated IS, threshold %s) on by "
                  "default; set rollout_is='' to turn it off", what, rc.get("rollout_is_threshold"))
    elif low:
        _log.warning("%s with rollout.use_rollout_log_probs=True: no rollout correction (bypass mode); "
                     "the low-precision mismatch enters the PPO ratio", what)


def _plain_dict(x):
    if isinstance(x, Mapping):
        return {k: _plain_dict(v) for k, v in x.items()}
    return x


def _choice(value, choices, field):
    if value not in choices:
        raise ConfigError(f"{field}={value!r} is not one of {list(choices)}")


def _positive(value, field, allow_zero=False):
    if value < 0 or (value == 0 and not allow_zero):
        raise ConfigError(f"{field} must be {'>= 0' if allow_zero else '> 0'}, got {value}")


def validate(c: RunConfig) -> None:
    """Cross-field checks: each error names the field(s) and the fix."""
    _choice(c.trainer.backend, ("ray", "local"), "trainer.backend")
    _choice(c.placement.mode, ("colocated", "separate"), "placement.mode")
    if c.mesh.context < 1:
        raise ConfigError(f"mesh.context must be >= 1 (1 = no context parallelism), got {c.mesh.context}")
    if c.placement.rollout_mesh.context != 1:
        raise ConfigError(f"placement.rollout_mesh.context must be 1 (the rollout engine has no "
                          f"context-parallel path), got {c.placement.rollout_mesh.context}")
    if c.placement.mode == "separate":
        rm = c.placement.rollout_mesh
        if min(rm.data, rm.fsdp, rm.tensor) < 1:
            raise ConfigError("placement.rollout_mesh needs explicit sizes (>= 1, no -1) when "
                              "placement.mode='separate'")
    _check_trainer_mode(c)
    _choice(c.algorithm.adv_estimator, ADV_ESTIMATORS, "algorithm.adv_estimator")
    _choice(c.actor.policy_loss, POLICY_LOSSES, "actor.policy_loss")
    _choice(c.actor.loss_agg_mode, LOSS_AGG_MODES, "actor.loss_agg_mode")
    _choice(c.critic.loss_agg_mode, LOSS_AGG_MODES, "critic.loss_agg_mode")
    _choice(c.algorithm.kl_penalty, KL_PENALTIES, "algorithm.kl_penalty")
    _choice(c.actor.kl_loss_type, KL_PENALTIES, "actor.kl_loss_type")
    _choice(c.algorithm.kl_ctrl.type, ("fixed", "adaptive"), "algorithm.kl_ctrl.type")
    _choice(c.data.truncation, ("error", "left", "right"), "data.truncation")
    if c.data.builtin_task.startswith("reasoning_gym:"):
        from jaxrl_llm.data.tasks._reasoning_gym import dataset_name, parse_options
        try:  # the name's form and the options' JSON; the dataset itself is looked up at data time
            dataset_name(c.data.builtin_task)
            parse_options(c.data.builtin_task_config)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    else:
        _choice(c.data.builtin_task, BUILTIN_TASKS + ("reasoning_gym:<dataset>",), "data.builtin_task")
        if c.data.builtin_task_config:
            raise ConfigError("data.builtin_task_config is for data.builtin_task='reasoning_gym:<dataset>'"
                              f" only; builtin_task={c.data.builtin_task!r}")
    _choice(c.actor.optim.lr_schedule, ("constant", "cosine"), "actor.optim.lr_schedule")
    _choice(c.critic.optim.lr_schedule, ("constant", "cosine"), "critic.optim.lr_schedule")
    _choice(c.model.dtype, ("float32", "bfloat16"), "model.dtype")
    _choice(c.model.param_dtype, ("float32", "bfloat16"), "model.param_dtype")
    _choice(c.model.train_attention, ("auto", "xla", "cudnn", "rolled", "splash"), "model.train_attention")
    _choice(c.model.decode_attention, ("auto", "einsum", "reduce", "cudnn", "pallas", "triton"),
            "model.decode_attention")
    _choice(c.rollout.dtype, ("", "float32", "bfloat16"), "rollout.dtype")
    _choice(c.rollout.partial_rollout_kv, ("recompute", "keep"), "rollout.partial_rollout_kv")
    _choice(c.rollout.quantization, ROLLOUT_QUANTIZATIONS, "rollout.quantization")
    _choice(c.rollout.kv_cache_dtype, KV_CACHE_DTYPES, "rollout.kv_cache_dtype")
    for name in ("max_prompt_length", "max_response_length", "train_batch_size", "val_batch_size"):
        _positive(getattr(c.data, name), f"data.{name}")
    _positive(c.rollout.n, "rollout.n")
    _positive(c.rollout.max_concurrent_decodes, "rollout.max_concurrent_decodes")
    _positive(c.rollout.steps_per_sync, "rollout.steps_per_sync")
    _positive(c.rollout.replicas_per_host, "rollout.replicas_per_host")
    _positive(c.rollout.max_inflight_per_replica, "rollout.max_inflight_per_replica", allow_zero=True)
    k = c.rollout.replicas_per_host
    if k > 1 and c.rollout.max_concurrent_decodes % k:
        raise ConfigError(f"rollout.max_concurrent_decodes={c.rollout.max_concurrent_decodes} must be a multiple "
                          f"of rollout.replicas_per_host={k}: a host's decode slots are split evenly among its replicas")
    if k > 1 and not (c.rollout.multi_turn.enable or c.rollout_source in ("buffer", "colocated_buffer")):
        raise ConfigError(f"rollout.replicas_per_host={k} needs the request-level server that the router "
                          "balances over: set rollout.multi_turn.enable=True (agent loops, e.g. "
                          "single_turn_agent) or an async trainer.v1.trainer_mode (colocate_async, "
                          "separate_async with the rollouter); the batch rollout runs one engine per host")
    _choice(c.rollout.replica_backend, ("local", "process"), "rollout.replica_backend")
    _positive(c.rollout.replica_max_restarts, "rollout.replica_max_restarts", allow_zero=True)
    if not math.isfinite(c.rollout.replica_restart_backoff_s):
        raise ConfigError(f"rollout.replica_restart_backoff_s must be a finite number of seconds, got "
                          f"{c.rollout.replica_restart_backoff_s}")
    _positive(c.rollout.replica_restart_backoff_s, "rollout.replica_restart_backoff_s", allow_zero=True)
    if c.rollout.replica_backend == "process" and not (
            c.rollout.multi_turn.enable or c.rollout_source in ("buffer", "colocated_buffer")):
        raise ConfigError("rollout.replica_backend='process' runs each replica's request-level server in a "
                          "child process: set rollout.multi_turn.enable=True (agent loops) or an async "
                          "trainer.v1.trainer_mode, or use replica_backend='local' (the batch rollout runs "
                          "one engine in the trainer's process)")
    _positive(c.trainer.total_training_steps, "trainer.total_training_steps")
    _positive(c.actor.ppo_epochs, "actor.ppo_epochs")
    _positive(c.actor.optim.lr, "actor.optim.lr")
    _positive(c.sft.steps, "sft.steps", allow_zero=True)
    _positive(c.trainer.log_val_generations, "trainer.log_val_generations", allow_zero=True)
    has_val = bool(c.data.val_files or (c.data.builtin_task and c.data.builtin_val_size > 0))
    if c.trainer.val_only and not has_val:
        raise ConfigError("trainer.val_only=True needs validation data: set data.val_files (or "
                          "data.builtin_val_size > 0 with a data.builtin_task)")
    best = c.trainer.keep_best_val_metric
    if best and not best.startswith(("val-core/", "val-aux/")):
        raise ConfigError(f"trainer.keep_best_val_metric={best!r} is not a validation metric: give one "
                          "printed at validation, e.g. 'val-core/<data_source>/reward/mean@1' ('' = off)")
    if best and not has_val:
        raise ConfigError("trainer.keep_best_val_metric needs validation data: set data.val_files (or "
                          "data.builtin_val_size > 0 with a data.builtin_task)")
    if c.rollout.temperature < 0:
        raise ConfigError(f"rollout.temperature must be >= 0, got {c.rollout.temperature}")
    if not 0 < c.rollout.top_p <= 1:
        raise ConfigError(f"rollout.top_p must be in (0, 1], got {c.rollout.top_p}")
    if c.rollout.top_k == 0 or c.rollout.top_k < -1:
        raise ConfigError(f"rollout.top_k must be -1 (off) or >= 1, got {c.rollout.top_k}")
    if c.actor.ppo_mini_batch_size <= 0 or c.data.train_batch_size % c.actor.ppo_mini_batch_size:
        raise ConfigError(
            f"actor.ppo_mini_batch_size={c.actor.ppo_mini_batch_size} must be > 0 and divide "
            f"data.train_batch_size={c.data.train_batch_size}")
    if c.use_critic and (c.critic.ppo_mini_batch_size <= 0
                         or c.data.train_batch_size % c.critic.ppo_mini_batch_size):
        raise ConfigError(
            f"critic.ppo_mini_batch_size={c.critic.ppo_mini_batch_size} must be > 0 and divide "
            f"data.train_batch_size={c.data.train_batch_size}")
    if c.algorithm.adv_estimator in ("grpo", "grpo_passk", "rloo", "opo", "gpg",
                                     "reinforce_plus_plus_baseline") and c.rollout.n < 2:
        raise ConfigError(
            f"algorithm.adv_estimator={c.algorithm.adv_estimator!r} compares samples of a prompt "
            f"and needs rollout.n >= 2 (got {c.rollout.n})")
    _check_rollout_correction(c)
    _check_lora(c)
    _positive(c.model.moe.aux_loss_coef, "model.moe.aux_loss_coef", allow_zero=True)
    _positive(c.model.moe.z_loss_coef, "model.moe.z_loss_coef", allow_zero=True)
    _check_router_replay(c)
    _check_old_log_prob_pass(c)
    _check_multi_turn(c)
    _check_dapo(c)
    _check_async(c)
    _check_reward_sources(c)
    _check_data_sources(c)
    if not c.model.path and not c.model.tokenizer:
        raise ConfigError("model.path is empty (train from scratch), so model.tokenizer must name a "
                          "tokenizer: 'char' or a folder")
    if c.model.path == "" and c.model.init.num_attention_heads % c.model.init.num_key_value_heads:
        raise ConfigError("model.init.num_attention_heads must be a multiple of model.init.num_key_value_heads")
    if c.model.path == "":
        _check_model_init(c.model.init)
    if c.trainer.max_to_keep < 1:
        raise ConfigError(f"trainer.max_to_keep must be >= 1, got {c.trainer.max_to_keep}")
    _positive(c.trainer.max_nonfinite_steps, "trainer.max_nonfinite_steps")
    _positive(c.reward.max_consecutive_timeouts, "reward.max_consecutive_timeouts", allow_zero=True)
    _positive(c.reward.max_consecutive_worker_deaths, "reward.max_consecutive_worker_deaths",
              allow_zero=True)
    _positive(c.reward.memory_limit_gb, "reward.memory_limit_gb", allow_zero=True)
    _choice(c.reward.sandbox, ("auto", "bwrap", "process"), "reward.sandbox")
    if not 0 <= c.reward.max_error_fraction <= 1:
        raise ConfigError(f"reward.max_error_fraction must be in [0, 1] (1 = never stop), got "
                          f"{c.reward.max_error_fraction}")
    _positive(c.actor.ppo_micro_batch_size_per_device, "actor.ppo_micro_batch_size_per_device")
    _check_token_budgets(c)
    if c.use_critic:
        _positive(c.critic.ppo_micro_batch_size_per_device, "critic.ppo_micro_batch_size_per_device")
    if c.sft.steps > 0:
        _positive(c.sft.batch_size, "sft.batch_size")


def _check_token_budgets(c: RunConfig) -> None:
    """use_dynamic_bsz's token budgets: > 0 where they are used (0 = the actor's for the passes)."""
    if c.actor.use_dynamic_bsz:
        _positive(c.actor.ppo_max_token_len_per_device, "actor.ppo_max_token_len_per_device")
    _positive(c.rollout.log_prob_max_token_len_per_device, "rollout.log_prob_max_token_len_per_device",
              allow_zero=True)
    _positive(c.ref.log_prob_max_token_len_per_device, "ref.log_prob_max_token_len_per_device",
              allow_zero=True)
    if c.use_critic and c.critic.use_dynamic_bsz:
        _positive(c.critic.ppo_max_token_len_per_device, "critic.ppo_max_token_len_per_device")
    if c.reward.model.path and c.reward.model.use_dynamic_bsz:
        _positive(c.reward.model.forward_max_token_len_per_device,
                  "reward.model.forward_max_token_len_per_device")


def _check_reward_sources(c: RunConfig) -> None:
    """reward.rule_weight / reward.model / reward.judge: which sources score, and the judge's
    template, parser, sampling and budgets."""
    r, j = c.reward, c.reward.judge
    if r.rule_weight < 0 and r.rule_weight != -1:
        raise ConfigError(f"reward.rule_weight must be >= 0, or -1 (auto: 0 with a reward model or "
                          f"judge, else 1), got {r.rule_weight}")
    if r.rule_weight == 0 and not r.model.path and not j.enable:
        raise ConfigError("reward.rule_weight=0 turns the rule scorers off, and there is no reward.model.path "
                          "and no reward.judge.enable: nothing would score the responses")
    if not j.enable:
        return
    from jaxrl_llm.rewards import check_template, make_score_parser

    try:
        check_template(j.prompt_template, "reward.judge.prompt_template")
        make_score_parser(j.score_parser, "reward.judge.score_parser")
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if not j.model_path:
        raise ConfigError("reward.judge.model_path is empty: give the judge's checkpoint folder, or "
                          "'policy' to judge with the policy's own rollout server")
    if j.model_path != "policy" and not os.path.isdir(j.model_path):
        raise ConfigError(f"reward.judge.model_path={j.model_path!r} is not a folder: give the judge's "
                          "checkpoint folder (config.json + safetensors + tokenizer), or 'policy'")
    if j.temperature < 0:
        raise ConfigError(f"reward.judge.temperature must be >= 0 (0 = greedy), got {j.temperature}")
    if not 0 < j.top_p <= 1:
        raise ConfigError(f"reward.judge.top_p must be in (0, 1], got {j.top_p}")
    for name in ("max_tokens", "max_prompt_length", "max_concurrent_decodes"):
        _positive(getattr(j, name), f"reward.judge.{name}")
    _positive(j.log_every, "reward.judge.log_every", allow_zero=True)
    request_level = c.rollout.multi_turn.enable or c.rollout_source in ("buffer", "colocated_buffer")
    if j.model_path == "policy" and not request_level:
        raise ConfigError("reward.judge.model_path='policy' sends the judge's requests to the policy's request-level "
                          "server, which the batch rollout (trainer.v1.trainer_mode="
                          f"{c.trainer.v1.trainer_mode!r} without rollout.multi_turn.enable) does not run: give "
                          "the judge a checkpoint folder, or set rollout.multi_turn.enable=True (single_turn_agent "
                          "works for single-turn data)")
    if j.model_path == "policy":  # the judge's requests share the policy engine's KV length
        from rollout import prefill_bucket

        d = c.data
        kv = prefill_bucket(d.max_prompt_length + (d.max_response_length if c.rollout.multi_turn.enable else 0)
                            ) + d.max_response_length
        if j.max_prompt_length + j.max_tokens > kv:
            raise ConfigError(f"reward.judge.max_prompt_length={j.max_prompt_length} + reward.judge.max_tokens="
                              f"{j.max_tokens} exceeds the policy engine's {kv} tokens per request (from "
                              "data.max_prompt_length / max_response_length): lower them, or give the judge "
                              "its own reward.judge.model_path")


def _check_data_sources(c: RunConfig) -> None:
    """Where the prompts and the SFT rows come from: given files, or a built-in task's generated
    splits (train when data.train_files is empty, val when data.val_files is)."""
    d = c.data
    if not d.train_files and not d.builtin_task:
        raise ConfigError("data.train_files is empty and data.builtin_task is not set: give parquet/jsonl "
                          "files or a built-in task ('arithmetic' or 'countdown')")
    if not d.train_files and d.builtin_train_size <= 0:
        raise ConfigError(f"data.builtin_train_size must be > 0 (got {d.builtin_train_size}): data.train_files "
                          f"is empty, so data.builtin_task={d.builtin_task!r} generates the training prompts")
    _positive(d.builtin_val_size, "data.builtin_val_size", allow_zero=True)
    from jaxrl_llm.data.tasks import SFT_DEMO_TASKS

    if c.sft.steps > 0 and not c.sft.train_files and d.builtin_task not in SFT_DEMO_TASKS:
        raise ConfigError(f"sft.steps={c.sft.steps} but sft.train_files is empty and data.builtin_task="
                          f"{d.builtin_task!r} has no demonstrations (only {' and '.join(SFT_DEMO_TASKS)} "
                          "do): give sft.train_files, or set sft.steps=0")


MOE_MODEL_TYPES = ("qwen3_moe", "mixtral")


def _check_router_replay(c: RunConfig) -> None:
    """actor.router_replay: a known mode; recording needs a MoE model (a from-scratch model's
    model_type here; a checkpoint's config.json is checked when the actor is built) and an
    in-process engine (the batch driver, or the request-level server of rollout.multi_turn and
    the buffered async modes); process replicas do not record."""
    rr, where = c.actor.router_replay, "actor.router_replay.mode"
    _choice(rr.mode, ROUTER_REPLAY_MODES, where)
    if not rr.record:
        return
    if not c.model.path and c.model.init.model_type not in MOE_MODEL_TYPES:
        raise ConfigError(f"{where}={rr.mode!r} needs a mixture-of-experts model, but model.init.model_type="
                          f"{c.model.init.model_type!r} is dense (no router): set {where}='disabled'")
    if c.rollout.replica_backend == "process":
        raise ConfigError(f"{where}={rr.mode!r}: rollout.replica_backend='process' replicas do not record the "
                          f"experts; use rollout.replica_backend='local', or set {where}='disabled'")


def _check_old_log_prob_pass(c: RunConfig) -> None:
    """actor.old_log_prob_pass='engine' replays single-turn rollouts through an idle, unquantized,
    batch-invariant in-process engine holding the weights the update starts from."""
    where = "actor.old_log_prob_pass"
    _choice(c.actor.old_log_prob_pass, OLD_LOG_PROB_PASSES, where)
    if c.actor.old_log_prob_pass != "engine":
        return
    why = {
        "rollout.batch_invariant=False (without it the engine's log-probs depend on what shares "
        "its calls, so a replay is not the rollout; set rollout.batch_invariant=True)": not c.rollout.batch_invariant,
        f"trainer.v1.trainer_mode={c.trainer.v1.trainer_mode!r} (in the async modes the engine runs "
        "ahead with other weights; use 'sync')": c.trainer.v1.trainer_mode != "sync",
        "rollout.multi_turn.enable (the engine pass replays single-turn responses)": c.rollout.multi_turn.enable,
        f"rollout.quantization={c.rollout.quantization!r} / rollout.kv_cache_dtype={c.rollout.kv_cache_dtype!r} "
        "(pi_old would be the quantized policy's)": c.rollout.quantization != "none" or c.rollout.kv_cache_dtype != "auto",
        "rollout.replica_backend='process' (no engine in the trainer's process)": c.rollout.replica_backend == "process",
        "rollout.use_rollout_log_probs (bypass mode runs no old-log-prob pass)": c.rollout.use_rollout_log_probs,
    }
    bad = [k for k, v in why.items() if v]
    if bad:
        raise ConfigError(f"{where}='engine' cannot run with " + "; nor with ".join(bad))


def _check_model_init(i) -> None:
    """A model built from `model.init`: MoE fields exactly when model_type is a MoE type."""
    if i.model_type not in ("llama", "qwen2", "qwen3") + MOE_MODEL_TYPES:
        raise ConfigError(f"model.init.model_type={i.model_type!r}; choose one of "
                          f"llama, qwen2, qwen3, {', '.join(MOE_MODEL_TYPES)}")
    if i.model_type in MOE_MODEL_TYPES:
        if i.num_experts < 1 or i.moe_intermediate_size < 1:
            raise ConfigError(f"model.init.model_type={i.model_type!r} is a mixture of experts: set "
                              f"model.init.num_experts and model.init.moe_intermediate_size (> 0; got "
                              f"{i.num_experts} and {i.moe_intermediate_size})")
        if not 1 <= i.num_experts_per_tok <= i.num_experts:
            raise ConfigError(f"model.init.num_experts_per_tok must be in [1, model.init.num_experts="
                              f"{i.num_experts}], got {i.num_experts_per_tok}")
    elif i.num_experts or i.num_experts_per_tok or i.moe_intermediate_size:
        raise ConfigError(f"model.init.num_experts / num_experts_per_tok / moe_intermediate_size are for "
                          f"model_type qwen3_moe or mixtral; model.init.model_type is {i.model_type!r} "
                          f"(set them to 0, or pick a MoE model_type)")
    dense, step = tuple(i.mlp_only_layers), i.decoder_sparse_step
    if dense or step != 1:
        if i.model_type != "qwen3_moe":
            raise ConfigError(f"model.init.mlp_only_layers={list(dense)} / decoder_sparse_step={step} (dense layers "
                              f"among sparse ones) are for model_type qwen3_moe; model.init.model_type is "
                              f"{i.model_type!r}")
        if step < 1 or any(not 0 <= k < i.num_hidden_layers for k in dense):
            raise ConfigError(f"model.init.decoder_sparse_step={step} must be >= 1 and model.init.mlp_only_layers="
                              f"{list(dense)} layer indices in [0, {i.num_hidden_layers - 1}]")
        if all(k in dense or (k + 1) % step for k in range(i.num_hidden_layers)):
            raise ConfigError(f"model.init.mlp_only_layers={list(dense)}, decoder_sparse_step={step}: no layer of "
                              f"the {i.num_hidden_layers} has experts")


def _check_lora(c: RunConfig) -> None:
    lora = c.actor.lora
    _positive(lora.rank, "actor.lora.rank", allow_zero=True)
    if not lora.enabled:
        return
    _positive(lora.alpha, "actor.lora.alpha")
    if lora.dropout != 0.0:
        raise ConfigError(f"actor.lora.dropout={lora.dropout}: adapter dropout is not implemented; "
                          "set it to 0.0")
    from jaxrl_llm.models import resolve_targets

    try:
        resolve_targets(lora.target_modules)
    except ValueError as e:
        raise ConfigError(f"actor.lora.{e}") from None


def _check_multi_turn(c: RunConfig) -> None:
    mt, where = c.rollout.multi_turn, "rollout.multi_turn"
    _choice(mt.format, TOOL_CALL_FORMATS, f"{where}.format")
    _choice(mt.sandbox, SANDBOX_KINDS, f"{where}.sandbox")
    _choice(mt.tool_response_truncate_side, ("left", "middle", "right"),
            f"{where}.tool_response_truncate_side")
    _choice(mt.tokenization_sanity_check_mode, ("strict", "ignore_strippable", "disable"),
            f"{where}.tokenization_sanity_check_mode")
    for name in ("max_assistant_turns", "max_user_turns"):
        _positive(getattr(mt, name), f"{where}.{name}", allow_zero=True)
    _positive(mt.max_parallel_calls, f"{where}.max_parallel_calls")
    _positive(mt.max_tool_response_length, f"{where}.max_tool_response_length")
    _positive(mt.tool_timeout_s, f"{where}.tool_timeout_s")
    _positive(mt.tool_memory_limit_gb, f"{where}.tool_memory_limit_gb")
    _positive(mt.tool_workers, f"{where}.tool_workers")
    if not mt.default_agent_loop:
        raise ConfigError(f"{where}.default_agent_loop must name an agent loop, e.g. "
                          "'single_turn_agent' or 'tool_agent'")
    if mt.default_agent_loop == "openai_agent" and not mt.openai_agent_path:
        raise ConfigError(f"{where}.default_agent_loop='openai_agent' runs a user's agent: set "
                          f"{where}.openai_agent_path (a .py file or a dotted module) and "
                          f"{where}.openai_agent_name (its function agent(base_url, session_id, row))")


def _check_dapo(c: RunConfig) -> None:
    fg, where = c.algorithm.filter_groups, "algorithm.filter_groups"
    _choice(fg.metric, FILTER_METRICS, f"{where}.metric")
    _positive(fg.max_num_gen_batches, f"{where}.max_num_gen_batches", allow_zero=True)
    if fg.enable:
        if c.rollout.n < 2:
            raise ConfigError(f"{where}.enable keeps prompts whose responses differ, which needs "
                              f"rollout.n >= 2 (got {c.rollout.n})")
        mode = c.trainer.v1.trainer_mode
        # the async modes: the rollouter evicts a rejected group as it finishes (agent.dapo_group_filter)
        if mode != "sync" and fg.metric not in ("acc", "score"):
            raise ConfigError(f"trainer.v1.trainer_mode={mode!r} filters groups in the rollouter, which "
                              f"offers {where}.metric 'acc' or 'score', not {fg.metric!r} (it needs the "
                              "trainer's overlong penalty): set one of those or trainer_mode='sync'")
        if mode != "sync" and c.rollout_source == "one_step_off":
            raise ConfigError(f"{where}.enable cannot run in the one-step-off pipeline (trainer.v1.trainer_mode="
                              f"{mode!r} one batch ahead on the batch driver: a step may need several "
                              "generation rounds): use trainer_mode='sync', or the rollouter (e.g. "
                              "rollout.multi_turn.enable or colocate_async)")
        if mode != "sync" and fg.max_num_gen_batches == 0:
            raise ConfigError(f"{where}.max_num_gen_batches=0 (unlimited) has no meaning in trainer.v1.trainer_mode="
                              f"{mode!r}: the replay buffer feeds (max_num_gen_batches - 1) batches of prompts "
                              "ahead to replace the groups the filter evicts; set it > 0 (e.g. 3)")
        if fg.metric == "seq_final_reward" and c.algorithm.use_kl_in_reward:
            raise ConfigError(f"{where}.metric='seq_final_reward' with algorithm.use_kl_in_reward=True: "
                              "the filter runs before the KL penalty is known; use 'seq_reward'")
    ob, where = c.reward.overlong_buffer, "reward.overlong_buffer"
    _positive(ob.penalty_factor, f"{where}.penalty_factor", allow_zero=True)
    if ob.enable and not 0 < ob.len <= c.data.max_response_length:
        raise ConfigError(f"{where}.len must be in (0, data.max_response_length="
                          f"{c.data.max_response_length}] when {where}.enable, got {ob.len}")
    if c.algorithm.adv_estimator == "remax" and c.trainer.v1.trainer_mode != "sync":
        raise ConfigError("algorithm.adv_estimator='remax' generates a greedy baseline each step, which "
                          f"trainer.v1.trainer_mode={c.trainer.v1.trainer_mode!r} cannot interleave with its "
                          "background rollout: use trainer_mode='sync'")


def _check_failed_budget(c: RunConfig) -> None:
    """`trainer.v1.sampler.max_failed_*`: the rollouter's budget of evicted failed groups."""
    sampler, where = c.trainer.v1.sampler, "trainer.v1.sampler"
    _positive(sampler.max_failed_groups, f"{where}.max_failed_groups", allow_zero=True)
    if not 0 <= sampler.max_failed_fraction <= 1:
        raise ConfigError(f"{where}.max_failed_fraction must be in [0, 1] (a fraction of "
                          f"data.train_batch_size), got {sampler.max_failed_fraction}")
    if sampler.max_failed_groups and c.rollout_source not in ("buffer", "colocated_buffer"):
        raise ConfigError(f"{where}.max_failed_groups={sampler.max_failed_groups}: only the rollouter evicts and "
                          "replaces failed groups, and this config runs "
                          f"trainer.v1.trainer_mode={c.trainer.v1.trainer_mode!r} without it (rollout source "
                          f"{c.rollout_source!r}): use trainer_mode='colocate_async' or 'separate_async' with "
                          "the rollouter, or set max_failed_groups=0")


def _check_deterministic_schedule(c: RunConfig) -> None:
    """`trainer.v1.deterministic_schedule`: the rollouter's counter-based schedule evicts no group."""
    where = "trainer.v1.deterministic_schedule=True"
    if not c.trainer.v1.deterministic_schedule or c.rollout_source not in ("buffer", "colocated_buffer"):
        return
    if c.algorithm.filter_groups.enable:
        raise ConfigError(f"{where} cannot be combined with algorithm.filter_groups.enable: the rollouter's "
                          "filter evicts groups as they finish, so which groups train would depend on "
                          "timing; turn one of them off")
    if c.trainer.v1.sampler.max_failed_groups:
        raise ConfigError(f"{where} needs trainer.v1.sampler.max_failed_groups=0 (got "
                          f"{c.trainer.v1.sampler.max_failed_groups}): an evicted group's slot would go to "
                          "another prompt at a time that depends on timing")


def _check_trainer_mode(c: RunConfig) -> None:
    """verl V1's `trainer.v1` fields; the aliases must have been resolved (`resolve_aliases`)."""
    v1, where = c.trainer.v1, "trainer.v1"
    mode = v1.trainer_mode
    _choice(mode, TRAINER_MODES, f"{where}.trainer_mode")
    _choice(v1.sampler.max_off_policy_strategy, OFF_POLICY_STRATEGIES, f"{where}.sampler.max_off_policy_strategy")
    bound = v1.sampler.max_off_policy_threshold
    if bound < -1:
        raise ConfigError(f"{where}.sampler.max_off_policy_threshold must be >= 0 (model versions) or "
                          f"None / -1 (no bound), got {bound}")
    _positive(v1.colocate_async.num_warmup_batches, f"{where}.colocate_async.num_warmup_batches", allow_zero=True)
    _check_failed_budget(c)
    _check_deterministic_schedule(c)
    _positive(v1.separate_async.parameter_sync_step, f"{where}.separate_async.parameter_sync_step",
              allow_zero=True)
    for alias, on in (("async_training.enable", c.async_training.enable),
                      ("placement.one_step_off_policy", c.placement.one_step_off_policy)):
        if on and mode != "separate_async":
            raise ConfigError(f"{alias}=True is an alias of {where}.trainer_mode='separate_async' but the "
                              f"config says {mode!r} (a RunConfig built without resolve_aliases?): set "
                              f"{where}.trainer_mode instead")
    if mode == "separate_async":
        if c.placement.mode != "separate":
            raise ConfigError(f"{where}.trainer_mode='separate_async' (aliases async_training.enable, "
                              "placement.one_step_off_policy) needs placement.mode='separate': the rollout "
                              "generates on its own devices while training runs (on the training devices: "
                              "trainer_mode='colocate_async')")
        k, mini, size = v1.separate_async.parameter_sync_step, c.actor.ppo_mini_batch_size, c.data.train_batch_size
        if k and k * mini != size:
            raise ConfigError(
                f"{where}.separate_async.parameter_sync_step={k} x actor.ppo_mini_batch_size={mini} = {k * mini} "
                f"must equal data.train_batch_size={size} (verl's invariant: a trainer step trains "
                f"parameter_sync_step mini-batches between two weight syncs); set parameter_sync_step="
                f"{size // mini if mini and size % mini == 0 else 'data.train_batch_size / ppo_mini_batch_size'} "
                "or 0 (derived)")
    if mode == "colocate_async" and c.placement.mode != "colocated":
        raise ConfigError(f"{where}.trainer_mode='colocate_async' runs the rollout on the training devices: "
                          "it needs placement.mode='colocated' (on devices of its own: 'separate_async')")


def _check_async(c: RunConfig) -> None:
    a, where = c.async_training, "async_training"
    _positive(a.staleness_threshold, f"{where}.staleness_threshold", allow_zero=True)
    _positive(a.trigger_parameter_sync_step, f"{where}.trigger_parameter_sync_step")
    _positive(a.require_batches, f"{where}.require_batches")
    v1 = c.trainer.v1
    if v1.trainer_mode == "sync":
        return
    if a.partial_rollout and v1.trainer_mode == "separate_async" and v1.colocate_async.num_warmup_batches == 0:
        raise ConfigError(f"{where}.partial_rollout=True needs trainer.v1.colocate_async.num_warmup_batches "
                          f"(alias {where}.staleness_threshold) > 0: with 0 the rollout never runs ahead, so "
                          "no request is in flight at a sync")
    if c.use_critic and c.data.train_batch_size % c.critic.ppo_mini_batch_size:
        raise ConfigError(f"critic.ppo_mini_batch_size={c.critic.ppo_mini_batch_size} must divide "
                          f"data.train_batch_size={c.data.train_batch_size}")
    mode = f"trainer.v1.trainer_mode={v1.trainer_mode!r}"
    if c.algorithm.adv_estimator == "remax":
        raise ConfigError(f"{mode} cannot be combined with algorithm.adv_estimator='remax' yet: the "
                          "asynchronous rollout has no greedy baseline pass")


def _check_rollout_correction(c: RunConfig) -> None:
    rc = c.algorithm.rollout_correction
    where = "algorithm.rollout_correction"
    _choice(rc.rollout_is, ("",) + ROLLOUT_IS_LEVELS, f"{where}.rollout_is")
    _choice(rc.rollout_rs, ("",) + ROLLOUT_RS_LEVELS, f"{where}.rollout_rs")
    _positive(rc.rollout_is_threshold, f"{where}.rollout_is_threshold")
    _positive(rc.rollout_rs_threshold, f"{where}.rollout_rs_threshold")
    _positive(rc.rollout_rs_threshold_lower, f"{where}.rollout_rs_threshold_lower", allow_zero=True)
    _positive(rc.rollout_token_veto_threshold, f"{where}.rollout_token_veto_threshold", allow_zero=True)
    lower = rc.rollout_rs_threshold_lower or 1.0 / rc.rollout_rs_threshold
    if rc.rollout_rs and lower > rc.rollout_rs_threshold:
        raise ConfigError(f"{where}.rollout_rs_threshold_lower={lower} is above "
                          f"rollout_rs_threshold={rc.rollout_rs_threshold}: every token would be rejected")
    if rc.bypass_mode != c.rollout.use_rollout_log_probs:
        raise ConfigError(f"{where}.bypass_mode={rc.bypass_mode} is an alias of rollout.use_rollout_log_probs, "
                          f"but that is {c.rollout.use_rollout_log_probs} (a RunConfig built without "
                          "resolve_aliases?): load the config with to_run_config / load_config")
    if rc.enabled and c.rollout.use_rollout_log_probs:
        raise ConfigError(f"{where} compares the trainer's old log-probs with the engine's, but "
                          f"rollout.use_rollout_log_probs=True makes them the same (as its alias {where}.bypass_mode "
                          "does): set both to False")
