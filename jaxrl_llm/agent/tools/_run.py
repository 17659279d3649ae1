"""`run_tool_call`: one tool call that cannot crash a rollout. A timeout, an exception, or a
malformed return value becomes an "Error: ..." tool message, reward 0 and
`metrics["error"]` naming the kind ("timeout", "exception", "bad_return"). Cancellation of
the caller is not swallowed. `create_tool_instance`: `create` with verl's calling
conventions (see `BaseTool.create_arguments`).

Return forms accepted from `execute` (verl's): `(response, reward, metrics)` where response
is a `ToolResponse`, any object with a `text` attribute (verl's own pydantic ToolResponse),
or a plain string; reward None counts as 0.0 and metrics None as {}. From `create`: an
`(instance_id, response)` pair or a bare instance id (older verl tools)."""
from __future__ import annotations

import asyncio
import math
from typing import Any

from jaxrl_llm.agent.tools._base import BaseTool, ToolResponse


def _failure(text: str, kind: str) -> tuple[ToolResponse, float, dict]:
    return ToolResponse(text=text), 0.0, {"error": kind}


def _text_response(tool: BaseTool, response: Any) -> ToolResponse | str:
    """A ToolResponse with str text, or the error message when `response` is none of the
    accepted forms or carries images / videos."""
    if isinstance(response, str):  # verl's older tools return the text itself
        return ToolResponse(text=response)
    if not hasattr(response, "text"):
        return (f"Error: tool {tool.name!r} returned a {type(response).__name__} response, "
                f"not a ToolResponse")
    if getattr(response, "image", None) or getattr(response, "video", None):
        return (f"Error: tool {tool.name!r} returned images or videos; this agent loop "
                f"serves text-only models (give the result as text)")
    text = response.text
    if text is not None and not isinstance(text, str):
        return f"Error: tool {tool.name!r} returned text of type {type(text).__name__}"
    return response if isinstance(response, ToolResponse) and text is not None else \
        ToolResponse(text=text or "")


def _normalize(tool: BaseTool, result: Any) -> tuple[ToolResponse, float, dict]:
    if not (isinstance(result, tuple) and len(result) == 3):
        return _failure(f"Error: tool {tool.name!r} returned {type(result).__name__}, not "
                        f"(ToolResponse, reward, metrics)", "bad_return")
    response, reward, metrics = result
    response = _text_response(tool, response)
    if isinstance(response, str):
        return _failure(response, "bad_return")
    if reward is None:  # verl's loop skips a None step reward
        reward = 0.0
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


async def create_tool_instance(tool: BaseTool, create_kwargs: dict[str, Any]) -> Any:
    """`tool.create(...)` for one trajectory with a row's `create_kwargs` (verl's conventions,
    see `BaseTool.create_arguments`); the instance id. Accepts `(id, response)` or a bare id;
    the response is not shown to the model (verl's agent loop drops it too). TypeError naming
    the tool for any other return value."""
    result = await tool.create(**tool.create_arguments(create_kwargs))
    instance_id = result[0] if isinstance(result, tuple) and len(result) == 2 else result
    if instance_id is None or isinstance(instance_id, (tuple, list, dict)):
        raise TypeError(f"tool {tool.name!r}: create returned {result!r:.80}; expected an "
                        f"instance id or (instance_id, response)")
    return instance_id
