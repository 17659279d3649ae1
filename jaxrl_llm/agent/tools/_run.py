"""`run_tool_call`: one tool call that cannot crash a rollout. A timeout, an exception, or a
malformed return value becomes an "Error: ..." tool message, reward 0 and
`metrics["error"]` naming the kind ("timeout", "exception", "bad_return"). Cancellation of
the caller is not swallowed."""
from __future__ import annotations

import asyncio
import math
from typing import Any

from jaxrl_llm.agent.tools._base import BaseTool, ToolResponse


def _failure(text: str, kind: str) -> tuple[ToolResponse, float, dict]:
    return ToolResponse(text=text), 0.0, {"error": kind}


def _normalize(tool: BaseTool, result: Any) -> tuple[ToolResponse, float, dict]:
    if not (isinstance(result, tuple) and len(result) == 3):
        return _failure(f"Error: tool {tool.name!r} returned {type(result).__name__}, not "
                        f"(ToolResponse, reward, metrics)", "bad_return")
    response, reward, metrics = result
    if isinstance(response, str):  # verl's older tools return the text itself
        response = ToolResponse(text=response)
    if not isinstance(response, ToolResponse):
        return _failure(f"Error: tool {tool.name!r} returned a {type(response).__name__} "
                        f"response, not a ToolResponse", "bad_return")
    try:
        reward = float(reward)
    except (TypeError, ValueError):
        reward = math.nan
    if not math.isfinite(reward):
        return _failure(f"Error: tool {tool.name!r} returned reward {result[1]!r}, not a "
                        f"finite number", "bad_return")
    return response, reward, dict(metrics or {})


async def run_tool_call(tool: BaseTool, instance_id: str, arguments: Any, *,
                        timeout_s: float = 30.0, **kwargs) -> tuple[ToolResponse, float, dict]:
    """`await tool.execute(instance_id, arguments, **kwargs)` within `timeout_s` seconds (a
    tool with `times_own_calls` keeps its own clock, which starts when the call starts)."""
    if not isinstance(arguments, dict):
        return _failure(f"Error: arguments for tool {tool.name!r} must be a JSON object, "
                        f"got {type(arguments).__name__}.", "invalid_arguments")
    try:
        result = await asyncio.wait_for(tool.execute(instance_id, arguments, **kwargs),
                                        None if tool.times_own_calls else timeout_s)
    except asyncio.TimeoutError:
        return _failure(f"Error: tool {tool.name!r} timed out after {timeout_s:g} s",
                        "timeout")
    except Exception as e:  # noqa: BLE001 - any tool failure is a message, not a crash
        return _failure(f"Error: tool {tool.name!r} failed: {type(e).__name__}: {e}",
                        "exception")
    return _normalize(tool, result)
