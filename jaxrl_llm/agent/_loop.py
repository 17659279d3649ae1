"""Agent loops (verl's AgentLoop): one data row -> one trajectory, in token ids.

A loop sends token-level requests to the rollout server (`server.agenerate`, one per assistant
turn, all turns of a trajectory in one session so the server reuses their KV), parses tool calls
from what the model wrote, runs tools or a simulated user (interaction), and appends their
messages' tokens to the response with `response_mask = 0`. The model's tokens carry mask 1 and
their log-probs; everything else carries log-prob 0.

Registry: `@register_agent_loop("name")` on an `AgentLoopBase` subclass; rows pick a loop by
their `agent_name` column (`AGENT_LOOPS` holds `single_turn_agent` and `tool_agent`).

Tokens of non-model turns are rendered with the model's own chat template: a fixed two-message
conversation is rendered with and without the new messages and the difference is tokenized
(verl's method), plus whatever the template writes after an assistant's end-of-turn token
that the model itself never generates (Qwen's "\\n" after `<|im_end|>`). Scoring, batching and
devices are other modules' business.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from typing import Any

import numpy as np

from jaxrl_llm import _chaos
from jaxrl_llm.agent._parsers import ToolCall, get_tool_parser
from jaxrl_llm.agent.tools import BaseTool, create_tool_instance, run_tool_call

log = logging.getLogger(__name__)

# Requests of turn k of a trajectory use row `row + k * TURN_ROW_STRIDE` of the server's PRNG
# streams, so turns never repeat each other's randomness (rows of one batch stay below it).
TURN_ROW_STRIDE = 1 << 20
_MARK = "END_OF_ASSISTANT_CONTENT"  # a stand-in assistant message when rendering turn deltas
_WARNED_MISMATCH = False


@dataclasses.dataclass(frozen=True)
class AgentSample:
    """One trajectory to run: a data row (verl schema fields) and which of its `n` samples."""

    raw_prompt: list[dict]
    data_source: str
    ground_truth: Any
    extra_info: dict
    agent_name: str
    row: int  # this trajectory's row in the batch (prompt i's samples are rows i*n .. i*n+n-1)


@dataclasses.dataclass
class AgentLoopOutput:
    """verl's fields. response_mask: 1 = model token, 0 = tool / user / template token;
    response_logprobs: the engine's log-prob of each model token, 0.0 elsewhere;
    response_versions: the policy version that sampled each model token, -1 elsewhere (a loop
    that leaves it empty reports -1 for every token).
    routed_experts (router replay; None when the server records none): int8/int16
    [len(prompt_ids) + len(response_ids), layers, k], the experts the engine chose for each token
    it fed (`GenerateOutput.routed_experts`), -1 where it fed none (`merge_turn_experts`)."""

    prompt_ids: list[int]
    response_ids: list[int]
    response_mask: list[int]
    response_logprobs: list[float]
    num_turns: int  # verl's count: 1 (the prompt) + assistant turns + tool rounds + user replies
    metrics: dict[str, float]
    extra_fields: dict[str, Any]
    response_versions: list[int] = dataclasses.field(default_factory=list)
    routed_experts: Any = None


def merge_turn_experts(kept, turn):
    """A trajectory's experts after one more turn: `turn` (the turn's `GenerateOutput.routed_experts`,
    covering the whole conversation it was asked with plus its completion) with the positions an
    earlier turn already fed taken from `kept` (the trajectory's so far, whose last position, a
    completion's last token, was not fed then): a token keeps the experts the engine chose when it
    first fed it (the parked KV's, or what an earlier turn saw when a later one re-prefilled it),
    and tool / user tokens get those of the later turn that prefilled them. None when not recorded."""
    if turn is None:
        return kept
    merged = np.array(turn)
    if kept is not None:
        fed = min(len(kept) - 1, len(merged))
        merged[:fed] = kept[:fed]
    return merged


@dataclasses.dataclass
class AgentContext:
    """What every loop of a run shares. `server` has `agenerate(...)` and `release_session(id)`
    (a `rollout.RolloutServer`); `multi_turn` is the run's `MultiTurnConfig`."""

    server: Any
    tokenizer: Any
    multi_turn: Any
    max_prompt_length: int
    max_response_length: int
    sampling: Any
    seed: int
    tools: dict[str, BaseTool] = dataclasses.field(default_factory=dict)
    interactions: dict[str, Any] = dataclasses.field(default_factory=dict)


AGENT_LOOPS: dict[str, type["AgentLoopBase"]] = {}


def register_agent_loop(name: str):
    """Class decorator: rows with `agent_name == name` run this loop."""
    def wrap(cls):
        if name in AGENT_LOOPS and AGENT_LOOPS[name] is not cls:
            raise ValueError(f"agent loop {name!r} is already registered ({AGENT_LOOPS[name]})")
        AGENT_LOOPS[name] = cls
        cls.agent_name = name
        return cls
    return wrap


def get_agent_loop(name: str) -> type["AgentLoopBase"]:
    if name not in AGENT_LOOPS:
        raise ValueError(f"unknown agent loop {name!r} (the row's agent_name or "
                         f"rollout.multi_turn.default_agent_loop); registered: {sorted(AGENT_LOOPS)}")
    return AGENT_LOOPS[name]


class AgentLoopBase:
    """Subclass, implement `run`, decorate with `@register_agent_loop(name)`."""

    agent_name = ""

    def __init__(self, ctx: AgentContext):
        self.ctx = ctx
        self.tokenizer = ctx.tokenizer

    async def run(self, sample: AgentSample) -> AgentLoopOutput:
        raise NotImplementedError

    # -- helpers for subclasses ---------------------------------------------------------------
    def tool_schemas(self) -> list[dict] | None:
        return [t.get_openai_tool_schema().to_dict() for t in self.ctx.tools.values()] or None

    def render(self, messages: list[dict], *, add_generation_prompt: bool) -> str:
        kwargs = {"tools": self.tool_schemas()} if self.ctx.tools else {}
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                  **kwargs)

    def encode_prompt(self, messages: list[dict]) -> list[int]:
        ids = list(self.tokenizer.encode(self.render(messages, add_generation_prompt=True)))
        if len(ids) > self.ctx.max_prompt_length:
            raise ValueError(f"agent prompt has {len(ids)} tokens (chat template with the tool "
                             f"schemas), more than data.max_prompt_length="
                             f"{self.ctx.max_prompt_length}; raise data.max_prompt_length")
        return ids

    async def generate(self, session: str, prompt_ids: list[int], sample: AgentSample, turn: int,
                       max_new_tokens: int):
        return await self.ctx.server.agenerate(
            f"{session}-{turn}", prompt_ids, sampling=self.ctx.sampling,
            max_new_tokens=max_new_tokens, session_id=session, seed=self.ctx.seed,
            row=sample.row + turn * TURN_ROW_STRIDE)


@register_agent_loop("single_turn_agent")
class SingleTurnAgentLoop(AgentLoopBase):
    """One completion of the prompt (the batch driver's job, as a request)."""

    async def run(self, sample: AgentSample) -> AgentLoopOutput:
        t0 = time.perf_counter()
        prompt_ids = self.encode_prompt(sample.raw_prompt)
        session = uuid.uuid4().hex
        try:
            out = await self.generate(session, prompt_ids, sample, 0, self.ctx.max_response_length)
        finally:
            self.ctx.server.release_session(session)
        n = len(out.token_ids)
        return AgentLoopOutput(
            prompt_ids=prompt_ids, response_ids=list(out.token_ids), response_mask=[1] * n,
            response_logprobs=[float(x) for x in out.log_probs], num_turns=2,  # prompt, reply
            response_versions=[int(v) for v in out.policy_versions],
            routed_experts=getattr(out, "routed_experts", None),
            metrics={"generate_s": time.perf_counter() - t0, "num_tool_calls": 0.0,
                     "num_tool_errors": 0.0},
            extra_fields={"finish_reason": out.finish_reason, "turn_texts": [
                self.tokenizer.decode(out.token_ids)]})


def truncate_text(text: str, limit: int, side: str) -> str:
    """verl's tool-response truncation: keep `limit` characters from the left, the right, or
    both ends (middle), marking the cut."""
    if len(text) <= limit:
        return text
    if side == "left":
        return text[:limit] + "...(truncated)"
    if side == "right":
        return "(truncated)..." + text[-limit:]
    half = limit // 2
    return text[:half] + "\n...(truncated)...\n" + text[len(text) - (limit - half):]


@dataclasses.dataclass
class _Trajectory:
    prompt_ids: list[int]
    messages: list[dict]
    ids: list[int] = dataclasses.field(default_factory=list)
    mask: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    versions: list[int] = dataclasses.field(default_factory=list)
    turn_texts: list[str] = dataclasses.field(default_factory=list)
    experts: Any = None  # router replay: [positions fed so far + 1, L, k] (merge_turn_experts)

    def add(self, ids, mask_value: int, logprobs=None, versions=None):
        self.ids += list(ids)
        self.mask += [mask_value] * len(ids)
        self.logprobs += [float(x) for x in logprobs] if logprobs is not None else [0.0] * len(ids)
        self.versions += [int(v) for v in versions] if versions is not None else [-1] * len(ids)


@register_agent_loop("tool_agent")
class ToolAgentLoop(AgentLoopBase):
    """Multi-turn: generate; run the tool calls it wrote (tools' messages appended, mask 0);
    with no tool call, let the row's interaction (simulated user) answer, if it has one; stop
    when neither applies, a turn limit or the response budget is reached."""

    async def run(self, sample: AgentSample) -> AgentLoopOutput:
        mt, t_start = self.ctx.multi_turn, time.perf_counter()
        parser = get_tool_parser(mt.format)
        schemas = {name: tool.get_openai_tool_schema().function.parameters
                   for name, tool in self.ctx.tools.items()}
        traj = _Trajectory(self.encode_prompt(sample.raw_prompt), [dict(m) for m in sample.raw_prompt])
        session = uuid.uuid4().hex
        m = {"generate_s": 0.0, "tool_calls_s": 0.0, "num_tool_calls": 0.0, "num_tool_errors": 0.0,
             "interaction_s": 0.0}
        instances: dict[str, str] = {}
        tools_kwargs = dict(sample.extra_info.get("tools_kwargs") or {})
        interaction, iid, interaction_kwargs = await self._start_interaction(sample)
        assistant_turns = user_turns = tool_rounds = tool_messages = 0
        finish_reason, tool_rewards = "stop", {}
        try:
            while True:
                budget = self.ctx.max_response_length - len(traj.ids)
                if budget <= 0:
                    finish_reason = "length"
                    break
                t0 = time.perf_counter()
                out = await self.generate(session, traj.prompt_ids + traj.ids, sample,
                                          assistant_turns + user_turns + tool_messages, budget)
                m["generate_s"] += time.perf_counter() - t0
                traj.add(out.token_ids, 1, out.log_probs, out.policy_versions)
                traj.experts = merge_turn_experts(traj.experts, getattr(out, "routed_experts", None))
                assistant_turns += 1
                text = self.tokenizer.decode(out.token_ids)
                traj.turn_texts.append(text)
                traj.messages.append({"role": "assistant", "content": text})
                if out.finish_reason != "stop":
                    finish_reason = out.finish_reason
                    break
                if mt.max_assistant_turns and assistant_turns >= mt.max_assistant_turns:
                    break
                _, calls = parser.parse(text, schemas)
                if calls:
                    t0 = time.perf_counter()
                    replies = await self._run_calls(calls, instances, tools_kwargs, m)
                    m["tool_calls_s"] += time.perf_counter() - t0
                    new, kind = [{"role": "tool", "content": r} for r in replies], "tool"
                elif interaction is not None and not (mt.max_user_turns and user_turns >= mt.max_user_turns):
                    t0 = time.perf_counter()
                    done, reply, _, _ = await interaction.generate_response(
                        iid, traj.messages, **interaction_kwargs)  # verl passes them too
                    m["interaction_s"] += time.perf_counter() - t0
                    if done:
                        break
                    new, kind = [{"role": "user", "content": reply}], "user"
                else:
                    break
                delta = self.turn_delta_ids(new, ended_with_stop=True)
                if len(traj.ids) + len(delta) >= self.ctx.max_response_length:
                    finish_reason = "length"  # no room left to answer after these messages
                    break
                traj.add(delta, 0)
                traj.messages += new
                tool_rounds += kind == "tool"
                tool_messages += len(new) if kind == "tool" else 0
                user_turns += kind == "user"
            tool_rewards = await self._finish_tools(instances, tools_kwargs)
        finally:
            self.ctx.server.release_session(session)
        extra = {"finish_reason": finish_reason, "tool_rewards": tool_rewards,
                 "turn_texts": traj.turn_texts, "messages": traj.messages}
        if interaction is not None:
            extra["interaction_score"] = float(await interaction.calculate_score(iid))
            await interaction.finalize_interaction(iid)
        m["tokenization_mismatch"] = float(not self.sanity_check(traj))
        m.update(num_assistant_turns=float(assistant_turns), num_user_turns=float(user_turns),
                 total_s=time.perf_counter() - t_start)
        return AgentLoopOutput(
            prompt_ids=traj.prompt_ids, response_ids=traj.ids, response_mask=traj.mask,
            response_logprobs=traj.logprobs, response_versions=traj.versions,
            routed_experts=traj.experts,
            num_turns=1 + assistant_turns + tool_rounds + user_turns, metrics=m,
            extra_fields=extra)

    # -- tools ----------------------------------------------------------------------------------
    async def _run_calls(self, calls: list[ToolCall], instances: dict, tools_kwargs: dict,
                         m: dict) -> list[str]:
        calls = calls[:self.ctx.multi_turn.max_parallel_calls]
        results = await asyncio.gather(*(self._run_call(c, instances, tools_kwargs) for c in calls))
        m["num_tool_calls"] += len(calls)
        m["num_tool_errors"] += sum(err for _, err in results)
        mt = self.ctx.multi_turn
        return [truncate_text(text, mt.max_tool_response_length, mt.tool_response_truncate_side)
                for text, _ in results]

    async def _run_call(self, call: ToolCall, instances: dict, tools_kwargs: dict) -> tuple[str, bool]:
        """(the tool message's text, whether the call failed). Never raises."""
        if call.error is not None:
            return f"Error: could not parse the tool call: {call.error}", True
        tool = self.ctx.tools.get(call.name)
        if tool is None:
            return (f"Error: unknown tool {call.name!r}; available tools: "
                    f"{sorted(self.ctx.tools)}"), True
        kwargs = dict(tools_kwargs.get(call.name) or {})
        try:
            if call.name not in instances:  # one instance per tool and trajectory
                instances[call.name] = await create_tool_instance(
                    tool, dict(kwargs.get("create_kwargs") or {}))
        except Exception as e:  # noqa: BLE001 - a tool never crashes a rollout
            return f"Error: tool {call.name!r} could not start: {type(e).__name__}: {e}", True
        _chaos.kill_point("tool_call")  # scripts/chaos.py; one comparison when not set
        response, _, metrics = await run_tool_call(
            tool, instances[call.name], call.arguments, timeout_s=self.ctx.multi_turn.tool_timeout_s,
            **dict(kwargs.get("execute_kwargs") or {}))
        return response.text, "error" in metrics

    async def _finish_tools(self, instances: dict, tools_kwargs: dict) -> dict[str, float]:
        rewards = {}
        for name, iid in instances.items():
            tool, kwargs = self.ctx.tools[name], dict(tools_kwargs.get(name) or {})
            try:
                rewards[name] = float(await tool.calc_reward(iid, **dict(kwargs.get("calc_reward_kwargs") or {})))
            except Exception as e:  # noqa: BLE001
                log.warning("tool %r calc_reward failed: %s", name, e)
                rewards[name] = 0.0
            try:
                await tool.release(iid, **dict(kwargs.get("release_kwargs") or {}))
            except Exception as e:  # noqa: BLE001
                log.warning("tool %r release failed: %s", name, e)
        return rewards

    # -- interaction ------------------------------------------------------------------------------
    async def _start_interaction(self, sample: AgentSample):
        """(the row's interaction, its instance id, its interaction_kwargs: passed to
        `start_interaction` and, as verl does, to every `generate_response`), or (None, None,
        {}). As verl: with no
        interactions configured a row's `interaction_kwargs` are ignored (verl's GSM8K tool rows
        carry them without a name) unless they name one; with interactions configured a row
        with `interaction_kwargs` must name one of them."""
        kwargs = dict(sample.extra_info.get("interaction_kwargs") or {})
        name = kwargs.get("name")
        if not kwargs or (name is None and not self.ctx.interactions):
            return None, None, {}
        if name not in self.ctx.interactions:
            configured = (f"rollout.multi_turn.interaction_config_path defines "
                          f"{sorted(self.ctx.interactions)}" if self.ctx.interactions else
                          "no interactions are configured (set "
                          "rollout.multi_turn.interaction_config_path)")
            raise ValueError(f"row asks for interaction {name!r} "
                             f"(extra_info.interaction_kwargs.name) but {configured}")
        kwargs.setdefault("ground_truth", sample.ground_truth)
        interaction = self.ctx.interactions[name]
        iid = await interaction.start_interaction(**kwargs)
        return interaction, iid, kwargs

    # -- tokenization ---------------------------------------------------------------------------
    def turn_delta_ids(self, new_messages: list[dict], *, ended_with_stop: bool,
                       cut_by_stop_string: bool = False) -> list[int]:
        """Token ids that follow a finished assistant turn: `new_messages` (tool / user) in the
        chat template, then the generation prompt of the next assistant turn. The turn's end
        comes first: after the model's stop token (`ended_with_stop`) what the template writes
        after it (e.g. "\\n"); after a reply cut at a stop string (the OpenAI endpoint's `stop`),
        the template's whole end of turn, its stop token included; nothing after a reply the
        budget cut."""
        base = [{"role": "user", "content": "x"}, {"role": "assistant", "content": _MARK}]
        before = self.render(base, add_generation_prompt=False)
        after = self.render(base + new_messages, add_generation_prompt=True)
        if not after.startswith(before):
            raise ValueError("the chat template is not incremental: rendering a conversation with "
                             "more messages does not extend rendering it with fewer")
        if cut_by_stop_string:
            end = before[before.rindex(_MARK) + len(_MARK):]
        else:
            end = self._end_of_turn_rest(before) * ended_with_stop
        return list(self.tokenizer.encode(end + after[len(before):]))

    def _end_of_turn_rest(self, rendered: str) -> str:
        """What the template writes after an assistant's stop token (e.g. "\\n"): the model
        stops at the token, so the rest must be added with the next turn's tokens."""
        tail = rendered[rendered.rindex(_MARK) + len(_MARK):]
        for stop in getattr(self.tokenizer, "eos_token_ids", (self.tokenizer.eos_token_id,)):
            text = self.tokenizer.decode([stop], skip_special_tokens=False)
            if text and tail.startswith(text):
                return tail[len(text):]
        return ""

    def sanity_check(self, traj: _Trajectory) -> bool:
        """Turn-by-turn ids vs tokenizing the whole conversation (verl's
        tokenization_sanity_check_mode). True when they agree (or the check is disabled)."""
        mode = self.ctx.multi_turn.tokenization_sanity_check_mode
        if mode == "disable":
            return True
        gen_prompt = traj.messages[-1]["role"] != "assistant"
        whole = list(self.tokenizer.encode(self.render(traj.messages, add_generation_prompt=gen_prompt)))
        ours = traj.prompt_ids + traj.ids
        if mode == "strict":
            ok = whole[:len(ours)] == ours
        else:  # ignore_strippable: the same text up to whitespace
            squash = lambda ids: "".join(self.tokenizer.decode(ids, skip_special_tokens=False).split())  # noqa: E731
            ok = squash(whole).startswith(squash(ours))
        if not ok:
            global _WARNED_MISMATCH
            (log.debug if _WARNED_MISMATCH else log.warning)(
                "agent loop: turn-by-turn token ids differ from tokenizing the whole conversation "
                "(tokenization_sanity_check_mode=%s; counted in agent/tokenization_mismatch, "
                "warned once)", mode)
            _WARNED_MISMATCH = True
        return ok
