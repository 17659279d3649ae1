"""Tools: calculator, @function_tool schemas and argument checks, the python tool's limits,
run_tool_call's containment, and loading tools from config and function files."""
import asyncio
import json
import os
import select
import textwrap
from typing import Literal

import pytest

from jaxrl_llm.agent.tools import (
    BaseTool,
    CalculatorError,
    CalculatorTool,
    FunctionTool,
    OpenAIFunctionToolSchema,
    PythonTool,
    ToolResponse,
    calculate,
    format_number,
    function_tool,
    get_tool_class,
    load_function_tools,
    load_tools,
    run_tool_call,
)


def run(coro):
    return asyncio.run(coro)


def call(tool, arguments, **kwargs):
    async def go():
        instance_id, _ = await tool.create()
        try:
            return await run_tool_call(tool, instance_id, arguments, **kwargs)
        finally:
            await tool.release(instance_id)
    return run(go())


# ---------------------------------------------------------------- calculator

@pytest.mark.parametrize("expression, text", [
    ("1 + 2 * 3", "7"), ("(1 + 2) * 3", "9"), ("2 ** 3 ** 2", "512"), ("-2 ** 2", "-4"),
    ("(-2) ** 2", "4"), ("10 / 2", "5"), ("7 / 2", "3.5"), ("1 / 3", "0.333333333333"),
    ("7 // 2", "3"), ("-7 // 2", "-4"), ("7 % 3", "1"), ("2.5 * 2", "5"), ("0.1 + 0.2", "0.3"),
    ("--3", "3"), ("+4", "4"), ("2 ** -1", "0.5"), ("1_000 * 3", "3000"),
])
def test_calculator_evaluates_arithmetic_with_python_precedence(expression, text):
    assert format_number(calculate(expression)) == text


def test_calculator_division_is_exact_int_when_divisible_else_float():
    assert calculate("12 / 4") == 3 and isinstance(calculate("12 / 4"), int)
    assert calculate("12 / 5") == 2.4


@pytest.mark.parametrize("expression, reason", [
    ("x + 1", "names are not allowed"),
    ("abs(-1)", "function calls are not allowed"),
    ("(1).real", "attribute access is not allowed"),
    ("__import__('os').system('echo hi')", "function calls are not allowed"),
    ("[1, 2][0]", "indexing is not allowed"),
    ("2 ** 100000", "exponent 100000 is too large"),
    ("99 ** 999", "more than 1000 digits"),
    ("1 / 0", "division by zero"),
    ("5 % 0", "division by zero"),
    ("2 ^ 3", r"use \*\* for powers"),
    ("1 +", "invalid expression"),
    ("1e308 * 10", "result is too large"),
    ("(-8) ** 0.5", "not a real number"),
    ("True + 1", "unsupported syntax"),
    ("", "empty expression"),
])
def test_calculator_refuses_unsafe_or_invalid_expressions(expression, reason):
    with pytest.raises(CalculatorError, match=reason):
        calculate(expression)


def test_calculator_refuses_too_long_expressions():
    with pytest.raises(CalculatorError, match="too long"):
        calculate("1+" * 200 + "1")
    assert calculate("1+" * 20 + "1", max_length=64) == 21


def test_calculator_tool_returns_number_text_or_error_text():
    tool = CalculatorTool()
    assert tool.name == "calculator"
    response, reward, metrics = call(tool, {"expression": "(3 + 4) * 2 / 7"})
    assert (response.text, reward, metrics) == ("2", 0.0, {})
    response, _, metrics = call(tool, {"expression": "os.getcwd()"})
    assert response.text.startswith("Error: ") and metrics == {"error": "invalid_expression"}
    response, _, metrics = call(tool, {"expr": "1"})
    assert "missing required" in response.text and metrics == {"error": "invalid_arguments"}


def test_calculator_config_limits_apply_and_typos_are_refused():
    tool = CalculatorTool(config={"type": "native", "max_exponent": 10})
    assert call(tool, {"expression": "2 ** 11"})[0].text.startswith("Error: exponent 11")
    with pytest.raises(ValueError, match="max_exponant"):
        CalculatorTool(config={"max_exponant": 10})


# ---------------------------------------------------------------- function tools

@function_tool
def search(query: str, top_k: int = 3, mode: Literal["web", "news"] = "web",
           tags: list[str] | None = None, exact: bool = False, weight: float = 1.0):
    """Search the corpus for a query.

    Returns the best hits. This line is not part of the description.

    Args:
        query: What to look for,
            across several words.
        top_k (int): How many hits to return.
        mode: Where to search.
        tags: Filters.

    Returns:
        A list of hits.
    """
    return {"query": query, "top_k": top_k, "mode": mode, "tags": tags, "exact": exact,
            "weight": weight}


def test_function_tool_infers_schema_from_hints_defaults_and_docstring():
    schema = search.get_openai_tool_schema().to_dict()
    assert schema["type"] == "function"
    function = schema["function"]
    assert function["name"] == "search"
    assert function["description"] == "Search the corpus for a query."
    assert function["parameters"] == {
        "type": "object",
        "properties": {
            "query": {"type": "string", "description": "What to look for, across several words."},
            "top_k": {"type": "integer", "description": "How many hits to return."},
            "mode": {"type": "string", "enum": ["web", "news"], "description": "Where to search."},
            "tags": {"type": "array", "items": {"type": "string"}, "description": "Filters."},
            "exact": {"type": "boolean"},
            "weight": {"type": "number"},
        },
        "required": ["query"],
    }


def test_function_tool_stays_callable_and_name_description_can_be_overridden():
    @function_tool(name="add_numbers", description="Adds.")
    async def add(a: int, b: int) -> int:
        return a + b

    assert isinstance(add, FunctionTool) and add.name == "add_numbers"
    assert add.tool_schema.function.description == "Adds."
    assert run(add(a=2, b=3)) == 5
    assert call(add, {"a": 2, "b": 3})[0].text == "5"


def test_function_tool_runs_sync_function_and_serialises_result_as_json():
    response, reward, metrics = call(search, {"query": "jax", "tags": ["a"]})
    assert json.loads(response.text) == {"query": "jax", "top_k": 3, "mode": "web",
                                         "tags": ["a"], "exact": False, "weight": 1.0}
    assert (reward, metrics) == (0.0, {})


@pytest.mark.parametrize("arguments, message", [
    ({}, "missing required argument(s) ['query']"),
    ({"query": "q", "limit": 3}, "unknown argument(s) ['limit']"),
    ({"query": 5}, "argument 'query' must be string, got integer 5"),
    ({"query": "q", "top_k": "3"}, "argument 'top_k' must be integer"),
    ({"query": "q", "top_k": True}, "argument 'top_k' must be integer"),
    ({"query": "q", "mode": "books"}, "must be one of ['web', 'news']"),
    ({"query": "q", "tags": ["a", 1]}, "argument 'tags'[1] must be string"),
    ({"query": "q", "exact": "yes"}, "argument 'exact' must be boolean"),
])
def test_function_tool_returns_validation_errors_to_the_model(arguments, message):
    response, reward, metrics = call(search, arguments)
    assert response.text.startswith("Error: ") and message in response.text
    assert (reward, metrics) == (0.0, {"error": "invalid_arguments"})


def test_function_tool_accepts_int_for_number_and_refuses_untyped_parameters():
    assert json.loads(call(search, {"query": "q", "weight": 2})[0].text)["weight"] == 2
    def f(x):  # noqa: E306
        return x
    with pytest.raises(TypeError, match=r"f\(x\): add a type hint"):
        function_tool(f)
    def g(*args: int):  # noqa: E306
        return args
    with pytest.raises(TypeError, match="name each parameter"):
        function_tool(g)
    def h(x: set):  # noqa: E306
        return x
    with pytest.raises(TypeError, match="cannot turn type"):
        function_tool(h)


# ---------------------------------------------------------------- python tool

def python_call(code, sandbox="auto", **config):
    return call(PythonTool(config=config, sandbox=sandbox), {"code": code}, timeout_s=30)


def test_python_tool_returns_stdout_and_stderr():
    response, reward, metrics = python_call(
        "import sys\nprint(6 * 7)\nprint('warn', file=sys.stderr)")
    assert response.text == "42\n\n[stderr]\nwarn\n"
    assert reward == 0.0 and metrics == {"returncode": 0, "timed_out": False}


def test_python_tool_runs_in_an_empty_temporary_directory_each_call():
    code = "import os\nprint(os.listdir('.'))\nopen('left.txt', 'w').write('x')"
    assert python_call(code)[0].text == "[]\n"
    assert python_call(code)[0].text == "[]\n"


def test_python_tool_returns_the_traceback_of_a_raise():
    response, _, metrics = python_call("def f():\n    raise ValueError('bad input')\nf()")
    assert response.text.startswith("Error: exit code 1\n")
    assert "Traceback (most recent call last)" in response.text
    assert "ValueError: bad input" in response.text and metrics["returncode"] == 1


def test_python_tool_stops_a_memory_hog():
    code = "chunks = []\nwhile True:\n    chunks.append(bytearray(10 ** 7))"
    response, _, _ = python_call(code, memory_mb=200)
    assert response.text.startswith("Error: memory limit exceeded (200 MB)")


def test_python_tool_truncates_long_output():
    response, _, _ = python_call("print('x' * 5000)", max_output_chars=100)
    assert response.text.startswith("x" * 100 + "\n... [4901 more bytes truncated]")


def _wait_for_exit(pid: int) -> bool:
    """True once `pid` has exited (pidfd polls readable); not our child, so no waitpid."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        return bool(select.select([fd], [], [], 10.0)[0])
    finally:
        os.close(fd)


def test_python_tool_timeout_kills_process_group_and_keeps_event_loop_free(tmp_path):
    pid_file = tmp_path / "child.pid"
    code = textwrap.dedent(f"""
        import subprocess, sys
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        open({str(pid_file)!r}, "w").write(str(child.pid))
        print("started", flush=True)
        while True:
            pass
    """)
    # the process backend: the pid file is outside the scratch dir (bwrap: test_agent_sandbox.py)
    tool, order = PythonTool(config={"timeout_s": 1}, sandbox="process"), []

    async def python():
        result = await run_tool_call(tool, "i", {"code": code}, timeout_s=30)
        order.append("python")
        return result

    async def other():  # needs many loop turns: spawn, read pipes, reap
        result = await run_tool_call(PythonTool(), "j", {"code": "print(1 + 1)"})
        order.append("other")
        return result

    async def both():
        return await asyncio.gather(python(), other())

    (response, _, metrics), (other_response, _, _) = run(both())
    assert order == ["other", "python"] and other_response.text == "2\n"
    assert response.text == "Error: timed out after 1 s\nstarted\n"
    assert metrics["timed_out"] is True
    assert _wait_for_exit(int(pid_file.read_text()))


def test_python_tool_returns_when_snippet_exits_and_kills_its_background_child(tmp_path):
    pid_file = tmp_path / "child.pid"
    code = textwrap.dedent(f"""
        import subprocess, sys
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        open({str(pid_file)!r}, "w").write(str(child.pid))
        print("done")
    """)
    response, _, metrics = python_call(code, sandbox="process", timeout_s=20)
    assert response.text == "done\n" and metrics == {"returncode": 0, "timed_out": False}
    assert _wait_for_exit(int(pid_file.read_text()))


def test_python_tool_refuses_bad_config():
    with pytest.raises(ValueError, match="must be positive"):
        PythonTool(config={"timeout_s": 0})
    with pytest.raises(ValueError, match="memory_limit"):
        PythonTool(config={"memory_limit": 100})


# ---------------------------------------------------------------- run_tool_call

class _Raises(BaseTool):
    async def execute(self, instance_id, parameters, **kwargs):
        raise RuntimeError("backend down")


class _Hangs(BaseTool):
    async def execute(self, instance_id, parameters, **kwargs):
        await asyncio.Event().wait()


class _BadReturn(BaseTool):
    async def execute(self, instance_id, parameters, **kwargs):
        return "just text"


class _OldStyle(BaseTool):
    async def execute(self, instance_id, parameters, **kwargs):
        return "plain text response", 1, None


_SCHEMA = {"type": "function", "function": {"name": "t", "description": "",
                                            "parameters": {"type": "object", "properties": {}}}}


def test_run_tool_call_turns_an_exception_into_an_error_message():
    response, reward, metrics = call(_Raises(tool_schema=_SCHEMA), {})
    assert response.text == "Error: tool 't' failed: RuntimeError: backend down"
    assert (reward, metrics) == (0.0, {"error": "exception"})


def test_run_tool_call_times_out_a_hanging_tool():
    response, reward, metrics = call(_Hangs(tool_schema=_SCHEMA), {}, timeout_s=0.05)
    assert response.text == "Error: tool 't' timed out after 0.05 s"
    assert (reward, metrics) == (0.0, {"error": "timeout"})


def test_run_tool_call_checks_return_shape_and_wraps_plain_text():
    assert call(_BadReturn(tool_schema=_SCHEMA), {})[2] == {"error": "bad_return"}
    response, reward, metrics = call(_OldStyle(tool_schema=_SCHEMA), {})
    assert (response, reward, metrics) == (ToolResponse("plain text response"), 1.0, {})
    assert call(_OldStyle(tool_schema=_SCHEMA), None)[2] == {"error": "invalid_arguments"}


def test_base_tool_needs_a_schema_and_creates_unique_instances():
    with pytest.raises(ValueError, match="_Raises has no tool schema"):
        _Raises()
    tool = _Raises(tool_schema=_SCHEMA)
    first, second = run(tool.create())[0], run(tool.create())[0]
    assert first != second and run(tool.create("mine")) == ("mine", None)


# ---------------------------------------------------------------- loading

_CUSTOM_MODULE = '''
from jaxrl_llm.agent.tools import BaseTool, ToolResponse

class EchoTool(BaseTool):
    async def execute(self, instance_id, parameters, **kwargs):
        return ToolResponse(self.config["prefix"] + parameters["text"]), 0.5, {}

class NotATool:
    pass
'''


def _write_json(path, data):
    path.write_text(json.dumps(data))
    return path


def test_load_tools_reads_builtin_and_custom_class_from_json(tmp_path, monkeypatch):
    (tmp_path / "agent_custom_tools_mod.py").write_text(_CUSTOM_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    echo_schema = {"type": "function", "function": {
        "name": "echo", "description": "Echo text.",
        "parameters": {"type": "object", "properties": {"text": {"type": "string"}},
                       "required": ["text"]}}}
    path = _write_json(tmp_path / "tools.json", {"tools": [
        {"class_name": "calculator", "config": {"type": "native", "max_length": 50}},
        {"class_name": "agent_custom_tools_mod.EchoTool", "config": {"prefix": "> "},
         "tool_schema": echo_schema},
    ]})
    tools = load_tools(path)
    assert list(tools) == ["calculator", "echo"]
    assert isinstance(tools["calculator"], CalculatorTool) and tools["calculator"].max_length == 50
    assert tools["echo"].get_openai_tool_schema() == OpenAIFunctionToolSchema.from_dict(echo_schema)
    assert call(tools["echo"], {"text": "hi"})[:2] == (ToolResponse("> hi"), 0.5)


def test_load_tools_reads_yaml(tmp_path):
    pytest.importorskip("yaml")
    path = tmp_path / "tools.yaml"
    path.write_text("tools:\n  - class_name: python\n    config: {timeout_s: 2}\n")
    assert load_tools(path)["python"].timeout_s == 2.0


@pytest.mark.parametrize("data, error", [
    ({"tool": []}, "list under 'tools'"),
    ({"tools": [{"config": {}}]}, "needs 'class_name'"),
    ({"tools": [{"class_name": "calculator", "schema": {}}]},
     r"got keys \['class_name', 'schema'\]"),
    ({"tools": [{"class_name": "calculater"}]}, "unknown tool 'calculater'"),
    ({"tools": [{"class_name": "no_such_module_xyz.Tool"}]}, "cannot import module"),
    ({"tools": [{"class_name": "json.JSONDecoder"}]}, "not a subclass"),
    ({"tools": [{"class_name": "calculator"}, {"class_name": "calculator"}]}, "two tools"),
    ({"tools": [{"class_name": "calculator", "tool_schema": {"function": {"name": ""}}}]},
     "non-empty string"),
])
def test_load_tools_errors_name_the_problem(tmp_path, data, error):
    with pytest.raises((ValueError, ImportError, TypeError), match=error):
        load_tools(_write_json(tmp_path / "tools.json", data))


def test_yaml_without_pyyaml_says_to_install_it(tmp_path, monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "yaml", None)
    path = tmp_path / "tools.yaml"
    path.write_text("tools: []\n")
    with pytest.raises(ImportError, match="pip install pyyaml"):
        load_tools(path)


def test_get_tool_class_finds_builtins():
    assert get_tool_class("calculator") is CalculatorTool
    assert get_tool_class("python") is PythonTool


def test_load_function_tools_collects_decorated_functions(tmp_path):
    path = tmp_path / "my_tools.py"
    path.write_text(textwrap.dedent('''
        from jaxrl_llm.agent.tools import function_tool

        @function_tool
        def double(x: int) -> int:
            """Doubles x."""
            return 2 * x

        @function_tool(name="greet")
        async def hello(name: str) -> str:
            return "hello " + name

        def plain(y: int) -> int:
            return y
    '''))
    tools = load_function_tools(path)
    assert sorted(tools) == ["double", "greet"]
    assert tools["double"].tool_schema.function.description == "Doubles x."
    assert call(tools["double"], {"x": 21})[0].text == "42"
    assert call(tools["greet"], {"name": "ada"})[0].text == "hello ada"


def test_load_function_tools_refuses_a_file_without_tools(tmp_path):
    path = tmp_path / "empty_tools.py"
    path.write_text("x = 1\n")
    with pytest.raises(ValueError, match="defines no @function_tool"):
        load_function_tools(path)
    with pytest.raises(FileNotFoundError, match="missing.py"):
        load_function_tools(tmp_path / "missing.py")
