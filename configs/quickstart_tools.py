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
Variants: `local` runs the workers in-process; `tiny` is a short smoke run (tests use it) in its
own folder, `runs/quickstart_tools-tiny/`.
"""
import importlib.util
import os

_HERE = os.path.dirname(os.path.abspath(__file__))
_TOOLS = os.path.join(_HERE, "tools", "calculator.json")


def _quickstart(arg):
    """configs/quickstart.py's config (same model, optimiser and variants), to build on."""
    spec = importlib.util.spec_from_file_location("quickstart", os.path.join(_HERE, "quickstart.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config(arg)


def get_config(arg: str | None = None):
    variants = set(arg.split(",")) if arg else set()
    unknown = variants - {"local", "tiny"}
    if unknown:
        raise ValueError(f"unknown quickstart_tools variant(s) {sorted(unknown)}; use 'local' and/or 'tiny'")
    c = _quickstart(arg)
    c.data.builtin_task = "arithmetic_tools"
    c.data.builtin_max_operand = 99  # a*b with a, b in [10, 99]
    c.data.max_response_length = 96  # all turns: the call, the tool's reply, the answer
    c.model.init.max_position_embeddings = 256
    c.rollout.steps_per_sync = 16
    c.rollout.multi_turn.enable = True
    c.rollout.multi_turn.default_agent_loop = "tool_agent"
    c.rollout.multi_turn.tool_config_path = _TOOLS
    c.rollout.multi_turn.max_assistant_turns = 3
    c.rollout.multi_turn.format = "hermes"
    c.sft.builtin_no_tool = 0.3
    c.sft.builtin_trailing_junk = 0.7
    c.sft.max_length = 104  # the longest trace is 100 tokens
    # a run folder per variant size (a tiny run must not share the main one's); the generated
    # data goes to <run>/data/builtin/
    c.trainer.default_local_dir = "runs/quickstart_tools-tiny" if "tiny" in variants else "runs/quickstart_tools"
    c.trainer.experiment_name = "quickstart_tools"
    if "tiny" in variants:
        c.data.builtin_val_size = 8
        c.data.val_batch_size = 8
        c.rollout.max_concurrent_decodes = 16
    else:
        c.data.builtin_val_size = 64
        c.data.train_batch_size = 16
        c.trainer.total_training_steps = 10
        c.trainer.test_freq = 5
        c.trainer.save_freq = 10
    return c
