"""Checks a model's tool-call arguments against the tool's JSON schema before the call.

A subset of JSON schema, the part function tools use: object `properties` / `required`,
`type` (integer, number, string, boolean, array, object, null, or a list of them), `enum`,
and array `items`. Arguments the schema does not name are refused. The result is an error
message for the model (its mistake is feedback, not a crash), or None when the call is fine.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

_TYPE_CHECKS = {
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "string": lambda v: isinstance(v, str),
    "boolean": lambda v: isinstance(v, bool),
    "array": lambda v: isinstance(v, list),
    "object": lambda v: isinstance(v, Mapping),
    "null": lambda v: v is None,
}

_JSON_NAMES = {bool: "boolean", int: "integer", float: "number", str: "string",
               list: "array", dict: "object", type(None): "null"}


def _json_type_name(value: Any) -> str:
    return _JSON_NAMES.get(type(value), type(value).__name__)


def _check_value(value: Any, schema: Mapping[str, Any], where: str) -> str | None:
    expected = schema.get("type")
    if expected is not None:
        types = expected if isinstance(expected, list) else [expected]
        if not any(_TYPE_CHECKS.get(t, lambda v: True)(value) for t in types):
            return (f"argument {where} must be {' or '.join(types)}, "
                    f"got {_json_type_name(value)} {value!r}")
    if "enum" in schema and value not in schema["enum"]:
        return f"argument {where} must be one of {schema['enum']!r}, got {value!r}"
    if isinstance(value, list) and isinstance(schema.get("items"), Mapping):
        for i, item in enumerate(value):
            error = _check_value(item, schema["items"], f"{where}[{i}]")
            if error:
                return error
    return None


def validate_arguments(arguments: Any, parameters: Mapping[str, Any], tool_name: str
                       ) -> str | None:
    """None if `arguments` fit the `parameters` schema, else "Error: ..." for the model."""
    if not isinstance(arguments, Mapping):
        return (f"Error: arguments for tool {tool_name!r} must be a JSON object, "
                f"got {_json_type_name(arguments)}.")
    properties = parameters.get("properties", {})
    missing = [name for name in parameters.get("required", []) if name not in arguments]
    if missing:
        return f"Error: missing required argument(s) {missing} for tool {tool_name!r}."
    unknown = [name for name in arguments if name not in properties]
    if unknown:
        return (f"Error: unknown argument(s) {unknown} for tool {tool_name!r} "
                f"(expected: {sorted(properties)}).")
    for name, value in arguments.items():
        error = _check_value(value, properties[name], repr(name))
        if error:
            return f"Error: {error} (tool {tool_name!r})."
    return None
