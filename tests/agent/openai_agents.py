"""User agents written against the official `openai` client, for the openai_agent loop's tests
(loaded by file path, as `rollout.multi_turn.openai_agent_path` loads a user's agent)."""
import asyncio
import json

import openai

from jaxrl_llm.agent.tools import CalculatorTool, create_tool_instance, run_tool_call

MAX_TURNS = 4


def _client(base_url, session_id):
    return openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0,
                         default_headers={"X-Session-Id": session_id})


def _calculator(arguments: dict) -> str:
    """Runs the calculator tool here, in the agent (the trainer never sees the call)."""
    tool = CalculatorTool()

    async def go():
        iid = await create_tool_instance(tool, {})
        response, _, _ = await run_tool_call(tool, iid, arguments, timeout_s=5.0)
        await tool.release(iid)
        return response.text
    return asyncio.run(go())


def calculator_agent(base_url, session_id, row):
    """Chat with tools; run each tool call locally and send its result; stop at an answer, a
    cut reply or MAX_TURNS. Returns the final answer's text."""
    client = _client(base_url, session_id)
    messages = [dict(m) for m in row["raw_prompt"]]
    tools = [CalculatorTool().get_openai_tool_schema().to_dict()]
    for _ in range(MAX_TURNS):
        reply = client.chat.completions.create(model=row["model"], messages=messages, tools=tools)
        choice = reply.choices[0]
        messages.append(choice.message.model_dump(exclude_none=True))
        if choice.finish_reason != "tool_calls":
            return choice.message.content
        for call in choice.message.tool_calls:
            messages.append({"role": "tool", "tool_call_id": call.id,
                             "content": _calculator(json.loads(call.function.arguments))})
    return None


async def async_calculator_agent(base_url, session_id, row):
    """calculator_agent with `openai.AsyncOpenAI`, awaited on the runner's event loop."""
    client = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0,
                                default_headers={"X-Session-Id": session_id})
    messages = [dict(m) for m in row["raw_prompt"]]
    tools = [CalculatorTool().get_openai_tool_schema().to_dict()]
    for _ in range(MAX_TURNS):
        reply = await client.chat.completions.create(model=row["model"], messages=messages,
                                                     tools=tools)
        choice = reply.choices[0]
        messages.append(choice.message.model_dump(exclude_none=True))
        if choice.finish_reason != "tool_calls":
            return choice.message.content
        for call in choice.message.tool_calls:
            text = await asyncio.to_thread(_calculator, json.loads(call.function.arguments))
            messages.append({"role": "tool", "tool_call_id": call.id, "content": text})
    return None


def forgetful_agent(base_url, session_id, row):
    """Asks twice, the second time without the first exchange: history rewritten."""
    client = _client(base_url, session_id)
    for _ in range(2):
        client.chat.completions.create(model=row["model"], messages=row["raw_prompt"])
    return "done"


def headerless_agent(base_url, session_id, row):
    """Forgets the session header: nothing is recorded for the trajectory."""
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)
    reply = client.chat.completions.create(model=row["model"], messages=row["raw_prompt"])
    return reply.choices[0].message.content


def idle_agent(base_url, session_id, row):
    """Returns without asking anything."""
    return "nothing"


def follow_up_agent(base_url, session_id, row):
    """Three short requests in one conversation, a user message after each reply (no tools: a
    tiny random model writes none). Returns the last reply's text."""
    client = _client(base_url, session_id)
    messages = [dict(m) for m in row["raw_prompt"]]
    for follow_up in ("more", "again", None):
        reply = client.chat.completions.create(model=row["model"], messages=messages, max_tokens=5)
        if follow_up is None:
            return reply.choices[0].message.content
        messages.append(reply.choices[0].message.model_dump(exclude_none=True))
        messages.append({"role": "user", "content": follow_up})


def stop_string_agent(base_url, session_id, row):
    """A ReAct-style agent: its first request stops at "Observation" (the reply is cut there),
    then it sends one user message and asks again."""
    client = _client(base_url, session_id)
    messages = [dict(m) for m in row["raw_prompt"]]
    reply = client.chat.completions.create(model=row["model"], messages=messages, stop=["Observation"])
    messages.append(reply.choices[0].message.model_dump(exclude_none=True))
    messages.append({"role": "user", "content": "go on"})
    reply = client.chat.completions.create(model=row["model"], messages=messages)
    return reply.choices[0].message.content
