"""The OpenAI function-tool schema a tool advertises to the model (verl's
`OpenAIFunctionToolSchema`): `{"type": "function", "function": {name, description, parameters}}`
where `parameters` is a JSON schema of an object. Plain frozen dataclasses; no pydantic."""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

_FUNCTION_KEYS = {"name", "description", "parameters", "strict"}


@dataclasses.dataclass(frozen=True)
class FunctionSchema:
    """`name` as the model calls it; `parameters` a JSON schema with "type": "object"."""

    name: str
    description: str = ""
    parameters: dict[str, Any] = dataclasses.field(
        default_factory=lambda: {"type": "object", "properties": {}, "required": []})

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"tool schema: function.name must be a non-empty string, "
                             f"got {self.name!r}")
        if not isinstance(self.parameters, Mapping) or self.parameters.get("type") != "object":
            raise ValueError(f"tool schema {self.name!r}: function.parameters must be a JSON "
                             f'schema with "type": "object", got {self.parameters!r}')


@dataclasses.dataclass(frozen=True)
class OpenAIFunctionToolSchema:
    """One tool as the chat template and the model see it."""

    function: FunctionSchema
    type: str = "function"

    @property
    def name(self) -> str:
        return self.function.name

    def to_dict(self) -> dict[str, Any]:
        """The JSON-able dict a chat template's `tools=` takes."""
        return {"type": self.type,
                "function": {"name": self.function.name,
                             "description": self.function.description,
                             "parameters": dict(self.function.parameters)}}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> OpenAIFunctionToolSchema:
        """Reads verl's `tool_schema:` block; ValueError naming the bad key."""
        if not isinstance(data, Mapping):
            raise ValueError(f"tool_schema must be a mapping, got {type(data).__name__}")
        if data.get("type", "function") != "function":
            raise ValueError(f'tool_schema type must be "function", got {data.get("type")!r}')
        function = data.get("function")
        if not isinstance(function, Mapping):
            raise ValueError(f"tool_schema needs a 'function' mapping with name, description "
                             f"and parameters; got keys {sorted(data)}")
        unknown = set(function) - _FUNCTION_KEYS
        if unknown:
            raise ValueError(f"tool_schema.function has unknown keys {sorted(unknown)}; "
                             f"allowed: {sorted(_FUNCTION_KEYS)}")
        parameters = function.get("parameters", {"type": "object", "properties": {}})
        return cls(FunctionSchema(name=function.get("name"),
                                  description=function.get("description", ""),
                                  parameters=dict(parameters)
                                  if isinstance(parameters, Mapping) else parameters))


def make_schema(name: str, description: str, properties: dict[str, Any],
                required: list[str]) -> OpenAIFunctionToolSchema:
    """Shorthand for a tool whose parameters are `properties` (no extra keys allowed)."""
    return OpenAIFunctionToolSchema(FunctionSchema(
        name=name, description=description,
        parameters={"type": "object", "properties": properties, "required": list(required)}))
