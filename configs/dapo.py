"""DAPO on GSM8K-format math with a local Qwen2.5: GRPO with clip-higher, token-mean loss, no KL,
dynamic sampling (`algorithm.filter_groups`: only prompts whose responses differ in accuracy train)
and the soft overlong penalty (`reward.overlong_buffer`).

Launch:
  python -m jaxrl_llm.train --config=configs/dapo.py \\
      --config.model.path=/models/Qwen2.5-1.5B-Instruct \\
      --config.data.train_files=data/gsm8k/train.parquet --config.data.val_files=data/gsm8k/test.parquet

Variants: `configs/dapo.py:tiny` is a CPU smoke run of the same algorithm with nothing to
download: configs/quickstart.py's tiny model (character tokenizer) on its built-in addition task,
in its own folder, `runs/dapo-tiny/` (`tiny,local` runs the workers in-process):
  python -m jaxrl_llm.train --config=configs/dapo.py:tiny
"""
import importlib.util
import os

from jaxrl_llm.config import base_config

_HERE = os.path.dirname(os.path.abspath(__file__))


def _quickstart(arg: str):
    """configs/quickstart.py's config for `arg` (its tiny model and built-in data)."""
    spec = importlib.util.spec_from_file_location("quickstart", os.path.join(_HERE, "quickstart.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config(arg), module.use_run_dir


def get_config(arg: str | None = None):
    variants = set(arg.split(",")) if arg else set()
    if variants - {"tiny", "local"} or variants == {"local"}:
        raise ValueError(f"unknown dapo variant(s) {arg!r}; use 'tiny' or 'tiny,local'")
    if "tiny" in variants:
        c, use_run_dir = _quickstart(arg)
        _tiny(c)
        use_run_dir(c, "runs/dapo-tiny")
        return c
    c = base_config()
    c.data.train_files = ("data/gsm8k/train.parquet",)
    c.data.val_files = ("data/gsm8k/test.parquet",)
    c.data.max_prompt_length = 512
    c.data.max_response_length = 2048
    c.data.train_batch_size = 512
    c.model.path = "models/Qwen2.5-1.5B-Instruct"
    c.model.remat = "full"
    c.actor.optim.lr = 1e-6
    c.actor.optim.warmup_steps = 10
    c.actor.optim.weight_decay = 0.1
    c.actor.ppo_mini_batch_size = 32
    c.actor.ppo_micro_batch_size_per_device = 8
    c.rollout.n = 16
    c.rollout.temperature = 1.0
    _dapo(c)
    c.reward.overlong_buffer.len = 512  # the last 512 of 2048 tokens lose up to 1.0 of score
    c.trainer.total_training_steps = 200
    c.trainer.save_freq = 20
    c.trainer.test_freq = 10
    c.trainer.default_local_dir = "runs/dapo"
    c.trainer.experiment_name = "dapo"
    return c


def _dapo(c) -> None:
    """What makes it DAPO (both variants)."""
    c.actor.clip_ratio_low = 0.2
    c.actor.clip_ratio_high = 0.28
    c.actor.clip_ratio_c = 10.0
    c.actor.loss_agg_mode = "token-mean"
    c.actor.use_kl_loss = False
    c.algorithm.adv_estimator = "grpo"
    c.algorithm.use_kl_in_reward = False
    c.algorithm.filter_groups.enable = True
    c.algorithm.filter_groups.metric = "acc"
    c.algorithm.filter_groups.max_num_gen_batches = 10
    c.reward.overlong_buffer.enable = True
    c.reward.overlong_buffer.penalty_factor = 1.0


def _tiny(c) -> None:
    """The quickstart's tiny run with DAPO's algorithm. A longer SFT warm start than the
    quickstart's tiny (300 steps on clean demonstrations, seconds at this size) makes some answers
    right: without it every response scores 0, no group differs in accuracy and the filter
    stops the run after `max_num_gen_batches` rounds."""
    _dapo(c)
    c.sft.steps = 300
    c.sft.builtin_size = 4000
    c.sft.builtin_trailing_junk = 0.0
    c.rollout.n = 4
    c.reward.overlong_buffer.len = 4  # the last 4 of 8 response tokens lose up to 1.0 of score
    c.trainer.experiment_name = "dapo-tiny"
