"""Function tools (rollout.multi_turn.function_tool_path) run in worker processes: a tool that
hangs, exits, allocates past its limit or raises gives the model an error message, the worker is
replaced, and the trainer's process is never touched."""
import asyncio
import os

import pytest

from jaxrl_llm.agent import load_agent_resources
from jaxrl_llm.agent.tools import run_tool_call

FILE = os.path.join(os.path.dirname(__file__), "..", "fixtures", "tools", "hostile_tools.py")


@pytest.fixture(scope="module")
def tools():
    from jaxrl_llm.agent.tools import load_isolated_function_tools
    tools, pool = load_isolated_function_tools(FILE, timeout_s=3.0, memory_limit_gb=1.5, num_workers=1)
    yield tools
    pool.close()


def call(tool, args):
    response, _, metrics = asyncio.run(run_tool_call(tool, "i", args, timeout_s=30.0))
    return response.text, metrics


def test_a_working_tool_runs_in_another_process(tools):
    assert call(tools["add"], {"a": 2, "b": 3}) == ("5", {})
    assert int(call(tools["pid"], {})[0]) != os.getpid()


@pytest.mark.parametrize("name, args, message", [
    ("hang", {"seconds": 600}, "timed out after 3 s"),
    ("die", {"code": 7}, "crashed (its process exited with 7)"),
    ("hog", {"gigabytes": 8}, "MemoryError"),
    ("boom", {}, "failed: RuntimeError: kaput"),
    ("add", {"a": "x", "b": 1}, "argument 'a' must be integer"),  # checked in the parent
])
def test_a_hostile_tool_becomes_an_error_and_the_next_call_works(tools, name, args, message):
    text, metrics = call(tools[name], args)
    assert text.startswith("Error") and message in text and "error" in metrics, text
    assert call(tools["add"], {"a": 1, "b": 1})[0] == "2"  # the (replaced) worker serves again


def test_runner_resources_isolate_function_tools_and_keep_config_tools_in_process(tmp_path):
    from jaxrl_llm.config import load_config
    cfg = load_config(os.path.join(os.path.dirname(__file__), "..", "..", "configs",
                                   "quickstart_tools.py"),
                      [f"rollout.multi_turn.function_tool_path={FILE}"]).rollout.multi_turn
    tools, interactions, pools = load_agent_resources(cfg)
    try:
        assert type(tools["add"]).__name__ == "IsolatedFunctionTool"
        assert type(tools["calculator"]).__name__ == "CalculatorTool"
        assert interactions == {} and len(pools) == 1
    finally:
        for p in pools:
            p.close()
