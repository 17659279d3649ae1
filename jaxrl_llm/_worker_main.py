"""The worker process for user code: function tools, reward functions and tool classes
(`python -m jaxrl_llm._worker_main tools <file>` | `reward <file> <name>` | `reward` | `host`).

It imports the user's file itself, then serves requests: a JSON line on stdin in, a JSON line on
stdout out; `tools` and `reward` one at a time, `host` (one `BaseTool` object, its class and
config given in the first line in) concurrently on an asyncio loop, replies tagged with the
request's "id". Nothing is pickled either way, so the parent (the trainer) never runs code a
worker sends. The first line out is {"ready": true, ...} or {"error": "..."} (the file did not
import). The user's code sees stdin as /dev/null and its prints go to stderr, so it cannot read
or corrupt the protocol. Started by `jaxrl_llm._subprocess_worker`, inside a sandbox; no JAX here.
"""
from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from collections.abc import Callable


def _tool_handler(path: str) -> Callable[[dict], dict]:
    from jaxrl_llm.agent.tools._base import ToolResponse
    from jaxrl_llm.agent.tools._files import import_file
    from jaxrl_llm.agent.tools._function import FunctionTool, _to_text

    module = import_file(path, "jaxrl_llm_function_tools")
    tools = {v.name: v for v in vars(module).values() if isinstance(v, FunctionTool)}

    def handle(request: dict) -> dict:
        result = tools[request["name"]].fn(**request["arguments"])
        if asyncio.iscoroutine(result):
            result = asyncio.run(result)
        return {"ok": True,
                "text": result.text if isinstance(result, ToolResponse) else _to_text(result)}
    return handle


def _reward_handler(args: list[str]) -> Callable[[dict], dict]:
    from jaxrl_llm.rewards._custom import CustomRewardFn
    from jaxrl_llm.rewards._registry import score_one

    custom_fn = CustomRewardFn(args[0], args[1]) if args else None

    def handle(request: dict) -> dict:
        score, extras = score_one(custom_fn, request["data_source"], request["solution_str"],
                                  request["ground_truth"], request["extra_info"])
        return {"ok": True, "score": score, "extras": extras}
    return handle


_HOST_METHODS = ("create", "execute", "calc_reward", "release")
TOOL_RESPONSE_KEY = "$tool_response"  # how a ToolResponse travels: {"$tool_response": text}


def _host_result(method: str, result):
    """A tool method's result as JSON data: a ToolResponse as {TOOL_RESPONSE_KEY: text}, a
    tuple as a list (one level deep: verl's (id, response) and (response, reward, metrics))."""
    from jaxrl_llm.agent.tools._base import ToolResponse

    def one(value):
        return {TOOL_RESPONSE_KEY: value.text or ""} if isinstance(value, ToolResponse) else value
    if method == "release":
        return None  # the parent drops it anyway
    return [one(v) for v in result] if isinstance(result, tuple) else one(result)


def _host(requests, send) -> int:
    init = json.loads(requests.readline() or "null")
    try:
        from jaxrl_llm.agent.tools._registry import get_tool_class
        tool = get_tool_class(init["class_name"])(config=init["config"],
                                                  tool_schema=init["schema"])
    except BaseException as e:  # noqa: BLE001 - an import error is the parent's to report
        send({"error": f"{type(e).__name__}: {e}"})
        return 1
    send({"ready": True, "schema": tool.tool_schema.to_dict()})

    async def one(request: dict) -> None:
        reply = {"id": request.get("id")}
        try:
            if request["method"] not in _HOST_METHODS:
                raise ValueError(f"no method {request['method']!r}")
            result = await getattr(tool, request["method"])(*request["args"],
                                                            **request["kwargs"])
            reply.update(ok=True, result=_host_result(request["method"], result))
        except BaseException as e:  # noqa: BLE001 - reported to the caller, the host lives on
            reply.update(ok=False, error=f"{type(e).__name__}: {e}")
        send(reply)

    async def serve() -> None:
        loop, tasks = asyncio.get_running_loop(), set()
        while line := await loop.run_in_executor(None, requests.readline):
            task = loop.create_task(one(json.loads(line)))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
    asyncio.run(serve())
    return 0


def main(argv: list[str]) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    requests = os.fdopen(os.dup(0), "rb")
    replies = os.fdopen(os.dup(1), "wb")
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.dup2(2, 1)  # the user's prints go to stderr, never into the protocol

    def send(message: dict) -> None:
        try:
            line = json.dumps(message, allow_nan=False)
        except (TypeError, ValueError) as e:
            line = json.dumps({**({"id": message["id"]} if "id" in message else {}),
                               "ok": False, "error": f"the result is not JSON data: {e}"})
        replies.write(line.encode() + b"\n")
        replies.flush()

    kind, args = argv[0], argv[1:]
    if kind == "host":
        return _host(requests, send)
    try:
        handle = _tool_handler(args[0]) if kind == "tools" else _reward_handler(args)
    except BaseException as e:  # noqa: BLE001 - an import error is the parent's to report
        send({"error": f"{type(e).__name__}: {e}"})
        return 1
    send({"ready": True})
    for line in requests:
        try:
            reply = handle(json.loads(line))
        except BaseException as e:  # noqa: BLE001 - MemoryError, SystemExit...: a message
            reply = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        send(reply)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
