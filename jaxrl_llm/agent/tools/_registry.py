"""Finding tools: built-ins by name, tool config files in verl's format, and files of
`@function_tool` functions.

A tool config (YAML or JSON):

    tools:
      - class_name: calculator                  # a built-in name, or "package.module.Class"
        config: {max_exponent: 100}             # passed to the class (optional)
      - class_name: my_pkg.tools.SearchTool
        config: {type: native}
        tool_schema: {type: function, function: {name: search, description: ..., parameters: ...}}
"""
from __future__ import annotations

import os

from jaxrl_llm.agent.tools._base import BaseTool
from jaxrl_llm.agent.tools._calculator import CalculatorTool
from jaxrl_llm.agent.tools._files import (
    config_entries,
    import_file,
    read_config_file,
    resolve_class,
)
from jaxrl_llm.agent.tools._function import FunctionTool
from jaxrl_llm.agent.tools._gsm8k import Gsm8kRewardTool
from jaxrl_llm.agent.tools._python import PythonTool
from jaxrl_llm.agent.tools._schema import OpenAIFunctionToolSchema
from jaxrl_llm.sandbox import Sandbox

BUILTIN_TOOLS: dict[str, type[BaseTool]] = {"calculator": CalculatorTool, "python": PythonTool,
                                            "gsm8k_reward": Gsm8kRewardTool}
# verl's example tool classes -> our built-ins that behave alike, so verl's example tool
# configs load unchanged (verl's own classes subclass verl's BaseTool and import verl)
VERL_TOOL_ALIASES: dict[str, str] = {"verl.tools.gsm8k_tool.Gsm8kTool": "gsm8k_reward"}
_SANDBOXED_BUILTINS = {"python"}  # built-ins that run model-written code: they take `sandbox=`
_ENTRY_KEYS = {"class_name", "config", "tool_schema"}


def get_tool_class(name: str) -> type[BaseTool]:
    """A built-in tool class by name (or by the verl class path it stands in for), or a
    BaseTool subclass by "module.Class" path."""
    return resolve_class(VERL_TOOL_ALIASES.get(name, name), BUILTIN_TOOLS, BaseTool, "tool",
                         "jaxrl_llm.agent.tools.BaseTool")


def _add(tools: dict[str, BaseTool], tool: BaseTool, source: str) -> None:
    if tool.name in tools:
        raise ValueError(f"{source}: two tools are named {tool.name!r}; tool names must be "
                         f"unique (the model calls tools by name)")
    tools[tool.name] = tool


def _build(entry: dict, where: str, isolated: dict | None = None,
           sandbox: str | Sandbox = "auto") -> BaseTool:
    unknown = set(entry) - _ENTRY_KEYS
    if unknown or "class_name" not in entry:
        raise ValueError(f"{where}: each tool needs 'class_name' and may have 'config' and "
                         f"'tool_schema'; got keys {sorted(entry)}")
    entry = {**entry, "class_name": VERL_TOOL_ALIASES.get(entry["class_name"], entry["class_name"])}
    kind = (entry.get("config") or {}).get("type", "native")
    if kind != "native":
        raise ValueError(f"{where}: config.type {kind!r} is not supported (verl's MCP tools are "
                         f"not); only 'native' tools, which run in this trainer")
    if isolated is not None and entry["class_name"] not in BUILTIN_TOOLS:
        from jaxrl_llm.agent.tools._remote import RemoteTool

        get_tool_class(entry["class_name"])  # a bad class name is an error here, not in a child
        return RemoteTool(entry["class_name"], entry.get("config"), entry.get("tool_schema"),
                          sandbox=sandbox, **isolated)
    schema = entry.get("tool_schema")
    if schema is not None:
        schema = OpenAIFunctionToolSchema.from_dict(schema)
    kwargs = {"sandbox": sandbox} if entry["class_name"] in _SANDBOXED_BUILTINS else {}
    return get_tool_class(entry["class_name"])(config=entry.get("config") or {},
                                               tool_schema=schema, **kwargs)


def load_tools(tool_config_path: str | os.PathLike, *, isolated: dict | None = None,
               sandbox: str | Sandbox = "auto") -> dict[str, BaseTool]:
    """{tool name: tool} from a tool config file (format above), in file order.

    isolated: `{"timeout_s": ..., "memory_limit_gb": ...}` runs every class that is not a
    built-in in a process of its own (`RemoteTool`); None builds them all in this process.
    sandbox: the backend (name or `Sandbox`) of the built-ins that run model-written code
    (`python`)."""
    entries = config_entries(read_config_file(tool_config_path), "tools", tool_config_path)
    tools: dict[str, BaseTool] = {}
    for i, entry in enumerate(entries):
        _add(tools, _build(entry, f"{os.fspath(tool_config_path)}: tools[{i}]", isolated,
                           sandbox), os.fspath(tool_config_path))
    return tools


def load_function_tools(function_tool_path: str | os.PathLike) -> dict[str, FunctionTool]:
    """{tool name: tool} for every `@function_tool` object at the top level of a .py file."""
    module = import_file(function_tool_path, "jaxrl_llm_function_tools")
    tools: dict[str, BaseTool] = {}
    for value in vars(module).values():
        if isinstance(value, FunctionTool):
            _add(tools, value, os.fspath(function_tool_path))
    if not tools:
        raise ValueError(f"{os.fspath(function_tool_path)} defines no @function_tool "
                         f"functions (decorate them with jaxrl_llm.agent.tools.function_tool)")
    return tools
