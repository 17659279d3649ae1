"""Tool-call parsers, table-driven: hermes, llama3_json and qwen3_coder on cases modelled on the
behaviours vLLM's and SGLang's own parser suites check (each case names the behaviour and whose
suite it comes from; "ours" where we differ on purpose, see docs/agents.md), plus formatting."""
import pytest

from jaxrl_llm.agent._parsers import (
    HermesToolParser,
    Llama3JsonToolParser,
    Qwen3CoderToolParser,
    format_tool_call,
    get_tool_parser,
)

ERR = "ERROR"  # expected call: (ERR, a substring of its error)


def hermes(name, arguments):
    import json
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments})}\n</tool_call>'


A = '{"name": "a", "parameters": {}}'
B = '{"name": "b", "parameters": {"q": "x"}}'
CASES = [
    # ------------------------------------------------------------------ hermes
    ("hermes", "text_before_call_is_content (vLLM, SGLang)",
     'Let me compute.\n<tool_call>\n{"name": "calc", "arguments": {"expression": "1+2"}}\n</tool_call>',
     "Let me compute.", [("calc", {"expression": "1+2"})]),
    ("hermes", "several_blocks_in_order (vLLM, SGLang)",
     "\n".join(hermes("w", {"city": c}) for c in ("NYC", "Baltimore", "Minneapolis")),
     "", [("w", {"city": "NYC"}), ("w", {"city": "Baltimore"}), ("w", {"city": "Minneapolis"})]),
    ("hermes", "text_between_and_after_blocks_is_content (ours: vLLM/SGLang keep the text before)",
     'A <tool_call>{"name": "a", "arguments": {}}</tool_call> and '
     '<tool_call>{"name": "b", "arguments": {}}</tool_call> done', "A  and  done",
     [("a", {}), ("b", {})]),
    ("hermes", "no_call_is_plain_content (vLLM)", "  This is not a tool call.  ",
     "This is not a tool call.", []),
    ("hermes", "missing_closing_tag_at_end_of_text (vLLM tool_call_until_eos)",
     '<tool_call>\n{"name": "final_answer", "arguments": {"trigger": true}}',
     "", [("final_answer", {"trigger": True})]),
    ("hermes", "cut_off_call_is_error_and_content (vLLM: no call)",
     'ok <tool_call>{"name": "a", "argum', 'ok <tool_call>{"name": "a", "argum',
     [(ERR, "<tool_call> without </tool_call>")]),
    ("hermes", "invalid_json_is_error_and_content (vLLM invalid_json: no call)",
     '<tool_call>{"name": "a", "arguments": {"x": 1}</tool_call>',
     '<tool_call>{"name": "a", "arguments": {"x": 1}</tool_call>', [(ERR, "invalid JSON")]),
    ("hermes", "valid_block_kept_next_to_bad_one (SGLang; vLLM drops all)",
     '<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{oops}</tool_call>',
     "<tool_call>{oops}</tool_call>", [("a", {}), (ERR, "invalid JSON")]),
    ("hermes", "arguments_as_json_string_decoded_once (vLLM serialized_arguments)",
     '<tool_call>{"name": "db", "arguments": "{\\"param\\": \\"max\\"}"}</tool_call>', "",
     [("db", {"param": "max"})]),
    ("hermes", "bare_string_arguments_refused (ours: vLLM passes the string on)",
     '<tool_call>{"name": "do", "arguments": "hello"}</tool_call>',
     '<tool_call>{"name": "do", "arguments": "hello"}</tool_call>',
     [(ERR, '"arguments" must be a JSON object, got str')]),
    ("hermes", "missing_arguments_is_empty (SGLang)", '<tool_call>{"name": "b"}</tool_call>', "",
     [("b", {})]),
    ("hermes", "parameters_key_accepted (SGLang base detector)",
     '<tool_call>{"name": "b", "parameters": {"x": 1}}</tool_call>', "", [("b", {"x": 1})]),
    ("hermes", "both_argument_keys_refused (ours)",
     '<tool_call>{"name": "b", "parameters": {}, "arguments": {}}</tool_call>',
     '<tool_call>{"name": "b", "parameters": {}, "arguments": {}}</tool_call>', [(ERR, "has both")]),
    ("hermes", "no_name_refused (vLLM, SGLang)", '<tool_call>{"arguments": {}}</tool_call>',
     '<tool_call>{"arguments": {}}</tool_call>', [(ERR, 'no "name"')]),
    ("hermes", "unknown_field_refused (ours)", '<tool_call>{"name": "a", "args": {}}</tool_call>',
     '<tool_call>{"name": "a", "args": {}}</tool_call>', [(ERR, "unknown or wrong fields ['args']")]),
    ("hermes", "list_arguments_refused (ours)", '<tool_call>{"name": "a", "arguments": [1]}</tool_call>',
     '<tool_call>{"name": "a", "arguments": [1]}</tool_call>', [(ERR, "must be a JSON object, got list")]),
    ("hermes", "braces_and_tags_inside_strings (vLLM)",
     '<tool_call>{"name": "s", "arguments": {"q": "a {b} [c] <tool_call>"}}</tool_call>', "",
     [("s", {"q": "a {b} [c] <tool_call>"})]),
    # ------------------------------------------------------------------ llama3_json
    ("llama3_json", "whole_message_call (vLLM, SGLang)", B, "", [("b", {"q": "x"})]),
    ("llama3_json", "arguments_key (vLLM, SGLang)", '{"name": "s", "arguments": {"query": "t"}}', "",
     [("s", {"query": "t"})]),
    ("llama3_json", "python_tag_and_type_function (SGLang)",
     '<|python_tag|>{"type": "function", "name": "f", "parameters": {"a": 1}}', "",
     [("f", {"a": 1})]),
    ("llama3_json", "text_before_python_tag_is_content (SGLang; vLLM drops it)",
     'Let me check. <|python_tag|>{"name": "w", "arguments": {"city": "Tokyo"}}',
     "Let me check.", [("w", {"city": "Tokyo"})]),
    ("llama3_json", "json_inside_prose_without_tag_is_content (SGLang; vLLM extracts it)",
     'Here is the result: {"name": "t", "parameters": {}} Would you like to know more?',
     'Here is the result: {"name": "t", "parameters": {}} Would you like to know more?', []),
    ("llama3_json", "three_calls_semicolon_space (vLLM multiple_json)", f"{B}; {A}; {B}", "",
     [("b", {"q": "x"}), ("a", {}), ("b", {"q": "x"})]),
    ("llama3_json", "semicolons_with_whitespace (vLLM)", f"{B} ; {A} ; {B}", "",
     [("b", {"q": "x"}), ("a", {}), ("b", {"q": "x"})]),
    ("llama3_json", "bare_semicolon (vLLM separators)", f"{B};{A}", "", [("b", {"q": "x"}), ("a", {})]),
    ("llama3_json", "semicolon_newline (vLLM separators)", f"{B};\n{A}", "",
     [("b", {"q": "x"}), ("a", {})]),
    ("llama3_json", "newline_separated (vLLM separators)", f"{B}\n{A}", "",
     [("b", {"q": "x"}), ("a", {})]),
    ("llama3_json", "python_tag_then_semicolons (SGLang multiple_json_objects)",
     f"<|python_tag|>{B};{A}", "", [("b", {"q": "x"}), ("a", {})]),
    ("llama3_json", "repeated_python_tag (ours, as SGLang's recovery reads it)",
     f"<|python_tag|>{B}\n<|python_tag|>{A};<|python_tag|>{A}", "",
     [("b", {"q": "x"}), ("a", {}), ("a", {})]),
    ("llama3_json", "json_list_of_calls (SGLang)", f"[{B}, {A}]", "", [("b", {"q": "x"}), ("a", {})]),
    ("llama3_json", "brace_in_trailing_text_keeps_call (vLLM)",
     '{"name": "s", "parameters": {"query": "t"}} I used {s} for this.',
     "I used {s} for this.", [("s", {"query": "t"})]),
    ("llama3_json", "json_fragment_in_trailing_text_keeps_call (vLLM)",
     '{"name": "s", "parameters": {"query": "t"}} The arguments I passed were {"query": "t"}',
     'The arguments I passed were {"query": "t"}', [("s", {"query": "t"})]),
    ("llama3_json", "recovery_after_malformed_middle_call (SGLang)",
     f'{A}; {{"name": "bad", "parameters": {{oops}}}}; {B}',
     '{"name": "bad", "parameters": {oops}};', [("a", {}), (ERR, "invalid JSON"), ("b", {"q": "x"})]),
    ("llama3_json", "malformed_last_call_after_a_good_one (SGLang)", f'{A}; {{"name": ',
     '{"name":', [("a", {}), (ERR, "invalid JSON")]),
    ("llama3_json", "invalid_json_message_is_content_and_error (vLLM invalid_json: no call)",
     '{"name": "t", "parameters": {invalid json}', '{"name": "t", "parameters": {invalid json}',
     [(ERR, "invalid JSON")]),
    ("llama3_json", "missing_name_without_tag_is_content (vLLM missing_name_key)",
     '{"parameters": {}}', '{"parameters": {}}', []),
    ("llama3_json", "missing_name_after_tag_is_error (ours; SGLang drops it)",
     '<|python_tag|>{"a": 1}', '{"a": 1}', [(ERR, 'no "name"')]),
    ("llama3_json", "missing_parameters_is_empty (SGLang; vLLM refuses)", '{"name": "t"}', "",
     [("t", {})]),
    ("llama3_json", "deeply_nested_parameters (vLLM)",
     '{"name": "c", "parameters": {"l1": {"l2": {"l3": {"l4": {"v": "deep"}}}}}}', "",
     [("c", {"l1": {"l2": {"l3": {"l4": {"v": "deep"}}}}})]),
    ("llama3_json", "quotes_and_brackets_in_strings (vLLM)",
     '{"name": "p", "parameters": {"text": "He said \\"Hello {world}\\"", "q": "a;b"}}', "",
     [("p", {"text": 'He said "Hello {world}"', "q": "a;b"})]),
    ("llama3_json", "plain_text_is_content (vLLM no_json)", "This is just some text.",
     "This is just some text.", []),
    ("llama3_json", "non_tool_json_message_is_content (SGLang preserves_non_tool_json)",
     '{"nested": {"name": "w"}, "items": [1, 2]}', '{"nested": {"name": "w"}, "items": [1, 2]}', []),
    ("llama3_json", "dict_then_prose_is_content (SGLang)", '{"a": 1} is a dict', '{"a": 1} is a dict',
     []),
    ("llama3_json", "brace_prose_not_json_is_content (ours)", "{x} is a set", "{x} is a set", []),
    ("llama3_json", "python_tag_with_code_is_error (ours)", "<|python_tag|>print(1)", "print(1)",
     [(ERR, "not followed by a JSON tool call")]),
    ("llama3_json", "wrong_type_field_refused (ours)", '{"name": "a", "type": "tool", "parameters": {}}',
     '{"name": "a", "type": "tool", "parameters": {}}', [(ERR, "unknown or wrong fields ['type']")]),
    # ------------------------------------------------------------------ qwen3_coder
    ("qwen3_coder", "one_call_values_json_decoded_without_schema (vLLM, SGLang)",
     "<tool_call>\n<function=w>\n<parameter=city>\nDallas\n</parameter>\n<parameter=days>\n5\n"
     "</parameter>\n<parameter=hourly>\ntrue\n</parameter>\n</function>\n</tool_call>", "",
     [("w", {"city": "Dallas", "days": 5, "hourly": True})]),
    ("qwen3_coder", "text_before_is_content_and_several_blocks (vLLM, SGLang)",
     "Checking both.\n<tool_call>\n<function=w>\n<parameter=city>\nA\n</parameter>\n</function>\n"
     "</tool_call>\n<tool_call>\n<function=w>\n<parameter=city>\nB\n</parameter>\n</function>\n"
     "</tool_call>", "Checking both.", [("w", {"city": "A"}), ("w", {"city": "B"})]),
    ("qwen3_coder", "multiline_value_keeps_inner_newlines (vLLM)",
     "<tool_call><function=py><parameter=code>\nx = 1\n\nprint(x)\n</parameter></function></tool_call>",
     "", [("py", {"code": "x = 1\n\nprint(x)"})]),
    ("qwen3_coder", "json_object_and_list_values (vLLM)",
     '<tool_call><function=f><parameter=o>{"k": [1, 2]}</parameter><parameter=l>[1, "a"]</parameter>'
     "</function></tool_call>", "", [("f", {"o": {"k": [1, 2]}, "l": [1, "a"]})]),
    ("qwen3_coder", "missing_parameter_close_before_next (SGLang)",
     "<tool_call><function=f><parameter=a>\n1\n<parameter=b>\nx\n</parameter></function></tool_call>",
     "", [("f", {"a": 1, "b": "x"})]),
    ("qwen3_coder", "missing_tool_call_close_at_end (vLLM)",
     "<tool_call><function=f><parameter=a>hi</parameter></function>", "", [("f", {"a": "hi"})]),
    ("qwen3_coder", "no_parameters (vLLM)", "<tool_call><function=now></function></tool_call>", "",
     [("now", {})]),
    ("qwen3_coder", "cut_off_function_is_error_and_content (ours)",
     "<tool_call><function=f><parameter=a>hi", "<tool_call><function=f><parameter=a>hi",
     [(ERR, "<tool_call> without </tool_call>")]),
    ("qwen3_coder", "block_without_function_is_error (ours)", "<tool_call>{\"name\": \"f\"}</tool_call>",
     "<tool_call>{\"name\": \"f\"}</tool_call>", [(ERR, "must be <function=NAME>")]),
]


def _summary(calls):
    return [(ERR, c.error) if c.error else (c.name, c.arguments) for c in calls]


@pytest.mark.parametrize("format, behaviour, text, content, expected",
                         CASES, ids=[f"{c[0]}:{c[1].split(' ')[0]}" for c in CASES])
def test_parser_cases(format, behaviour, text, content, expected):
    got_content, calls = get_tool_parser(format).parse(text)
    assert got_content == content
    got = _summary(calls)
    assert len(got) == len(expected), got
    for (name, value), (want_name, want) in zip(got, expected):
        if want_name == ERR:
            assert name == ERR and want in value, (value, want)
        else:
            assert (name, value) == (want_name, want)


def test_error_calls_carry_the_raw_text():
    _, calls = get_tool_parser("hermes").parse('x <tool_call>{"name": 1}</tool_call>')
    assert calls[0].raw == '{"name": 1}' and calls[0].name is None and calls[0].arguments is None
    _, calls = get_tool_parser("llama3_json").parse(f'{A}; {{"name": ')
    assert calls[0].raw == A and calls[1].raw == '{"name":'


def test_qwen3_coder_converts_values_by_the_tool_schema():
    text = ("<tool_call><function=f><parameter=zip>\n01234\n</parameter><parameter=n>\n3\n"
            "</parameter><parameter=x>2.5</parameter><parameter=flag>false</parameter>"
            "<parameter=free>null</parameter></function></tool_call>")
    schema = {"f": {"type": "object", "properties": {
        "zip": {"type": "string"}, "n": {"type": "integer"}, "x": {"type": "number"},
        "flag": {"type": "boolean"}}}}
    _, (call,) = get_tool_parser("qwen3_coder").parse(text, schema)
    assert call.arguments == {"zip": "01234", "n": 3, "x": 2.5, "flag": False, "free": None}
    _, (call,) = get_tool_parser("qwen3_coder").parse(text)  # no schema: JSON where it is JSON
    assert call.arguments["zip"] == "01234" and call.arguments["n"] == 3


@pytest.mark.parametrize("format", ["hermes", "llama3_json", "qwen3_coder"])
def test_format_tool_call_round_trips_through_the_parser(format):
    arguments = {"expression": "2 * (3 + 4)", "note": "naïve ☃", "n": [1, 2.5, None, True]}
    text = format_tool_call("calculator", arguments, format)
    content, calls = get_tool_parser(format).parse(text)
    assert content == ""
    assert _summary(calls) == [("calculator", arguments)]


def test_format_tool_call_writes_each_format():
    assert format_tool_call("f", {"a": 1}, "hermes") == (
        '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>')
    assert format_tool_call("f", {"a": 1}, "llama3_json") == '{"name": "f", "parameters": {"a": 1}}'
    assert format_tool_call("f", {"a": 1, "s": "x"}, "qwen3_coder") == (
        "<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\n<parameter=s>\nx\n"
        "</parameter>\n</function>\n</tool_call>")


def test_get_tool_parser_returns_each_parser_and_names_unknown_formats():
    assert isinstance(get_tool_parser("hermes"), HermesToolParser)
    assert isinstance(get_tool_parser("llama3_json"), Llama3JsonToolParser)
    assert isinstance(get_tool_parser("qwen3_coder"), Qwen3CoderToolParser)
    with pytest.raises(ValueError, match=r"unknown tool-call format 'qwen'.*hermes"):
        get_tool_parser("qwen")


def test_the_config_accepts_exactly_the_parser_formats():
    import os

    from jaxrl_llm.agent._parsers import TOOL_PARSERS
    from jaxrl_llm.config import _load, load_config
    assert set(_load.TOOL_CALL_FORMATS) == set(TOOL_PARSERS)
    config = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "quickstart_tools.py")
    cfg = load_config(config, ["rollout.multi_turn.format=qwen3_coder"])
    assert cfg.rollout.multi_turn.format == "qwen3_coder"
