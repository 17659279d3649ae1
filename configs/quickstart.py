"""The embedded default: a tiny transformer learns addition on CPU, SFT warm start + GRPO.

The SFT demonstrations are imperfect on purpose: 70% of them end the (right) answer with a stray
"." (`sft.builtin_trailing_junk`), so imitation learns the habit and the exact-match verifier
scores greedy held-out answers 0; GRPO unlearns it, and held-out accuracy rises to what the model
can actually compute (about 50-70% on 2 CPU cores, seeds 0-2), far more than the 20 points the
project asks of this demo. `sft.builtin_off_by_one` is a harder variant (wrong digits, not format).

Launch (a few minutes on 2 CPU cores):
  python -m jaxrl_llm.train --config=configs/quickstart.py
Variants: `configs/quickstart.py:local` runs the workers in-process instead of in a Ray actor
(same run folder, `runs/quickstart/`); `configs/quickstart.py:lora` trains rank-16 LoRA adapters
(all-linear, alpha 32, lr 1e-3) on the SFT-tuned base instead of every weight, in
`runs/quickstart-lora/`; `configs/quickstart.py:moe` makes every MLP a Qwen3-MoE sparse block
(4 experts, top-2, each half the dense width, load-balancing loss 0.01), in `runs/quickstart-moe/`;
`configs/quickstart.py:tiny` is a smoke run with a smaller model and data (tests use it) in its own folder, `runs/quickstart-tiny/` (1.5-2 minutes the first
time on 2 CPU cores, under 30 s once JAX's compilation cache holds its programs).
"""
from jaxrl_llm.config import base_config


def get_config(arg: str | None = None):
    c = base_config()
    c.data.builtin_task = "arithmetic"  # no data.train_files/val_files: generated under <run>/data/builtin/
    c.data.builtin_train_size = 4000
    c.data.builtin_max_operand = 20  # a+b with a, b in [0, 20]; 59 held-out problems
    c.data.builtin_val_size = 59
    c.data.max_prompt_length = 16
    c.data.max_response_length = 8
    c.data.train_batch_size = 32
    c.data.val_batch_size = 64
    c.model.tokenizer = "char"
    c.model.dtype = "float32"
    c.model.init.hidden_size = 128
    c.model.init.intermediate_size = 256
    c.model.init.num_hidden_layers = 2
    c.model.init.num_attention_heads = 4
    c.model.init.num_key_value_heads = 2
    c.model.init.head_dim = 32
    c.model.init.max_position_embeddings = 64
    c.actor.optim.lr = 1e-4
    c.actor.optim.weight_decay = 0.0
    c.actor.ppo_mini_batch_size = 8  # 4 optimizer steps per RL step
    c.actor.ppo_micro_batch_size_per_device = 256
    c.rollout.n = 8
    c.rollout.temperature = 1.0
    c.rollout.max_concurrent_decodes = 256
    c.rollout.steps_per_sync = 8
    c.reward.num_workers = 0
    c.sft.steps = 300
    c.sft.builtin_trailing_junk = 0.7
    c.sft.batch_size = 64
    c.sft.lr = 2e-3
    c.sft.warmup_steps = 10
    c.sft.max_length = 16  # the longest demonstration is 12 tokens
    c.sft.builtin_size = 4000
    c.trainer.total_training_steps = 40
    c.trainer.test_freq = 10
    c.trainer.save_freq = 20
    c.trainer.default_local_dir = "runs/quickstart"
    c.trainer.experiment_name = "quickstart"
    if arg:
        for variant in arg.split(","):
            if variant == "local":
                c.trainer.backend = "local"
            elif variant == "tiny":
                c.model.init.hidden_size = 32
                c.model.init.intermediate_size = 64
                c.model.init.head_dim = 8
                c.data.builtin_train_size = 64
                c.data.builtin_val_size = 16
                c.data.train_batch_size = 8
                c.data.val_batch_size = 16
                c.actor.ppo_mini_batch_size = 4
                c.actor.ppo_micro_batch_size_per_device = 1
                c.critic.ppo_mini_batch_size = 4
                c.critic.ppo_micro_batch_size_per_device = 1
                c.rollout.n = 2
                c.sft.steps = 2
                c.sft.batch_size = 8
                c.sft.builtin_size = 32
                c.trainer.total_training_steps = 2
                c.trainer.test_freq = 2
                c.trainer.save_freq = 1
            elif variant == "lora":  # GRPO trains rank-16 adapters on the SFT-tuned base
                c.actor.lora.rank = 16
                c.actor.lora.alpha = 32.0
                c.actor.optim.lr = 1e-3
            elif variant != "moe":
                raise ValueError(f"unknown quickstart variant {variant!r}; use 'local', 'tiny', "
                                 "'lora' and/or 'moe'")
    variants = arg.split(",") if arg else []
    if "moe" in variants:  # Qwen3-MoE layers: 4 experts, top-2, as many active MLP weights as dense
        c.model.init.model_type = "qwen3_moe"
        c.model.init.num_experts = 4
        c.model.init.num_experts_per_tok = 2
        c.model.init.moe_intermediate_size = c.model.init.intermediate_size // 2
        c.model.moe.aux_loss_coef = 0.01
    suffix = "".join(f"-{v}" for v in ("lora", "moe") if v in variants)
    if "tiny" in variants:  # a different model and data: its own run folder
        use_run_dir(c, "runs/quickstart-tiny" + suffix)
    elif suffix:
        use_run_dir(c, "runs/quickstart" + suffix)
    return c


def use_run_dir(c, run_dir: str) -> None:
    """Puts the run (checkpoints, metrics, config.json) and the built-in task's generated data
    (`<run_dir>/data/builtin/`) under `run_dir`."""
    c.trainer.default_local_dir = run_dir
