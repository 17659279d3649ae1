"""GRPO on GSM8K with a local Hugging Face Qwen2.5 folder (verl's `run_qwen2-7b_math` recipe).

Prepare data once (a GSM8K-style json/jsonl from disk -> verl parquet):
  python scripts/convert_gsm8k.py --input gsm8k/train.jsonl --output data/gsm8k/train.parquet
  python scripts/convert_gsm8k.py --input gsm8k/test.jsonl --output data/gsm8k/test.parquet
Launch:
  python -m jaxrl_llm.train --config=configs/grpo_gsm8k.py \
      --config.model.path=/models/Qwen2.5-0.5B-Instruct \
      --config.data.train_files=data/gsm8k/train.parquet --config.data.val_files=data/gsm8k/test.parquet
Variant `:small` shrinks batch sizes for one accelerator.
"""
from jaxrl_llm.config import base_config


def get_config(arg: str | None = None):
    c = base_config()
    c.data.train_files = ("data/gsm8k/train.parquet",)
    c.data.val_files = ("data/gsm8k/test.parquet",)
    c.data.max_prompt_length = 512
    c.data.max_response_length = 1024
    c.data.train_batch_size = 1024
    c.data.val_batch_size = 1319
    c.model.path = "models/Qwen2.5-0.5B-Instruct"
    c.model.dtype = "bfloat16"
    c.model.remat = "full"
    c.actor.optim.lr = 1e-6
    c.actor.ppo_mini_batch_size = 256
    c.actor.ppo_micro_batch_size_per_device = 16
    c.actor.use_kl_loss = True
    c.actor.kl_loss_coef = 0.001
    c.actor.kl_loss_type = "low_var_kl"
    c.actor.entropy_coeff = 0.0
    c.rollout.n = 5
    c.rollout.max_concurrent_decodes = 512
    c.algorithm.adv_estimator = "grpo"
    c.algorithm.use_kl_in_reward = False
    c.trainer.total_training_steps = 105
    c.trainer.save_freq = 20
    c.trainer.test_freq = 5
    c.trainer.default_local_dir = "runs/grpo_gsm8k"
    c.trainer.experiment_name = "qwen2.5_grpo_gsm8k"
    if arg == "small":
        c.data.train_batch_size = 64
        c.actor.ppo_mini_batch_size = 16
        c.data.max_response_length = 512
    elif arg:
        raise ValueError(f"unknown variant {arg!r}; use 'small'")
    return c
