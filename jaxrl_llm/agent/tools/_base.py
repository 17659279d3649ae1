"""The tool interface, with verl's async lifecycle: one tool object serves many rollouts, each
rollout's state is keyed by the `instance_id` that `create` returns.

    instance_id, _ = await tool.create(**create_kwargs)        # per trajectory
    response, reward, metrics = await tool.execute(instance_id, arguments)   # per call
    reward = await tool.calc_reward(instance_id)               # at the end
    await tool.release(instance_id)

Running a call safely (timeouts, exceptions) is `run_tool_call`'s job, not the tool's.
"""
from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Mapping
from typing import Any

from jaxrl_llm.agent.tools._schema import OpenAIFunctionToolSchema
from jaxrl_llm.agent.tools._validate import validate_arguments


@dataclasses.dataclass(frozen=True)
class ToolResponse:
    """What the model reads back as the tool message."""

    text: str = ""


class BaseTool:
    """Subclass and override `execute` (and `create`/`calc_reward`/`release` if the tool
    keeps per-trajectory state). Built-in tools set `default_tool_schema()`; a custom class
    may instead get its schema from the tool config's `tool_schema:` block."""

    # True when `execute` enforces the per-call timeout itself, from the moment the call starts
    # running (IsolatedFunctionTool: not while it waits for a free worker); `run_tool_call`
    # then adds no clock of its own
    times_own_calls: bool = False

    def __init__(self, config: Mapping[str, Any] | None = None,
                 tool_schema: OpenAIFunctionToolSchema | Mapping[str, Any] | None = None):
        self.config = dict(config or {})
        if tool_schema is None:
            tool_schema = self.default_tool_schema()
        if isinstance(tool_schema, Mapping):
            tool_schema = OpenAIFunctionToolSchema.from_dict(tool_schema)
        if tool_schema is None:
            raise ValueError(f"{type(self).__name__} has no tool schema: give `tool_schema:` "
                             f"in the tool config or override default_tool_schema()")
        self.tool_schema: OpenAIFunctionToolSchema = tool_schema

    @classmethod
    def default_tool_schema(cls) -> OpenAIFunctionToolSchema | None:
        return None

    @property
    def name(self) -> str:
        return self.tool_schema.function.name

    def get_openai_tool_schema(self) -> OpenAIFunctionToolSchema:
        return self.tool_schema

    def validate_arguments(self, parameters: Any) -> str | None:
        """None if `parameters` fit this tool's schema, else an error message for the model."""
        return validate_arguments(parameters, self.tool_schema.function.parameters, self.name)

    async def create(self, instance_id: str | None = None, **kwargs
                     ) -> tuple[str, ToolResponse | None]:
        """Starts one trajectory's use of the tool; returns its id (a new uuid if None)."""
        return instance_id or str(uuid.uuid4()), None

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs
                      ) -> tuple[ToolResponse, float, dict]:
        """One call: (response for the model, step reward, metrics)."""
        raise NotImplementedError(f"{type(self).__name__} must implement execute()")

    async def calc_reward(self, instance_id: str, **kwargs) -> float:
        return 0.0

    async def release(self, instance_id: str, **kwargs) -> None:
        return None

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


def check_config_keys(tool: str, config: Mapping[str, Any], allowed: set[str]) -> None:
    """ValueError naming unknown keys in a built-in tool's `config:` (a typo is not ignored).
    verl's `type: native` is accepted everywhere."""
    unknown = set(config) - allowed - {"type"}
    if unknown:
        raise ValueError(f"tool {tool!r}: unknown config keys {sorted(unknown)}; "
                         f"allowed: {sorted(allowed)}")
    if config.get("type", "native") != "native":
        raise ValueError(f"tool {tool!r}: only config type 'native' is supported, "
                         f"got {config['type']!r}")
