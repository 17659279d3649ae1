"""The tool interface, with verl's async lifecycle: one tool object serves many rollouts, each
rollout's state is keyed by the `instance_id` that `create` returns.

    instance_id, _ = await tool.create(**create_kwargs)        # per trajectory (see
                                                               # `create_tool_instance`)
    response, reward, metrics = await tool.execute(instance_id, arguments)   # per call
    reward = await tool.calc_reward(instance_id)               # at the end
    await tool.release(instance_id)

Running a call safely (timeouts, exceptions) is `run_tool_call`'s job, not the tool's.
"""
from __future__ import annotations

import dataclasses
import inspect
import uuid
from collections.abc import Mapping
from typing import Any

from jaxrl_llm.agent.tools._schema import OpenAIFunctionToolSchema
from jaxrl_llm.agent.tools._validate import validate_arguments


@dataclasses.dataclass(frozen=True)
class ToolResponse:
    """What the model reads back as the tool message. `image` / `video` exist so a tool
    written for verl constructs the same way; the agent loop refuses a response that fills
    them (text-only models; see docs/agents.md "Compatibility with verl")."""

    text: str | None = ""
    image: list[Any] | None = None
    video: list[Any] | None = None


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
        """Starts one trajectory's use of the tool; returns its id (a new uuid if None) and
        an optional response (which the agent loop does not show the model, like verl's).
        The loop passes the row's `create_kwargs` unpacked and, when this signature takes
        `create_kwargs` or `**kwargs`, also as `create_kwargs=` (verl's agent loop)."""
        return instance_id or str(uuid.uuid4()), None

    def create_arguments(self, create_kwargs: Mapping[str, Any]) -> dict[str, Any]:
        """The keyword arguments the agent loop calls `create` with for a row's
        `create_kwargs` (see `create_arguments`)."""
        return create_arguments(type(self).create, create_kwargs)

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


def create_arguments(create: Any, create_kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """Keyword arguments for `create(**them)` that serve tools written for either verl
    convention: verl's agent loop calls `create(create_kwargs={...})`, its older SGLang rollout
    (and ours) `create(**create_kwargs)`. The keys go unpacked, and the dict also goes as
    `create_kwargs=` when `create` names that parameter or takes `**kwargs`; a `create` that
    names `create_kwargs` but takes no `**kwargs` gets only the unpacked keys it names."""
    unpacked = dict(create_kwargs)
    try:
        params = inspect.signature(create).parameters.values()
    except (TypeError, ValueError):  # no signature to read: the unpacked form only
        return unpacked
    names = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    var_kw = any(p.kind is p.VAR_KEYWORD for p in params)
    if "create_kwargs" in unpacked or not (var_kw or "create_kwargs" in names):
        return unpacked
    if not var_kw:
        unpacked = {k: v for k, v in unpacked.items() if k in names - {"self", "instance_id"}}
    return {**unpacked, "create_kwargs": dict(create_kwargs)}


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
