"""Runs a batch of agent loops concurrently and collates their trajectories into verl's fields.

Every trajectory is a coroutine: its agent loop talks to the rollout server (whose scheduler
batches all their requests together), and the moment it finishes it is scored by the streaming
`RewardLoop` while the others still generate. The result is host numpy in the trainer's layout
(rows in the order of `samples`, responses right-padded to `max_response_length`).
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxrl_llm.rewards import RewardFunctionError, Trajectory, judgement_metrics, question_of

from jaxrl_llm.agent._loop import AgentContext, AgentLoopOutput, AgentSample, get_agent_loop
from jaxrl_llm.agent.interactions import load_interactions
from jaxrl_llm.agent.tools import load_isolated_function_tools, load_tools
from jaxrl_llm.sandbox import SandboxError, make_sandbox


def load_agent_resources(multi_turn) -> tuple[dict, dict, list]:
    """(tools by name, interactions by name, processes to close) from `rollout.multi_turn`'s
    config paths. Function tools (`function_tool_path`) run in worker processes and tool-config
    classes that are not built-ins in a process each, all with `tool_memory_limit_gb`; the
    built-in tools run in this process. Model-written code (the `python` tool) and the function
    tools' workers run in the `multi_turn.sandbox` backend."""
    limits = dict(timeout_s=multi_turn.tool_timeout_s, memory_limit_gb=multi_turn.tool_memory_limit_gb)
    try:
        box = make_sandbox(multi_turn.sandbox)
    except SandboxError as e:
        raise SandboxError(f"rollout.multi_turn.sandbox={multi_turn.sandbox!r}: {e}") from None
    tools = load_tools(multi_turn.tool_config_path, isolated=limits, sandbox=box) if (
        multi_turn.tool_config_path) else {}
    pools = [t for t in tools.values() if hasattr(t, "close")]  # tool classes' host processes
    if multi_turn.function_tool_path:
        isolated, pool = load_isolated_function_tools(
            multi_turn.function_tool_path, timeout_s=multi_turn.tool_timeout_s,
            memory_limit_gb=multi_turn.tool_memory_limit_gb, num_workers=multi_turn.tool_workers,
            sandbox=box)
        pools.append(pool)
        for name, tool in isolated.items():
            if name in tools:
                pool.close()
                raise ValueError(f"tool {name!r} is defined twice (tool_config_path and "
                                 f"function_tool_path); tool names must be unique")
            tools[name] = tool
    interactions = load_interactions(multi_turn.interaction_config_path) if (
        multi_turn.interaction_config_path) else {}
    return tools, interactions, pools


class AgentRunner:
    """`runner.run(samples, sampling=..., seed=...)` -> dict of host arrays (see `collate`).

    server: a `rollout.RolloutServer` (or anything with `agenerate` and `release_session`);
    reward_loop: a `rewards.RewardLoop`, or None to leave `scores` at 0.
    """

    def __init__(self, server, tokenizer, multi_turn, *, max_prompt_length: int,
                 max_response_length: int, pad_token_id: int, reward_loop=None,
                 tools: dict | None = None, interactions: dict | None = None,
                 max_error_fraction: float = 1.0):
        self.server, self.tokenizer, self.multi_turn = server, tokenizer, multi_turn
        self.max_prompt_length, self.max_response_length = max_prompt_length, max_response_length
        self.pad_token_id, self.reward_loop = pad_token_id, reward_loop
        self.max_error_fraction = max_error_fraction
        self._pools = []
        if tools is None and interactions is None:
            tools, interactions, self._pools = load_agent_resources(multi_turn)
        self.tools, self.interactions = dict(tools or {}), dict(interactions or {})

    def close(self) -> None:
        """Stops the tool processes, the reward loop's thread and the openai_agent endpoint."""
        from jaxrl_llm.agent._openai_agent import close_openai_endpoint
        close_openai_endpoint(self.server)
        for pool in self._pools:
            pool.close()
        self._pools = []
        if self.reward_loop is not None:
            self.reward_loop.close()

    def run(self, samples: Sequence[AgentSample], *, sampling, seed: int) -> dict[str, Any]:
        return asyncio.run(self.arun(samples, sampling=sampling, seed=seed))

    async def arun(self, samples: Sequence[AgentSample], *, sampling, seed: int) -> dict[str, Any]:
        return self.collate(samples, await self.arun_results(samples, sampling=sampling, seed=seed))

    async def arun_results(self, samples: Sequence[AgentSample], *, sampling, seed: int) -> list:
        """The per-trajectory results that `collate` takes (agent name, `AgentLoopOutput`,
        finished_s, `RowScore` or None, scored_s), in the order of `samples`: a host's share
        of a batch that several hosts run (collated once all shares are together)."""
        ctx = AgentContext(server=self.server, tokenizer=self.tokenizer, multi_turn=self.multi_turn,
                           max_prompt_length=self.max_prompt_length,
                           max_response_length=self.max_response_length, sampling=sampling,
                           seed=int(seed), tools=self.tools, interactions=self.interactions)
        t0 = time.perf_counter()
        return list(await asyncio.gather(*(self._one(ctx, s, t0) for s in samples)))

    async def _one(self, ctx: AgentContext, sample: AgentSample, t0: float):
        name = sample.agent_name or self.multi_turn.default_agent_loop
        out = await get_agent_loop(name)(ctx).run(sample)
        finished = time.perf_counter() - t0
        score = None
        if self.reward_loop is not None:
            texts = out.extra_fields.get("turn_texts") or [""]
            info = {**sample.extra_info, "num_turns": out.num_turns,
                    "tool_rewards": out.extra_fields.get("tool_rewards", {}),
                    "response_text": self.tokenizer.decode(out.response_ids)}
            if "interaction_score" in out.extra_fields:
                info["interaction_score"] = out.extra_fields["interaction_score"]
            traj = Trajectory(prompt_ids=tuple(out.prompt_ids), response_ids=tuple(out.response_ids),
                              question=question_of(sample.raw_prompt), response_text=info["response_text"])
            score = await self.reward_loop.score(sample.data_source, texts[-1], sample.ground_truth, info,
                                                 trajectory=traj)
        return name, out, finished, score, (score.scored_at - t0 if score is not None else 0.0)

    def collate(self, samples, results) -> dict[str, Any]:
        """responses / response_mask / response_attention_mask int32[b, t], rollout_log_probs
        f32[b, t], rollout_versions int32[b, t] (the policy version of each model token, -1
        elsewhere), prompt_ids (lists), scores f32[b], reward_extra {key: f32[b]}, num_turns
        int32[b], finished_s / scored_s f32[b] (seconds from the batch start), metrics, and per
        row the loop's conversation `messages` (prompt and turns, {role, content}; None for a loop
        that keeps none, e.g. single_turn_agent), and `routed_experts` (`collate_experts`)."""
        b, t = len(results), self.max_response_length
        responses = np.full((b, t), self.pad_token_id, np.int32)
        mask, attn = np.zeros((b, t), np.int32), np.zeros((b, t), np.int32)
        logp = np.zeros((b, t), np.float32)
        versions = np.full((b, t), -1, np.int32)
        scores, finished, scored = np.zeros(b, np.float32), np.zeros(b, np.float32), np.zeros(b, np.float32)
        extra: dict[str, np.ndarray] = {}
        reward_fail = {"reward/num_errors": 0.0, "reward/num_timeouts": 0.0}
        for i, (_, out, fin, score, scored_s) in enumerate(results):
            _check_output(out, t)
            n = len(out.response_ids)
            responses[i, :n], mask[i, :n], attn[i, :n] = out.response_ids, out.response_mask, 1
            logp[i, :n] = out.response_logprobs
            if out.response_versions:
                versions[i, :n] = out.response_versions
            finished[i] = fin
            if score is not None:
                scores[i], scored[i] = score.score, scored_s
                reward_fail["reward/num_errors"] += score.num_errors
                reward_fail["reward/num_timeouts"] += score.num_timeouts
                for k, v in score.extra.items():
                    extra.setdefault(k, np.zeros(b, np.float32))[i] = v
        self._check_reward_failures(samples, results)
        outs = [r[1] for r in results]
        metrics = {**agent_metrics(results), **reward_fail, **judge_metrics(results),
                   **{f"reward_extra/{k}/mean": float(v.mean()) for k, v in extra.items()}}
        return {"prompt_ids": [o.prompt_ids for o in outs], "responses": responses,
                "response_mask": mask, "response_attention_mask": attn, "rollout_log_probs": logp,
                "rollout_versions": versions, "scores": scores, "reward_extra": extra,
                "num_turns": np.asarray([o.num_turns for o in outs], np.int32),
                "finish_reasons": [o.extra_fields.get("finish_reason", "stop") for o in outs],
                "finished_s": finished, "scored_s": scored, "metrics": metrics,
                "turn_texts": [o.extra_fields.get("turn_texts", []) for o in outs],
                "messages": [o.extra_fields.get("messages") for o in outs],
                "routed_experts": collate_experts(outs, t)}


    def _check_reward_failures(self, samples, results) -> None:
        """reward.max_error_fraction over the batch (each row was scored alone)."""
        failed = [i for i, r in enumerate(results)
                  if r[3] is not None and (r[3].num_errors or r[3].num_timeouts)]
        if len(failed) > self.max_error_fraction * len(results):
            i = failed[0]
            raise RewardFunctionError(
                f"{len(failed)} of {len(results)} agent trajectories failed to score, more than "
                f"reward.max_error_fraction={self.max_error_fraction}: "
                f"{self.reward_loop.manager.describe()} (data_source {samples[i].data_source!r}) "
                f"is broken; see the reward warnings in the log for the first failure")


def collate_experts(outs, t: int):
    """Router replay: the trajectories' recorded experts in the driver's row layout
    (`RolloutResult.routed_experts`): [b, P + t, layers, k], each row's prompt left-padded to P
    (the longest prompt) then its response right-padded to t, -1 where the engine fed no token
    (padding, a response's last token, a row whose loop recorded none). None when no row has any."""
    have = [o.routed_experts for o in outs if o.routed_experts is not None]
    if not have:
        return None
    p = max(len(o.prompt_ids) for o in outs)
    out = np.full((len(outs), p + t, *np.shape(have[0])[1:]), -1, np.asarray(have[0]).dtype)
    for i, o in enumerate(outs):
        if o.routed_experts is not None:
            e = np.asarray(o.routed_experts)[:len(o.prompt_ids) + len(o.response_ids)]
            lo = p - len(o.prompt_ids)
            out[i, lo:lo + len(e)] = e
    return out


def judge_metrics(results) -> dict[str, float]:
    """reward/judge/* over the judged trajectories (`rewards.judgement_metrics`)."""
    return judgement_metrics([r[3].judgement for r in results
                              if r[3] is not None and r[3].judgement is not None])


def _check_output(out: AgentLoopOutput, t: int) -> None:
    n = len(out.response_ids)
    if not (len(out.response_mask) == len(out.response_logprobs) == n):
        raise ValueError(f"agent loop output has {n} response ids but {len(out.response_mask)} mask "
                         f"values and {len(out.response_logprobs)} log-probs")
    if out.response_versions and len(out.response_versions) != n:
        raise ValueError(f"agent loop output has {n} response ids but {len(out.response_versions)} "
                         "policy versions")
    if n > t:
        raise ValueError(f"agent loop returned {n} response tokens, more than "
                         f"data.max_response_length={t}")


def _stats(name: str, x) -> dict[str, float]:
    x = np.asarray(x, np.float64)
    return {f"{name}/mean": float(x.mean()), f"{name}/max": float(x.max()), f"{name}/min": float(x.min())}


def agent_metrics(results) -> dict[str, float]:
    """num_turns/*, tool_calls/*, tool_errors/*, per-agent timing and the tokenization check."""
    outs = [r[1] for r in results]
    m = {**_stats("num_turns", [o.num_turns for o in outs]),
         **_stats("tool_calls", [o.metrics.get("num_tool_calls", 0.0) for o in outs]),
         **_stats("tool_errors", [o.metrics.get("num_tool_errors", 0.0) for o in outs])}
    m["tool_errors/total"] = float(sum(o.metrics.get("num_tool_errors", 0.0) for o in outs))
    m["agent/tokenization_mismatch/mean"] = float(np.mean(
        [o.metrics.get("tokenization_mismatch", 0.0) for o in outs]))
    by_agent: dict[str, list] = {}
    for name, out, *_ in results:
        by_agent.setdefault(name, []).append(out)
    for name, group in by_agent.items():
        m[f"agent/{name}/count"] = float(len(group))
        for key in ("generate_s", "tool_calls_s", "interaction_s", "total_s"):
            vals = [o.metrics[key] for o in group if key in o.metrics]
            if vals:
                m[f"agent/{name}/{key}/mean"] = float(np.mean(vals))
    return m
