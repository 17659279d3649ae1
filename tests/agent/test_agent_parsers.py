"""Tool-call parsers: hermes and llama3_json, valid and malformed calls, and formatting."""
import pytest

from jaxrl_llm.agent._parsers import (
    HermesToolParser,
    Llama3JsonToolParser,
    ToolCall,
    format_tool_call,
    get_tool_parser,
)


def parse(format, text):
    return get_tool_parser(format).parse(text)


# ---------------------------------------------------------------- hermes

def test_hermes_parses_one_call_and_keeps_surrounding_text_as_content():
    text = ('Let me compute.\n<tool_call>\n{"name": "calculator", "arguments": '
            '{"expression": "1+2"}}\n</tool_call>')
    content, calls = parse("hermes", text)
    assert content == "Let me compute."
    assert calls == [ToolCall("calculator", {"expression": "1+2"},
                              '{"name": "calculator", "arguments": {"expression": "1+2"}}')]


def test_hermes_parses_several_calls_in_order():
    text = ('<tool_call>{"name": "a", "arguments": {"x": 1}}</tool_call> and '
            '<tool_call>{"name": "b", "arguments": {}}</tool_call> done')
    content, calls = parse("hermes", text)
    assert content == "and  done"
    assert [(c.name, c.arguments, c.error) for c in calls] == [("a", {"x": 1}, None),
                                                               ("b", {}, None)]


def test_hermes_without_calls_returns_text_unchanged():
    assert parse("hermes", "  The answer is 4.  ") == ("The answer is 4.", [])


@pytest.mark.parametrize("body, error", [
    ('{"name": "a", "arguments": {"x": 1}', "invalid JSON"),
    ('{"arguments": {"x": 1}}', 'no "name"'),
    ('{"name": "", "arguments": {}}', 'no "name"'),
    ('["a", {"x": 1}]', "must be a JSON object"),
    ('{"name": "a", "arguments": [1, 2]}', '"arguments" must be a JSON object, got list'),
    ('{"name": "a", "args": {"x": 1}}', "unknown or wrong fields ['args']"),
])
def test_hermes_malformed_call_becomes_error_call_not_exception(body, error):
    content, calls = parse("hermes", f"before <tool_call>{body}</tool_call>")
    assert content == "before"
    assert len(calls) == 1 and calls[0].raw == body and calls[0].arguments is None
    assert error in calls[0].error


def test_hermes_keeps_good_calls_next_to_a_bad_one():
    text = ('<tool_call>{"name": "a", "arguments": {}}</tool_call>'
            '<tool_call>{oops}</tool_call>')
    _, calls = parse("hermes", text)
    assert calls[0].error is None and calls[1].error.startswith("invalid JSON")


def test_hermes_unclosed_call_is_an_error_call():
    content, calls = parse("hermes", 'ok <tool_call>{"name": "a", "argum')
    assert content == "ok"
    assert calls == [ToolCall(None, None, '<tool_call>{"name": "a", "argum',
                              "<tool_call> without </tool_call>")]


def test_hermes_accepts_arguments_as_a_json_string_and_missing_arguments():
    _, calls = parse("hermes", '<tool_call>{"name": "a", "arguments": "{\\"x\\": 2}"}</tool_call>'
                               '<tool_call>{"name": "b"}</tool_call>')
    assert [(c.name, c.arguments, c.error) for c in calls] == [("a", {"x": 2}, None),
                                                               ("b", {}, None)]


# ---------------------------------------------------------------- llama3_json

def test_llama3_parses_a_whole_message_call():
    content, calls = parse("llama3_json", '{"name": "search", "parameters": {"q": "jax"}}')
    assert content == ""
    assert calls == [ToolCall("search", {"q": "jax"},
                              '{"name": "search", "parameters": {"q": "jax"}}')]


def test_llama3_accepts_python_tag_type_field_and_arguments_key():
    text = '<|python_tag|>{"type": "function", "name": "f", "arguments": {"a": 1}}'
    content, calls = parse("llama3_json", text)
    assert content == "" and [(c.name, c.arguments, c.error) for c in calls] == [("f", {"a": 1},
                                                                                  None)]


def test_llama3_parses_several_calls_separated_by_semicolons():
    text = '{"name": "a", "parameters": {"s": "x;y"}}; {"name": "b", "parameters": {}};'
    content, calls = parse("llama3_json", text)
    assert content == ""
    assert [(c.name, c.arguments) for c in calls] == [("a", {"s": "x;y"}), ("b", {})]
    assert calls[1].raw == '{"name": "b", "parameters": {}}'


def test_llama3_plain_text_is_content():
    assert parse("llama3_json", "The answer is {x}.") == ("The answer is {x}.", [])


@pytest.mark.parametrize("text, error", [
    ('{"name": "a", "parameters": {', "invalid JSON"),
    ('{"parameters": {}}', 'no "name"'),
    ('{"name": "a", "parameters": 3}', '"parameters" must be a JSON object'),
    ('{"name": "a", "parameters": {}, "arguments": {}}', "has both"),
    ('{"name": "a", "type": "tool", "parameters": {}}', "unknown or wrong fields ['type']"),
    ('{"name": "a", "params": {}}', "unknown or wrong fields ['params']"),
    ("<|python_tag|>print(1)", "not followed by a JSON tool call"),
])
def test_llama3_malformed_call_becomes_error_call_not_exception(text, error):
    _, calls = parse("llama3_json", text)
    assert len(calls) == 1 and calls[0].arguments is None and error in calls[0].error


def test_llama3_bad_second_call_keeps_the_first():
    _, calls = parse("llama3_json", '{"name": "a", "parameters": {}}; {"name": ')
    assert calls[0].error is None and calls[1].error.startswith("invalid JSON")
    assert calls[1].raw == '{"name":'


def test_llama3_trailing_prose_after_a_call_is_content():
    content, calls = parse("llama3_json", '{"name": "a", "parameters": {}} Calling a now.')
    assert content == "Calling a now." and calls[0].name == "a"


# ---------------------------------------------------------------- formatting

@pytest.mark.parametrize("format", ["hermes", "llama3_json"])
def test_format_tool_call_round_trips_through_the_parser(format):
    arguments = {"expression": "2 * (3 + 4)", "note": "naïve ☃", "n": [1, 2.5, None, True]}
    text = format_tool_call("calculator", arguments, format)
    content, calls = parse(format, text)
    assert content == ""
    assert [(c.name, c.arguments, c.error) for c in calls] == [("calculator", arguments, None)]


def test_format_tool_call_writes_each_format():
    assert format_tool_call("f", {"a": 1}, "hermes") == (
        '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>')
    assert format_tool_call("f", {"a": 1}, "llama3_json") == '{"name": "f", "parameters": {"a": 1}}'


def test_get_tool_parser_returns_each_parser_and_names_unknown_formats():
    assert isinstance(get_tool_parser("hermes"), HermesToolParser)
    assert isinstance(get_tool_parser("llama3_json"), Llama3JsonToolParser)
    with pytest.raises(ValueError, match=r"unknown tool-call format 'qwen'.*hermes"):
        get_tool_parser("qwen")
