"""Agentic demo on CPU: a tiny transformer learns to use a calculator for 2-digit multiplication.

The model (the quickstart's size, character tokenizer) cannot multiply two-digit numbers in its
head. Its SFT warm start sees calculator traces (`<tool_call>{"name":"calculator",...}</tool_call>`,
the tool's result, then the answer) with two bad habits, as the quickstart's demonstrations
have one: for `sft.builtin_no_tool` of the problems a direct answer with no tool (imitation then
guesses, wrongly), and `sft.builtin_trailing_junk` of the final answers end with a stray "."
that the exact-match scorer rejects. GRPO over agent rollouts (`rollout.multi_turn`, the
`tool_agent` loop, the built-in calculator) unlearns both: held-out greedy accuracy rises and
`tool_calls/mean` with it.

Launch (minutes on 2 CPU cores):
  python -m jaxrl_llm.train --config=configs/quickstart_tools.py
Variants: `local` runs the workers in-process; `tiny` is a short smoke run (tests use it).
"""
import os

from jaxrl_llm.config import base_config

_TOOLS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tools", "calculator.json")


def get_config(arg: str | None = None):
    c = base_config()
    c.data.builtin_task = "arithmetic_tools"
    c.data.train_files = ("runs/quickstart_tools/data/train.parquet",)
    c.data.val_files = ("runs/quickstart_tools/data/val.parquet",)
    c.data.builtin_train_size = 4000
    c.data.builtin_max_operand = 99  # a*b with a, b in [10, 99]
    c.data.builtin_val_size = 64
    c.data.max_prompt_length = 16
    c.data.max_response_length = 96  # all turns: the call, the tool's reply, the answer
    c.data.train_batch_size = 16
    c.data.val_batch_size = 64
    c.model.tokenizer = "char"
    c.model.dtype = "float32"
    c.model.init.hidden_size = 128
    c.model.init.intermediate_size = 256
    c.model.init.num_hidden_layers = 2
    c.model.init.num_attention_heads = 4
    c.model.init.num_key_value_heads = 2
    c.model.init.head_dim = 32
    c.model.init.max_position_embeddings = 256
    c.actor.optim.lr = 1e-4
    c.actor.optim.weight_decay = 0.0
    c.actor.ppo_mini_batch_size = 8
    c.actor.ppo_micro_batch_size_per_device = 256
    c.rollout.n = 8
    c.rollout.temperature = 1.0
    c.rollout.max_concurrent_decodes = 256
    c.rollout.steps_per_sync = 16
    c.rollout.multi_turn.enable = True
    c.rollout.multi_turn.default_agent_loop = "tool_agent"
    c.rollout.multi_turn.tool_config_path = _TOOLS
    c.rollout.multi_turn.max_assistant_turns = 3
    c.rollout.multi_turn.format = "hermes"
    c.reward.num_workers = 0
    c.sft.steps = 300
    c.sft.builtin_no_tool = 0.3
    c.sft.builtin_trailing_junk = 0.7
    c.sft.batch_size = 64
    c.sft.lr = 2e-3
    c.sft.warmup_steps = 10
    c.sft.max_length = 128
    c.sft.builtin_size = 4000
    c.trainer.total_training_steps = 10
    c.trainer.test_freq = 5
    c.trainer.save_freq = 10
    c.trainer.default_local_dir = "runs/quickstart_tools"
    c.trainer.experiment_name = "quickstart_tools"
    if arg:
        for variant in arg.split(","):
            if variant == "local":
                c.trainer.backend = "local"
            elif variant == "tiny":
                c.model.init.hidden_size = 32
                c.model.init.intermediate_size = 64
                c.model.init.head_dim = 8
                c.data.builtin_train_size = 64
                c.data.builtin_val_size = 8
                c.data.train_batch_size = 8
                c.data.val_batch_size = 8
                c.actor.ppo_mini_batch_size = 4
                c.actor.ppo_micro_batch_size_per_device = 1
                c.rollout.n = 2
                c.rollout.max_concurrent_decodes = 16
                c.sft.steps = 2
                c.sft.batch_size = 8
                c.sft.builtin_size = 32
                c.trainer.total_training_steps = 2
                c.trainer.test_freq = 2
                c.trainer.save_freq = 1
            else:
                raise ValueError(f"unknown quickstart_tools variant {variant!r}; use 'local' and/or 'tiny'")
    return c
