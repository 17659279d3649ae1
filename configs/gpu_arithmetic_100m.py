"""A ~100M-parameter model learns 2-digit addition on one GPU: SFT from scratch, then GRPO.

Same recipe as configs/quickstart.py (imperfect SFT demonstrations that GRPO unlearns) with a
12-layer, 768-wide Qwen2-style decoder (~104M parameters) and operands up to 99.
Launch (one GPU, ~3 minutes on an H200):
  python -m jaxrl_llm.train --config=configs/gpu_arithmetic_100m.py
"""
from jaxrl_llm.config import base_config


def get_config(arg: str | None = None):
    del arg
    c = base_config()
    c.data.builtin_task = "arithmetic"  # generated under <trainer.default_local_dir>/data/builtin/
    c.data.builtin_max_operand = 99
    c.data.builtin_train_size = 20000
    c.data.builtin_val_size = 500
    c.data.max_prompt_length = 16
    c.data.max_response_length = 8
    c.data.train_batch_size = 128
    c.data.val_batch_size = 500
    c.model.tokenizer = "char"
    c.model.dtype = "bfloat16"
    c.model.init.hidden_size = 768
    c.model.init.intermediate_size = 3072
    c.model.init.num_hidden_layers = 12
    c.model.init.num_attention_heads = 12
    c.model.init.num_key_value_heads = 4
    c.model.init.head_dim = 64
    c.model.init.max_position_embeddings = 64
    c.actor.optim.lr = 3e-5
    c.actor.optim.weight_decay = 0.0
    c.actor.ppo_mini_batch_size = 32
    c.actor.ppo_micro_batch_size_per_device = 256
    c.rollout.n = 8
    c.rollout.max_concurrent_decodes = 1024
    c.rollout.steps_per_sync = 8
    c.reward.num_workers = 0
    c.sft.steps = 800
    c.sft.batch_size = 256
    c.sft.lr = 3e-4
    c.sft.warmup_steps = 50
    c.sft.max_length = 32
    c.sft.builtin_size = 20000
    c.sft.builtin_trailing_junk = 0.7
    c.trainer.backend = "local"
    c.trainer.total_training_steps = 40
    c.trainer.test_freq = 10
    c.trainer.save_freq = 0
    c.trainer.default_local_dir = "runs/gpu_arithmetic_100m"
    c.trainer.experiment_name = "gpu_arithmetic_100m"
    return c
