"""Tools for multi-turn rollouts (verl's `BaseTool` lifecycle): the interface, `@function_tool`
for plain functions, built-ins (`calculator`, `python`), config-file loading, and
`run_tool_call`, which turns any tool failure into a message for the model."""
from jaxrl_llm.agent.tools._base import BaseTool, ToolResponse
from jaxrl_llm.agent.tools._calculator import (
    CalculatorError,
    CalculatorTool,
    calculate,
    format_number,
)
from jaxrl_llm.agent.tools._function import FunctionTool, function_tool, parse_docstring
from jaxrl_llm.agent.tools._gsm8k import Gsm8kRewardTool
from jaxrl_llm.agent.tools._isolated import (
    IsolatedFunctionTool,
    ToolProcessPool,
    load_isolated_function_tools,
)
from jaxrl_llm.agent.tools._python import PythonRun, PythonTool, format_run, run_python
from jaxrl_llm.agent.tools._registry import (
    BUILTIN_TOOLS,
    VERL_TOOL_ALIASES,
    get_tool_class,
    load_function_tools,
    load_tools,
)
from jaxrl_llm.agent.tools._run import create_tool_instance, run_tool_call
from jaxrl_llm.agent.tools._schema import FunctionSchema, OpenAIFunctionToolSchema, make_schema
from jaxrl_llm.agent.tools._validate import validate_arguments

__all__ = [
    "BUILTIN_TOOLS",
    "BaseTool",
    "CalculatorError",
    "CalculatorTool",
    "FunctionSchema",
    "FunctionTool",
    "Gsm8kRewardTool",
    "IsolatedFunctionTool",
    "OpenAIFunctionToolSchema",
    "PythonRun",
    "PythonTool",
    "ToolProcessPool",
    "ToolResponse",
    "VERL_TOOL_ALIASES",
    "calculate",
    "create_tool_instance",
    "format_number",
    "format_run",
    "function_tool",
    "load_isolated_function_tools",
    "get_tool_class",
    "load_function_tools",
    "load_tools",
    "make_schema",
    "parse_docstring",
    "run_python",
    "run_tool_call",
    "validate_arguments",
]
