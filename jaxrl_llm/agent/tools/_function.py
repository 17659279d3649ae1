"""`@function_tool`: a plain Python function (sync or async) as a tool.

The JSON schema comes from the signature (int -> integer, float -> number, str -> string,
bool -> boolean, list[X] -> array of X, dict -> object, Literal[...] -> enum, X | None -> X;
a parameter with a default is not required) and the docstring (first paragraph ->
description; a Google-style "Args:" section -> parameter descriptions). Calls are checked
against the schema first; a bad call returns an error message to the model. A sync function
runs in a worker thread so it cannot stall the event loop.
"""
from __future__ import annotations

import asyncio
import inspect
import json
import re
import types
import typing
from collections.abc import Callable
from typing import Any, Literal

from jaxrl_llm.agent.tools._base import BaseTool, ToolResponse
from jaxrl_llm.agent.tools._schema import make_schema

_SCALARS = {int: "integer", float: "number", str: "string", bool: "boolean"}
_SECTION = re.compile(r"^(Args|Arguments|Parameters|Returns?|Raises|Yields?|Examples?|Notes?)"
                      r"\s*:\s*$")
_ARG_LINE = re.compile(r"^(\*{0,2}\w+)\s*(\([^)]*\))?\s*:\s*(.*)$")


def _json_schema(annotation: Any, where: str) -> dict[str, Any]:
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if annotation in _SCALARS:
        return {"type": _SCALARS[annotation]}
    if annotation is list or origin is list:
        return {"type": "array", **({"items": _json_schema(args[0], where)} if args else {})}
    if annotation is dict or origin is dict:
        return {"type": "object"}
    if origin is Literal:
        kinds = {type(a) for a in args}
        schema = {"enum": list(args)}
        if len(kinds) == 1 and next(iter(kinds)) in _SCALARS:
            schema = {"type": _SCALARS[next(iter(kinds))], **schema}
        return schema
    if origin in (typing.Union, types.UnionType):
        rest = [a for a in args if a is not type(None)]
        if len(rest) == 1:
            return _json_schema(rest[0], where)
    raise TypeError(f"function_tool {where}: cannot turn type {annotation!r} into a JSON schema; "
                    f"use int, float, str, bool, list[...], dict, Literal[...] or X | None")


def parse_docstring(doc: str | None) -> tuple[str, dict[str, str]]:
    """(description = first paragraph, {arg: description} from a Google-style Args section)."""
    lines = inspect.cleandoc(doc or "").splitlines()
    first: list[str] = []
    for line in lines:
        if not line.strip() or _SECTION.match(line.strip()):
            break
        first.append(line.strip())
    args: dict[str, str] = {}
    in_args, current, indent = False, None, None
    for line in lines:
        stripped = line.strip()
        header = _SECTION.match(stripped)
        if header and len(line) - len(line.lstrip()) == 0:
            in_args, current, indent = header.group(1) in ("Args", "Arguments", "Parameters"), \
                None, None
            continue
        if not in_args or not stripped:
            continue
        depth = len(line) - len(line.lstrip())
        match = _ARG_LINE.match(stripped)
        if match and (indent is None or depth <= indent):
            indent, current = depth, match.group(1).lstrip("*")
            args[current] = match.group(3).strip()
        elif current is not None:
            args[current] = f"{args[current]} {stripped}".strip()
    return " ".join(first), args


def _parameters_schema(fn: Callable, arg_docs: dict[str, str]) -> tuple[dict, list[str]]:
    hints = typing.get_type_hints(fn)
    properties, required = {}, []
    for param in inspect.signature(fn).parameters.values():
        where = f"{fn.__name__}({param.name})"
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD, param.POSITIONAL_ONLY):
            raise TypeError(f"function_tool {where}: *args, **kwargs and positional-only "
                            f"parameters cannot be tool arguments; name each parameter")
        if param.name not in hints:
            raise TypeError(f"function_tool {where}: add a type hint (int, float, str, bool, "
                            f"list[...], Literal[...]) so the schema can say what to pass")
        schema = _json_schema(hints[param.name], where)
        if param.name in arg_docs:
            schema["description"] = arg_docs[param.name]
        properties[param.name] = schema
        if param.default is param.empty:
            required.append(param.name)
    return properties, required


def _to_text(result: Any) -> str:
    if isinstance(result, str):
        return result
    try:
        return json.dumps(result, ensure_ascii=False)
    except (TypeError, ValueError):
        return str(result)


class FunctionTool(BaseTool):
    """A tool wrapping `fn`; stateless, so one object serves every trajectory. Calling the
    object calls `fn` directly."""

    def __init__(self, fn: Callable, *, name: str | None = None,
                 description: str | None = None):
        doc_description, arg_docs = parse_docstring(fn.__doc__)
        properties, required = _parameters_schema(fn, arg_docs)
        super().__init__(tool_schema=make_schema(
            name or fn.__name__, doc_description if description is None else description,
            properties, required))
        self.fn = fn
        self._is_async = inspect.iscoroutinefunction(fn)

    def __call__(self, *args, **kwargs):
        return self.fn(*args, **kwargs)

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs
                      ) -> tuple[ToolResponse, float, dict]:
        error = self.validate_arguments(parameters)
        if error:
            return ToolResponse(text=error), 0.0, {"error": "invalid_arguments"}
        if self._is_async:
            result = await self.fn(**parameters)
        else:
            result = await asyncio.to_thread(self.fn, **parameters)
        if isinstance(result, ToolResponse):
            return result, 0.0, {}
        return ToolResponse(text=_to_text(result)), 0.0, {}


def function_tool(fn: Callable | None = None, *, name: str | None = None,
                  description: str | None = None):
    """`@function_tool` or `@function_tool(name=..., description=...)`: fn -> FunctionTool."""
    if fn is None:
        return lambda f: FunctionTool(f, name=name, description=description)
    return FunctionTool(fn, name=name, description=description)
