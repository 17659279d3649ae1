"""PPO (GAE with a critic) on GSM8K with a local Hugging Face Qwen2.5 folder (verl's PPO recipe).

Launch (after converting the data as in configs/grpo_gsm8k.py):
  python -m jaxrl_llm.train --config=configs/ppo_gsm8k.py \
      --config.model.path=/models/Qwen2.5-0.5B-Instruct \
      --config.data.train_files=data/gsm8k/train.parquet --config.data.val_files=data/gsm8k/test.parquet
"""
from jaxrl_llm.config import base_config


def get_config(arg: str | None = None):
    del arg
    c = base_config()
    c.data.train_files = ("data/gsm8k/train.parquet",)
    c.data.val_files = ("data/gsm8k/test.parquet",)
    c.data.max_prompt_length = 512
    c.data.max_response_length = 512
    c.data.train_batch_size = 256
    c.data.val_batch_size = 1319
    c.model.path = "models/Qwen2.5-0.5B-Instruct"
    c.model.remat = "full"
    c.actor.optim.lr = 1e-6
    c.actor.ppo_mini_batch_size = 64
    c.actor.ppo_micro_batch_size_per_device = 8
    c.critic.optim.lr = 1e-5
    c.critic.ppo_mini_batch_size = 64
    c.critic.ppo_micro_batch_size_per_device = 8
    c.rollout.n = 1
    c.algorithm.adv_estimator = "gae"
    c.algorithm.gamma = 1.0
    c.algorithm.lam = 1.0
    c.algorithm.use_kl_in_reward = True
    c.algorithm.kl_ctrl.kl_coef = 0.001
    c.trainer.total_training_steps = 435
    c.trainer.save_freq = 50
    c.trainer.test_freq = 10
    c.trainer.default_local_dir = "runs/ppo_gsm8k"
    c.trainer.experiment_name = "qwen2.5_ppo_gsm8k"
    return c
