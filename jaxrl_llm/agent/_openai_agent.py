"""The `openai_agent` loop: a user's agent, written against the OpenAI chat API, trained unchanged.

For each trajectory the loop calls the user's function `agent(base_url, session_id, row)`
(`rollout.multi_turn.openai_agent_path` / `openai_agent_name`) in a thread (or awaits it, when it
is a coroutine function). The function talks to `base_url` (an OpenAI-compatible endpoint,
`rollout._openai.OpenAIServer`, served in this process over the trainer's own request-level
server: the run's weights and policy versions) with the `openai` client or plain HTTP, sending
the header `X-Session-Id: session_id` on every request. The endpoint records each request of the
session (prompt ids, response ids, log-probs, policy versions); when the function returns, the
recorded requests become ONE trajectory: the first request's prompt is the prompt, each
response is trained (mask 1, its log-probs and versions), and the tokens between a response and
the next request's new tokens (tool results, user messages, template glue) are masked 0.

The session hook makes the agent's requests sample exactly as `ToolAgentLoop`'s: the trainer's
sampling settings, seed and row stream (turn k of row r samples row r + k x TURN_ROW_STRIDE, k
counting the messages after the first request's, as the tool loop counts turns), max_tokens
capped by what is left of `data.max_response_length`; and when a request's messages extend the
previous request's messages plus the reply it got, its prompt is the previous prompt + response
+ the new messages' tokens rendered as the tool loop renders them (`turn_delta_ids`), not a
re-tokenization of the whole conversation. A request whose prompt does not extend the previous
request's prompt + response (the agent rewrote or dropped history) fails the trajectory with a
`ValueError` naming the request: one trajectory is one growing conversation.

Router replay (`actor.router_replay.mode` record / replay): the server records the experts of
every token each request fed (`GenerateOutput.routed_experts`, filed with the request); since
every request's prompt extends the trajectory so far, they merge per request exactly as
`ToolAgentLoop`'s turns do (`merge_turn_experts`): a token keeps the experts of the request that
first fed it (a parked KV's), tool / user / template tokens get those of the request that
prefilled them, and only the last response's last token (never fed) is -1.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import hashlib
import importlib
import importlib.util
import inspect
import os
import sys
import threading
import time
import uuid
from typing import Any, Callable

from jaxrl_llm.agent._loop import (TURN_ROW_STRIDE, AgentLoopOutput, AgentSample, ToolAgentLoop,
                                   _Trajectory, merge_turn_experts, register_agent_loop)

MODEL_NAME = "policy"  # the model name the endpoint serves (requests must send model="policy")


def load_agent_fn(path: str, name: str) -> Callable:
    """`name` from the Python file `path`, or from the importable module `path` (dotted)."""
    where = "rollout.multi_turn.openai_agent_path"
    if not path:
        raise ValueError(f"the openai_agent loop needs {where} (a .py file or a dotted module) "
                         f"and rollout.multi_turn.openai_agent_name (the function)")
    if path.endswith(".py") or os.sep in path:
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{where}={path!r}: no such file")
        digest = hashlib.sha1(os.path.abspath(path).encode()).hexdigest()[:12]
        module_name = "jaxrl_llm_openai_agent_" + digest
        module = sys.modules.get(module_name)
        if module is None:
            spec = importlib.util.spec_from_file_location(module_name, path)
            module = importlib.util.module_from_spec(spec)
            sys.modules[module_name] = module
            spec.loader.exec_module(module)
    else:
        module = importlib.import_module(path)
    fn = getattr(module, name, None)
    if not callable(fn):
        raise AttributeError(f"{where}={path!r} has no function {name!r} "
                             f"(rollout.multi_turn.openai_agent_name)")
    return fn


@dataclasses.dataclass
class _Session:
    loop: "OpenAIAgentLoop"
    sample: AgentSample
    first_len: int = -1  # the first request's prompt length; -1 before it
    first_messages: int = 0  # how many messages the first request had
    last_k: int = -1  # the last request's turn index (its PRNG row is row + k * TURN_ROW_STRIDE)
    conversation: list | None = None  # the last request's messages + the reply it got
    prompt: list = dataclasses.field(default_factory=list)  # the last request's prompt ids
    context: list = dataclasses.field(default_factory=list)  # its prompt + response ids
    turn_end: str = "stop_token"  # how the last reply ended: stop_token | stop_string | length
    tool_calls: int = 0


def _turn_end(out, tokenizer) -> str:
    """How a reply ended: "stop_token" (its last token is a stop token), "stop_string" (the
    endpoint cut it at a request's `stop` string, before any stop token: the next prompt must
    close the turn itself) or "length" (the budget cut it)."""
    if out.finish_reason != "stop":
        return "length"
    stops = getattr(tokenizer, "eos_token_ids", None) or (tokenizer.eos_token_id,)
    return "stop_token" if int(out.token_ids[-1]) in set(stops) else "stop_string"


class _Hook:
    """The endpoint's `session_hook`: the trainer's sampling for the sessions of running
    trajectories; a request without a running trajectory's session id is refused (HTTP 400), so
    nothing is generated or recorded that no trajectory collects."""

    def __init__(self):
        self.lock = threading.Lock()
        self.sessions: dict[str, _Session] = {}

    def before(self, session_id, messages, tools, prompt_ids, opts):
        from rollout._openai import SESSION_HEADER, RequestError

        with self.lock:
            st = self.sessions.get(session_id)
        if st is None:  # the endpoint serves the trainer's running trajectories only
            why = "no header" if session_id is None else "no running trajectory has it"
            raise RequestError(
                f"this endpoint trains agents: each request must carry the header "
                f"'{SESSION_HEADER}: <session_id>' with the session id the agent function was "
                f"given (got {session_id!r}: {why})",
                param=SESSION_HEADER, code="invalid_session")
        ctx = st.loop.ctx
        if opts["n"] != 1:
            raise RequestError("a training session samples one choice a request: send n=1",
                               param="n", code="invalid_value")
        k = st.last_k + 1
        if st.first_len < 0:
            if len(prompt_ids) > ctx.max_prompt_length:
                raise RequestError(f"the first prompt of the trajectory has {len(prompt_ids)} "
                                   f"tokens, more than data.max_prompt_length="
                                   f"{ctx.max_prompt_length}", param="messages",
                                   code="context_length_exceeded")
            st.first_len, st.first_messages, k = len(prompt_ids), len(messages or ()), 0
        elif messages is not None and st.conversation is not None and (
                len(messages) > len(st.conversation)
                and messages[:len(st.conversation)] == st.conversation):
            new = messages[len(st.conversation):]
            prompt_ids = st.context + st.loop.delta_ids(new, tools, st.turn_end)
            k = max(k, len(messages) - st.first_messages)
        budget = ctx.max_response_length - (len(prompt_ids) - st.first_len)
        asked = opts["max_tokens"]
        opts.update(sampling=ctx.sampling, seed=ctx.seed, row=st.sample.row + k * TURN_ROW_STRIDE,
                    max_tokens=max(0, min(budget, asked) if asked is not None else budget))
        st.last_k, st.prompt = k, list(prompt_ids)
        return prompt_ids

    def after(self, session_id, messages, reply, out):
        with self.lock:
            st = self.sessions.get(session_id)
        if st is None or not len(out.token_ids):
            return
        conv = None
        if messages is not None and reply is not None:
            conv = messages + st.loop.endpoint.server.convert_messages([reply])
            st.tool_calls += len(reply.get("tool_calls") or ())
        st.conversation, st.context = conv, st.prompt + list(out.token_ids)
        st.turn_end = _turn_end(out, st.loop.tokenizer)


class _Endpoint:
    """One OpenAI endpoint (+ recorder, hook, agent threads) per request-level server."""

    def __init__(self, ctx):
        from rollout._openai import OpenAIServer, SessionRecorder

        self.recorder, self.hook = SessionRecorder(), _Hook()
        self.server = OpenAIServer(
            ctx.server, ctx.tokenizer, model_name=MODEL_NAME, tool_parser=ctx.multi_turn.format,
            max_n=1, recorder=self.recorder, session_hook=self.hook,
            max_target_length=ctx.max_prompt_length + ctx.max_response_length)
        self.base_url = f"http://{self.server.host}:{self.server.port}/v1"
        self.threads = concurrent.futures.ThreadPoolExecutor(256, thread_name_prefix="openai_agent")

    def close(self) -> None:
        self.server.close()
        self.threads.shutdown(wait=False, cancel_futures=True)


_ENDPOINTS: dict[int, tuple[Any, _Endpoint]] = {}
_ENDPOINTS_LOCK = threading.Lock()


def openai_endpoint(ctx) -> _Endpoint:
    """The endpoint over `ctx.server`, started on first use and reused by later trajectories."""
    with _ENDPOINTS_LOCK:
        held = _ENDPOINTS.get(id(ctx.server))
        if held is None or held[0] is not ctx.server:
            held = _ENDPOINTS[id(ctx.server)] = (ctx.server, _Endpoint(ctx))
        return held[1]


def close_openai_endpoint(server) -> None:
    """Stops the endpoint over `server`, if one was started (`AgentRunner.close` calls it)."""
    with _ENDPOINTS_LOCK:
        held = _ENDPOINTS.pop(id(server), None)
    if held is not None and held[0] is server:
        held[1].close()


@register_agent_loop("openai_agent")
class OpenAIAgentLoop(ToolAgentLoop):
    """The user's OpenAI-client agent, over the trainer's server, as one trajectory (module
    docstring). The reward is the row's usual reward function on the last response's text (as
    for `tool_agent`); the agent's return value is kept in `extra_fields["agent_result"]`."""

    async def run(self, sample: AgentSample) -> AgentLoopOutput:
        mt, t0 = self.ctx.multi_turn, time.perf_counter()
        fn = load_agent_fn(mt.openai_agent_path, mt.openai_agent_name)
        self.endpoint = openai_endpoint(self.ctx)
        session = uuid.uuid4().hex
        hook = self.endpoint.hook
        with hook.lock:
            hook.sessions[session] = st = _Session(self, sample)
        row = {**dataclasses.asdict(sample), "model": MODEL_NAME}
        try:
            if inspect.iscoroutinefunction(fn):
                result = await fn(self.endpoint.base_url, session, row)
            else:
                result = await asyncio.get_running_loop().run_in_executor(
                    self.endpoint.threads, fn, self.endpoint.base_url, session, row)
        finally:
            with hook.lock:
                hook.sessions.pop(session, None)
            turns = self.endpoint.recorder.pop(session)
            self.ctx.server.release_session(session)
        traj = self._trajectory(session, turns)
        n_turns, conv = len(turns), st.conversation
        rounds = users = 0
        if conv is not None:  # verl's count: tool rounds and user replies after the prompt
            later = conv[st.first_messages:]
            users = sum(m["role"] == "user" for m in later)
            rounds = sum(m["role"] == "tool" and (i == 0 or later[i - 1]["role"] != "tool")
                         for i, m in enumerate(later))
        # the tool calls the endpoint parsed; the agent's own tool time and errors are its business
        metrics = {"num_tool_calls": float(st.tool_calls), "num_assistant_turns": float(n_turns),
                   "num_user_turns": float(users), "total_s": time.perf_counter() - t0}
        return AgentLoopOutput(
            prompt_ids=traj.prompt_ids, response_ids=traj.ids, response_mask=traj.mask,
            response_logprobs=traj.logprobs, response_versions=traj.versions,
            routed_experts=traj.experts, num_turns=1 + n_turns + rounds + users, metrics=metrics,
            extra_fields={"finish_reason": turns[-1].finish_reason, "tool_rewards": {},
                          "turn_texts": traj.turn_texts, "agent_result": result,
                          "messages": conv or []})

    def _trajectory(self, session: str, turns) -> _Trajectory:
        """The session's recorded requests as one trajectory (the module docstring's rules)."""
        if not turns:
            raise ValueError(f"openai_agent: the agent returned without a request in session "
                             f"{session!r}: a trajectory needs at least one, each with the header "
                             f"'X-Session-Id: <session_id>' (e.g. openai.OpenAI(default_headers="
                             f"{{'X-Session-Id': session_id}}))")
        traj = _Trajectory(list(turns[0].prompt_ids), [])
        context = list(turns[0].prompt_ids)
        for i, t in enumerate(turns):
            if list(t.prompt_ids[:len(context)]) != context:
                raise ValueError(
                    f"openai_agent: request {i} of session {session!r} does not extend the "
                    f"conversation so far (its prompt's first {len(context)} tokens differ from "
                    f"the previous request's prompt + response: the agent rewrote or dropped "
                    f"earlier messages); a trajectory is one growing conversation")
            traj.add(t.prompt_ids[len(context):], 0)
            traj.add(t.response_ids, 1, t.log_probs, t.policy_versions)
            traj.turn_texts.append(self.tokenizer.decode(t.response_ids))
            traj.experts = merge_turn_experts(traj.experts, t.routed_experts)
            context = list(t.prompt_ids) + list(t.response_ids)
        return traj

    def delta_ids(self, new_messages: list[dict], tools, turn_end: str) -> list[int]:
        """`turn_delta_ids` rendered with the request's tools; `turn_end` as `_turn_end`."""
        self._request_tools = tools
        return self.turn_delta_ids(new_messages, ended_with_stop=turn_end == "stop_token",
                                   cut_by_stop_string=turn_end == "stop_string")

    def render(self, messages: list[dict], *, add_generation_prompt: bool) -> str:
        tools = getattr(self, "_request_tools", None)
        kwargs = {"tools": tools} if tools else {}
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                  **kwargs)
