"""Built-in task generators that write verl-schema data files."""
from jaxrl_llm.data.tasks._arithmetic import (
    make_arithmetic_dataset,
    make_arithmetic_rows,
    make_arithmetic_sft_rows,
    render_arithmetic_answer,
)
from jaxrl_llm.data.tasks._arithmetic_tools import (
    make_tool_arithmetic_dataset,
    make_tool_arithmetic_rows,
    make_tool_arithmetic_sft_rows,
    tool_call_text,
)
from jaxrl_llm.data.tasks._countdown import make_countdown_dataset, make_countdown_rows
from jaxrl_llm.data.tasks._gsm8k import gsm8k_rows
from jaxrl_llm.data.tasks._reasoning_gym import (
    extract_reasoning_gym_answer,
    make_reasoning_gym_dataset,
    make_reasoning_gym_rows,
)

SFT_DEMO_TASKS = ("arithmetic", "arithmetic_tools")  # built-in tasks with SFT demonstrations

__all__ = [
    "SFT_DEMO_TASKS",
    "extract_reasoning_gym_answer",
    "gsm8k_rows",
    "make_arithmetic_dataset",
    "make_arithmetic_rows",
    "make_arithmetic_sft_rows",
    "make_countdown_dataset",
    "make_reasoning_gym_dataset",
    "make_reasoning_gym_rows",
    "make_tool_arithmetic_dataset",
    "make_tool_arithmetic_rows",
    "make_tool_arithmetic_sft_rows",
    "tool_call_text",
    "make_countdown_rows",
    "render_arithmetic_answer",
]
