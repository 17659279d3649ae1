"""Tool-call parsers: the model's text -> (content, tool calls), per chat format.

- `hermes` (Qwen 2.5/3 and other Hermes-style templates): any number of
  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks; text outside them is the
  message content.
- `llama3_json` (Llama 3.x JSON tool calling): the whole message is
  `{"name": ..., "parameters": {...}}`, optionally after `<|python_tag|>`, several separated
  by `;`. A message that does not start with `{` is plain content.

A malformed call never raises: it comes back as a `ToolCall` with `error` set and the raw
text, so the agent loop can tell the model what was wrong. `format_tool_call` writes a call in
a format (for SFT traces). Executing calls is the tools' business, not this module's.
"""
from __future__ import annotations

import dataclasses
import json
import re
from typing import Any


@dataclasses.dataclass(frozen=True)
class ToolCall:
    """One call as the model wrote it. `error` is None when `name` and `arguments` are usable."""

    name: str | None
    arguments: dict[str, Any] | None
    raw: str
    error: str | None = None


def _call_from_object(obj: Any, raw: str, args_keys: tuple[str, ...],
                      extra_keys: dict[str, Any]) -> ToolCall:
    """Checks a decoded JSON value is {"name": str, <one of args_keys>: dict} (+ extra_keys
    with their fixed values)."""
    if not isinstance(obj, dict):
        return ToolCall(None, None, raw, f"tool call must be a JSON object, got {obj!r:.80}")
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return ToolCall(None, None, raw, 'tool call has no "name" string')
    allowed = {"name", *args_keys, *extra_keys}
    unknown = sorted(set(obj) - allowed)
    wrong = [k for k, v in extra_keys.items() if k in obj and obj[k] != v]
    if unknown or wrong:
        return ToolCall(name, None, raw, f"tool call has unknown or wrong fields "
                        f"{unknown + wrong}; expected {sorted(allowed)}")
    present = [k for k in args_keys if k in obj]
    if len(present) > 1:
        return ToolCall(name, None, raw, f"tool call has both {present}; give one")
    arguments = obj[present[0]] if present else {}
    if isinstance(arguments, str):  # OpenAI style: arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            pass
    if not isinstance(arguments, dict):
        return ToolCall(name, None, raw, f'tool call "{args_keys[0]}" must be a JSON object, '
                        f"got {type(arguments).__name__}")
    return ToolCall(name, arguments, raw)


def _decode(raw: str, args_keys: tuple[str, ...], extra_keys: dict[str, Any]) -> ToolCall:
    try:
        obj = json.loads(raw)
    except json.JSONDecodeError as e:
        return ToolCall(None, None, raw, f"invalid JSON in tool call: {e}")
    return _call_from_object(obj, raw, args_keys, extra_keys)


class ToolParser:
    """`parse(text) -> (content, calls)` and `format(name, arguments) -> text` for a format."""

    name: str = ""

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        raise NotImplementedError

    def format(self, name: str, arguments: dict[str, Any]) -> str:
        raise NotImplementedError


class HermesToolParser(ToolParser):
    name = "hermes"
    _BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
    _OPEN = "<tool_call>"

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        calls = [_decode(m.group(1).strip(), ("arguments",), {})
                 for m in self._BLOCK.finditer(text)]
        content = self._BLOCK.sub("", text)
        start = content.find(self._OPEN)
        if start >= 0:  # a call cut off (e.g. by the length limit) or never closed
            raw = content[start:]
            calls.append(ToolCall(None, None, raw, "<tool_call> without </tool_call>"))
            content = content[:start]
        return content.strip(), calls

    def format(self, name: str, arguments: dict[str, Any]) -> str:
        body = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
        return f"<tool_call>\n{body}\n</tool_call>"


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    _TAG = "<|python_tag|>"
    _ARGS_KEYS = ("parameters", "arguments")
    _EXTRA = {"type": "function"}

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        body = text.strip()
        tagged = body.startswith(self._TAG)
        body = body[len(self._TAG):].strip() if tagged else body
        if not body.startswith("{"):
            if tagged:
                return "", [ToolCall(None, None, body, "<|python_tag|> not followed by a "
                                     "JSON tool call")]
            return text.strip(), []
        return self._parse_calls(body)

    def _parse_calls(self, body: str) -> tuple[str, list[ToolCall]]:
        decoder, calls, pos = json.JSONDecoder(), [], 0
        while pos < len(body):
            try:
                obj, end = decoder.raw_decode(body, pos)
            except json.JSONDecodeError as e:
                calls.append(ToolCall(None, None, body[pos:], f"invalid JSON in tool call: {e}"))
                return "", calls
            calls.append(_call_from_object(obj, body[pos:end], self._ARGS_KEYS, self._EXTRA))
            rest = body[end:].lstrip()
            if not rest.startswith(";"):
                return rest.strip(), calls  # trailing prose after the calls is content
            pos = len(body) - len(rest[1:].lstrip())
        return "", calls

    def format(self, name: str, arguments: dict[str, Any]) -> str:
        return json.dumps({"name": name, "parameters": arguments}, ensure_ascii=False)


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser, "llama3_json": Llama3JsonToolParser}


def get_tool_parser(format: str) -> ToolParser:
    """The parser for `format` ("hermes" or "llama3_json")."""
    if format not in TOOL_PARSERS:
        raise ValueError(f"unknown tool-call format {format!r}; known: {sorted(TOOL_PARSERS)}")
    return TOOL_PARSERS[format]()


def format_tool_call(name: str, arguments: dict[str, Any], format: str) -> str:
    """One call written as the model should write it in `format`."""
    return get_tool_parser(format).format(name, arguments)
