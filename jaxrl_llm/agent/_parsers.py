"""Tool-call parsers: the model's text -> (content, tool calls), per chat format.

- `hermes` (Qwen 2.5/3 and other Hermes-style templates): any number of
  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks.
- `llama3_json` (Llama 3.x JSON tool calling): `{"name": ..., "parameters": {...}}` objects
  after `<|python_tag|>`, or as the whole message when it starts with `{` (or a JSON list of
  them), several separated by `;`, newlines or a repeated `<|python_tag|>`.
- `qwen3_coder` (Qwen3-Coder's XML style): `<tool_call><function=NAME><parameter=KEY>VALUE
  </parameter>...</function></tool_call>`; values are converted by the tool's JSON schema when
  `parse` is given the schemas, else JSON-decoded where they are JSON, else kept as text.

The rules, shared with vLLM's and SGLang's parsers (docs/agents.md lists the cases and where
the two disagree): `content` is the text with the valid calls taken out; a call that cannot be
used (bad JSON, no name, wrong fields, an unclosed block) stays in `content` and is also
returned as a `ToolCall` with `error` set and the raw text, so the agent loop can tell the
model what was wrong (vLLM and SGLang drop it silently; drop `error` calls to get theirs);
valid calls before and after a bad one are kept. Nothing here raises on model text.
`format_tool_call` writes a call in a format (for SFT traces). Executing calls is the tools'
business, not this module's.
"""
from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping
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
    """Checks a decoded JSON value is {"name": str, <at most one of args_keys>: dict or a JSON
    string of one} (+ extra_keys with their fixed values); a missing arguments key is {}."""
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
    key = present[0] if present else args_keys[0]
    arguments = obj.get(key, {})
    if isinstance(arguments, str):  # OpenAI style: arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            pass
    if not isinstance(arguments, dict):
        return ToolCall(name, None, raw, f'tool call "{key}" must be a JSON object, '
                        f"got {type(arguments).__name__}")
    return ToolCall(name, arguments, raw)


def _decode(raw: str, args_keys: tuple[str, ...], extra_keys: dict[str, Any]) -> ToolCall:
    try:
        obj = json.loads(raw)
    except json.JSONDecodeError as e:
        return ToolCall(None, None, raw, f"invalid JSON in tool call: {e}")
    return _call_from_object(obj, raw, args_keys, extra_keys)


def _join(parts: list[str]) -> str:
    return "".join(parts).strip()


class ToolParser:
    """`parse(text, tools) -> (content, calls)` and `format(name, arguments) -> text` for a
    format. `tools`: {tool name: its parameters JSON schema}, used by formats whose values are
    untyped text (qwen3_coder); the JSON formats ignore it."""

    name: str = ""

    def parse(self, text: str, tools: Mapping[str, Mapping] | None = None
              ) -> tuple[str, list[ToolCall]]:
        raise NotImplementedError

    def format(self, name: str, arguments: dict[str, Any]) -> str:
        raise NotImplementedError


class _TaggedBlocks(ToolParser):
    """Formats of `<tool_call>BODY</tool_call>` blocks; a block left open at the end of the
    text is parsed if its body is complete (vLLM's "tool call until EOS")."""

    _OPEN, _CLOSE = "<tool_call>", "</tool_call>"

    def _body(self, body: str, tools) -> ToolCall:
        raise NotImplementedError

    def _open_body(self, body: str, tools) -> ToolCall:
        call = self._body(body, tools)
        if call.error is not None:
            return ToolCall(None, None, self._OPEN + body, f"{self._OPEN} without {self._CLOSE}")
        return call

    def parse(self, text, tools=None):
        content, calls, pos = [], [], 0
        while (start := text.find(self._OPEN, pos)) >= 0:
            content.append(text[pos:start])
            end = text.find(self._CLOSE, start)
            if end < 0:  # left open: cut off by the length limit, or the model never closed it
                call = self._open_body(text[start + len(self._OPEN):], tools)
                pos = len(text)
            else:
                call = self._body(text[start + len(self._OPEN):end].strip(), tools)
                pos = end + len(self._CLOSE)
            calls.append(call)
            if call.error is not None:
                content.append(text[start:pos])
        content.append(text[pos:])
        return _join(content), calls


class HermesToolParser(_TaggedBlocks):
    name = "hermes"

    def _body(self, body, tools):
        return _decode(body.strip(), ("arguments", "parameters"), {})

    def format(self, name: str, arguments: dict[str, Any]) -> str:
        body = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
        return f"<tool_call>\n{body}\n</tool_call>"


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    _TAG = "<|python_tag|>"
    _ARGS_KEYS = ("parameters", "arguments")
    _EXTRA = {"type": "function"}
    _SEPARATORS = re.compile(r"(?:\s|;|<\|python_tag\|>)*")
    _NEXT_CALL = re.compile(r'\{\s*"name"\s*:')

    def parse(self, text, tools=None):
        tag = text.find(self._TAG)
        if tag >= 0:
            before, region = text[:tag], text[tag + len(self._TAG):]
        elif text.lstrip().startswith(("{", "[")):
            before, region = "", text.lstrip()
        else:
            return text.strip(), []
        content, calls = self._parse_region(region, tagged=tag >= 0)
        if tag >= 0 and not calls and not region.lstrip().startswith(("{", "[")):
            calls = [ToolCall(None, None, region.strip(), "<|python_tag|> not followed by a "
                              "JSON tool call")]
        return _join([before, content]), calls

    def _parse_region(self, region: str, tagged: bool) -> tuple[str, list[ToolCall]]:
        """Calls one after another; text between them that is no call is content, and a
        malformed call is skipped up to the next `{"name":` (SGLang's recovery)."""
        decoder, content, calls, pos = json.JSONDecoder(), [], [], 0
        while True:
            pos = self._SEPARATORS.match(region, pos).end()
            if pos >= len(region):
                return _join(content), calls
            stop = pos
            if region[pos] in "{[":
                try:
                    obj, stop = decoder.raw_decode(region, pos)
                    found = self._calls(obj, region[pos:stop], tagged)
                except json.JSONDecodeError as e:
                    found = None
                    if tagged or self._NEXT_CALL.match(region, pos):  # it was meant as a call
                        stop = self._next_call(region, pos)
                        calls.append(ToolCall(None, None, region[pos:stop].strip(),
                                              f"invalid JSON in tool call: {e}"))
                calls += found or []
                if found and not any(c.error for c in found):
                    pos = stop
                    continue
            # prose, JSON that is no call, a bad call: content up to the next call, if any
            stop = max(stop, self._next_call(region, pos))
            content.append(region[pos:stop])
            pos = stop

    def _next_call(self, region: str, pos: int) -> int:
        nxt = self._NEXT_CALL.search(region, pos + 1)
        return nxt.start() if nxt else len(region)

    def _calls(self, obj: Any, raw: str, tagged: bool) -> list[ToolCall]:
        """The calls a decoded value holds ([] when it is no call: JSON without a "name" in
        plain text stays content, as both vLLM and SGLang keep it)."""
        items = obj if isinstance(obj, list) else [obj]
        if not tagged and not all(isinstance(o, dict) and "name" in o for o in items):
            return []
        if not items:
            return []
        one = len(items) == 1 and not isinstance(obj, list)
        return [_call_from_object(o, raw if one else json.dumps(o, ensure_ascii=False),
                                  self._ARGS_KEYS, self._EXTRA) for o in items]

    def format(self, name: str, arguments: dict[str, Any]) -> str:
        return json.dumps({"name": name, "parameters": arguments}, ensure_ascii=False)


class Qwen3CoderToolParser(_TaggedBlocks):
    name = "qwen3_coder"
    _FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)(?:</function>|\Z)", re.DOTALL)
    _PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|\Z)",
                            re.DOTALL)

    def _body(self, body, tools):
        m = self._FUNCTION.fullmatch(body.strip())
        if m is None:
            return ToolCall(None, None, body, "tool call must be <function=NAME>"
                            "<parameter=KEY>VALUE</parameter>...</function>")
        if not m.group(0).rstrip().endswith("</function>"):
            return ToolCall(None, None, body, "<function=...> without </function>")
        name = m.group(1).strip()
        schema = ((tools or {}).get(name) or {}).get("properties") or {}
        arguments = {}
        for p in self._PARAMETER.finditer(m.group(2)):
            key = p.group(1).strip()
            arguments[key] = _convert(_strip_newline(p.group(2)), (schema.get(key) or {}))
        return ToolCall(name, arguments, body)

    def format(self, name: str, arguments: dict[str, Any]) -> str:
        def text(v):
            return v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)
        params = "".join(f"<parameter={k}>\n{text(v)}\n</parameter>\n"
                         for k, v in arguments.items())
        return f"<tool_call>\n<function={name}>\n{params}</function>\n</tool_call>"


def _strip_newline(value: str) -> str:
    """A value without the one newline the format puts after `>` and before `</parameter>`."""
    value = value[1:] if value.startswith("\n") else value
    return value[:-1] if value.endswith("\n") else value


def _convert(value: str, schema: Mapping[str, Any]) -> Any:
    """A qwen3_coder value as its JSON schema type says (string: as written); without a type,
    the JSON value it spells, else the text."""
    kind = schema.get("type")
    if kind == "string" or (isinstance(kind, list) and "string" in kind):
        return value
    try:
        decoded = json.loads(value)
    except json.JSONDecodeError:
        return value
    if kind == "integer" and isinstance(decoded, float) and decoded.is_integer():
        return int(decoded)
    return decoded


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser, "llama3_json": Llama3JsonToolParser,
    "qwen3_coder": Qwen3CoderToolParser}


def get_tool_parser(format: str) -> ToolParser:
    """The parser for `format` (one of TOOL_PARSERS)."""
    if format not in TOOL_PARSERS:
        raise ValueError(f"unknown tool-call format {format!r}; known: {sorted(TOOL_PARSERS)}")
    return TOOL_PARSERS[format]()


def format_tool_call(name: str, arguments: dict[str, Any], format: str) -> str:
    """One call written as the model should write it in `format`."""
    return get_tool_parser(format).format(name, arguments)
