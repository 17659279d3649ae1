"""Function tools (rollout.multi_turn.function_tool_path) run in worker processes: a tool that
hangs, exits, allocates past its limit or raises gives the model an error message, the worker is
replaced, and the trainer's process is never touched."""
import asyncio
import os

import pytest

from jaxrl_llm.agent import load_agent_resources
from jaxrl_llm.agent.tools import run_tool_call

FILE = os.path.join(os.path.dirname(__file__), "..", "fixtures", "tools", "hostile_tools.py")


@pytest.fixture(scope="module")
def tools():
    from jaxrl_llm.agent.tools import load_isolated_function_tools
    tools, pool = load_isolated_function_tools(FILE, timeout_s=3.0, memory_limit_gb=1.5, num_workers=1)
    yield tools
    pool.close()


def call(tool, args):
    response, _, metrics = asyncio.run(run_tool_call(tool, "i", args, timeout_s=30.0))
    return response.text, metrics


def test_a_working_tool_runs_in_another_process(tools):
    assert call(tools["add"], {"a": 2, "b": 3}) == ("5", {})
    assert int(call(tools["pid"], {})[0]) != os.getpid()


@pytest.mark.parametrize("name, args, message", [
    ("hang", {"seconds": 600}, "timed out after 3 s"),
    ("die", {"code": 7}, "crashed (its process exited with 7)"),
    ("hog", {"gigabytes": 8}, "MemoryError"),
    ("boom", {}, "failed: RuntimeError: kaput"),
    ("add", {"a": "x", "b": 1}, "argument 'a' must be integer"),  # checked in the parent
])
def test_a_hostile_tool_becomes_an_error_and_the_next_call_works(tools, name, args, message):
    text, metrics = call(tools[name], args)
    assert text.startswith("Error") and message in text and "error" in metrics, text
    assert call(tools["add"], {"a": 1, "b": 1})[0] == "2"  # the (replaced) worker serves again


def test_runner_resources_isolate_function_tools_and_keep_builtins_in_process(tmp_path):
    from jaxrl_llm.config import load_config
    cfg = load_config(os.path.join(os.path.dirname(__file__), "..", "..", "configs",
                                   "quickstart_tools.py"),
                      [f"rollout.multi_turn.function_tool_path={FILE}"]).rollout.multi_turn
    tools, interactions, pools = load_agent_resources(cfg)
    try:
        assert type(tools["add"]).__name__ == "IsolatedFunctionTool"
        assert type(tools["calculator"]).__name__ == "CalculatorTool"
        assert interactions == {} and len(pools) == 1
    finally:
        for p in pools:
            p.close()


@pytest.fixture(scope="module")
def counter(tmp_path_factory):
    import json
    import sys

    from jaxrl_llm.agent.tools import load_tools
    sys.path.insert(0, os.path.dirname(FILE))  # the host process gets the parent's sys.path
    path = tmp_path_factory.mktemp("tools") / "tools.json"
    path.write_text(json.dumps({"tools": [{"class_name": "hostile_class_tool.CounterTool"},
                                          {"class_name": "calculator"}]}))
    tools = load_tools(path, isolated={"timeout_s": 3.0, "memory_limit_gb": 1.5})
    yield tools
    tools["counter"].close()
    sys.path.remove(os.path.dirname(FILE))


def test_a_tool_class_keeps_its_state_in_its_own_process(counter):
    assert type(counter["calculator"]).__name__ == "CalculatorTool"  # built-ins stay in-process

    async def flow():
        tool = counter["counter"]
        a, _ = await tool.create(start=10)
        b, _ = await tool.create()
        texts = [(await run_tool_call(tool, iid, {"mode": "ok"}))[0].text for iid in (a, a, b)]
        pid = (await run_tool_call(tool, a, {"mode": "pid"}))[0].text
        return texts, int(pid), await tool.calc_reward(a), await tool.calc_reward(b)
    texts, pid, ra, rb = asyncio.run(flow())
    assert texts == ["11", "12", "1"] and (ra, rb) == (12.0, 1.0) and pid != os.getpid()


def test_a_tool_class_process_does_not_see_the_trainers_secrets(tmp_path, monkeypatch):
    import json
    import sys

    from jaxrl_llm.agent.tools import load_tools
    monkeypatch.setenv("JAXRL_TEST_SECRET", "hunter2")
    monkeypatch.setattr(sys, "path", [os.path.dirname(FILE), *sys.path])
    path = tmp_path / "tools.json"
    path.write_text(json.dumps({"tools": [{"class_name": "hostile_class_tool.CounterTool"}]}))
    tool = load_tools(path, isolated={"timeout_s": 30.0, "memory_limit_gb": 1.5})["counter"]
    try:
        assert asyncio.run(run_tool_call(tool, "i", {"mode": "secret"}))[0].text == ""
    finally:
        tool.close()


@pytest.mark.parametrize("mode, message", [
    ("hang", "timed out after 3 s"), ("exit", "exit code 5"), ("hog", "MemoryError"),
    ("raise", "kaput")])
def test_a_hostile_tool_class_costs_the_call_not_the_run(counter, mode, message):
    async def flow():
        tool = counter["counter"]
        iid, _ = await tool.create()
        bad = await run_tool_call(tool, iid, {"mode": mode}, timeout_s=3.0)
        fresh, _ = await tool.create()  # a restarted host serves new trajectories
        good = await run_tool_call(tool, fresh, {"mode": "ok"}, timeout_s=3.0)
        return bad, good
    (bad, _, bad_m), (good, _, _) = asyncio.run(flow())
    assert bad.text.startswith("Error") and message in bad.text and "error" in bad_m, bad.text
    assert good.text == "1"


SIDE_EFFECT_TOOLS = '''
import os
import time

from jaxrl_llm.agent.tools import function_tool


@function_tool
def record(path: str, tag: str, seconds: float = 0.0) -> str:
    """Waits `seconds`, then appends `tag` to the file `path`."""
    time.sleep(seconds)
    with open(path, "a") as f:
        f.write(tag + "\\n")
    return tag


@function_tool
def env(name: str) -> str:
    """The worker's environment variable `name` ("" when unset)."""
    print("a print does not disturb the worker's replies", flush=True)
    return os.environ.get(name, "")
'''


@pytest.fixture
def side_effect_file(tmp_path):
    path = tmp_path / "side_effect_tools.py"
    path.write_text(SIDE_EFFECT_TOOLS)
    return str(path)


def test_a_timed_out_call_never_runs_and_queued_calls_wait_without_their_clock(side_effect_file,
                                                                                tmp_path):
    from jaxrl_llm.agent.tools import load_isolated_function_tools
    # the process backend: the tools write to a file of the test (bwrap would hide it)
    tools, pool = load_isolated_function_tools(side_effect_file, timeout_s=2.0, memory_limit_gb=1.5,
                                               num_workers=1, sandbox="process")
    log = str(tmp_path / "calls.log")
    calls = [{"path": log, "tag": "slow", "seconds": 600}] + [
        {"path": log, "tag": tag} for tag in ("a", "b", "c")]

    async def flow():  # one worker: a, b, c queue behind the hanging call
        return await asyncio.gather(*(run_tool_call(tools["record"], "i", args, timeout_s=2.0)
                                      for args in calls))
    try:
        results = asyncio.run(flow())
        texts = [response.text for response, _, _ in results]
        done = {args["tag"] for args, (_, _, metrics) in zip(calls, results) if not metrics}
        assert "timed out after 2 s" in texts[0] and results[0][2] == {"error": "timeout"}
        assert texts[1:] == ["a", "b", "c"], texts  # their time in the queue was not counted
        with open(log) as f:
            assert set(f.read().split()) == done == {"a", "b", "c"}
    finally:
        pool.close()  # waits for every call the pool still had
    with open(log) as f:
        assert sorted(f.read().split()) == ["a", "b", "c"]  # the timed-out call never ran later


def test_a_function_tool_worker_does_not_see_the_trainers_secrets(side_effect_file, monkeypatch):
    from jaxrl_llm.agent.tools import load_isolated_function_tools
    monkeypatch.setenv("JAXRL_TEST_SECRET", "hunter2")
    tools, pool = load_isolated_function_tools(side_effect_file, timeout_s=30.0,
                                               memory_limit_gb=1.5, num_workers=1)
    try:
        assert call(tools["env"], {"name": "JAXRL_TEST_SECRET"}) == ("", {})
        assert call(tools["env"], {"name": "HOME"})[0] != os.environ["HOME"]  # its scratch dir
    finally:
        pool.close()


def test_a_cancelled_call_is_killed_and_a_queued_one_never_starts(side_effect_file, tmp_path):
    from jaxrl_llm.agent.tools import load_isolated_function_tools
    tools, pool = load_isolated_function_tools(side_effect_file, timeout_s=60.0,
                                               memory_limit_gb=1.5, num_workers=1,
                                               sandbox="process")
    log = str(tmp_path / "calls.log")

    async def flow():  # the rollout gives up on both calls before the first one writes
        calls = [run_tool_call(tools["record"], "i", {"path": log, "tag": "late", "seconds": 3})
                 for _ in range(2)]
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.gather(*calls), 1.0)
    try:
        asyncio.run(flow())
    finally:
        pool.close()  # waits for every call the pool still had
    assert not os.path.exists(log)  # neither the running call nor the queued one wrote later


def test_worker_replies_that_arrive_in_one_read_are_each_delivered_and_garbage_is_refused():
    from jaxrl_llm._subprocess_worker import WorkerBroken, WorkerProcess
    worker = WorkerProcess.__new__(WorkerProcess)  # only its buffer: no process needed
    worker.name, worker._buffer = "w", bytearray(b'{"id": 1}\n{"id": 2}\n' + b"[" * 10**5 + b"\n")
    assert worker.receive(0) == {"id": 1} and worker.receive(0) == {"id": 2}
    with pytest.raises(WorkerBroken, match="not a JSON object"):  # nested past the recursion limit
        worker.receive(0)
