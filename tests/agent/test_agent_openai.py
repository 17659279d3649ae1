"""The openai_agent loop: a tool-using agent written against the official `openai` client, run
through the loop over a scripted server, gives the same trajectory (tokens, masks, log-probs,
policy versions, turn count, and the same requests: prompts, PRNG rows, seeds, budgets) as the
in-process tool agent; history rewrites and a missing session header are clear errors."""
import asyncio
import os
import threading

import numpy as np
import pytest

from jaxrl_llm import agent
from jaxrl_llm.agent.tools import CalculatorTool
from jaxrl_llm.data.tasks import tool_call_text
from rollout import SamplingParams

from agent_helpers import ScriptedServer
from test_agent_loop import TOOL_TEMPLATE, chatml_tools_tok, multi_turn  # noqa: F401 (fixture)

pytest.importorskip("openai")
AGENTS = os.path.join(os.path.dirname(__file__), "openai_agents.py")
HERMES = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "37*48"}}\n</tool_call>'


class SubmitServer(ScriptedServer):
    """The scripted server with `RolloutServer.submit` (a concurrent future, from any thread),
    recording each request's seed and sampling too."""

    def __init__(self, tok, replies):
        super().__init__(tok, replies)
        self.version = 3
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()

    async def agenerate(self, request_id, prompt_ids, *, sampling, seed, **kw):
        out = await super().agenerate(request_id, prompt_ids, sampling=sampling, seed=seed, **kw)
        self.requests[-1].update(seed=seed, sampling=sampling)
        out.request_id, out.num_cached_tokens = request_id, 0
        return out

    def submit(self, request_id, prompt_ids, **kw):
        return asyncio.run_coroutine_threadsafe(self.agenerate(request_id, prompt_ids, **kw), self.loop)


def run(tok, replies, agent_name, *, fn="calculator_agent", max_response=256, rows=(0, 1)):
    server = SubmitServer(tok, {r: replies for r in rows})
    runner = agent.AgentRunner(server, tok, multi_turn(openai_agent_path=AGENTS, openai_agent_name=fn),
                               max_prompt_length=512, max_response_length=max_response,
                               pad_token_id=0, tools={"calculator": CalculatorTool()},
                               interactions={})
    samples = [agent.AgentSample(raw_prompt=[{"role": "user", "content": "37*48="}],
                                 data_source="arithmetic", ground_truth="1776", extra_info={},
                                 agent_name=agent_name, row=r) for r in rows]
    try:
        return runner.run(samples, sampling=SamplingParams(temperature=0.7, top_k=5), seed=11), server
    finally:
        runner.close()


@pytest.mark.parametrize("tokenizer, replies, max_response", [
    ("char_tok", [tool_call_text("37*48"), "1776"], 256),
    ("char_tok", [tool_call_text("37*48"), tool_call_text("1776-1"), "1775"], 256),
    # the budget ends it: the third reply is cut / no room for the second tool result
    ("char_tok", [tool_call_text("37*48"), tool_call_text("1776-1"), "1775"], 175),
    ("char_tok", [tool_call_text("37*48"), tool_call_text("1776-1"), "1775"], 170),
    ("chatml_tools_tok", [HERMES, "1776"], 512),
])
def test_openai_client_agent_gives_the_tool_agents_trajectory(request, tokenizer, replies, max_response):
    tok = request.getfixturevalue(tokenizer)
    want, s_want = run(tok, replies, "tool_agent", max_response=max_response)
    got, s_got = run(tok, replies, "openai_agent", max_response=max_response)
    assert want["response_mask"].sum() > 0
    for key in ("responses", "response_mask", "response_attention_mask", "rollout_log_probs",
                "rollout_versions", "num_turns"):
        np.testing.assert_array_equal(got[key], want[key], err_msg=key)
    assert got["prompt_ids"] == want["prompt_ids"]
    for mask in got["response_mask"]:  # tool tokens (mask 0) between the model's turns
        assert (mask[:np.flatnonzero(mask)[-1]] == 0).any()
    key = lambda r: (r["row"], r["prompt_ids"], r["max_new_tokens"], r["seed"], r["sampling"])  # noqa: E731
    assert sorted(map(key, s_got.requests)) == sorted(map(key, s_want.requests))
    assert len(s_got.requests) == len(s_want.requests) >= 2
    sessions = {r["session_id"] for r in s_got.requests}  # a session a trajectory, released
    assert len(sessions) == 2 and sorted(s_got.released) == sorted(sessions)
    assert got["turn_texts"] == want["turn_texts"]
    if max_response < 256:
        assert got["response_mask"][0].sum() < sum(len(tok.encode(r)) + 1 for r in replies)


def test_an_async_agent_function_is_awaited_and_gives_the_same_trajectory(char_tok):
    replies = [tool_call_text("37*48"), "1776"]
    want, _ = run(char_tok, replies, "openai_agent")
    got, s_got = run(char_tok, replies, "openai_agent", fn="async_calculator_agent")
    for key in ("responses", "response_mask", "rollout_log_probs", "num_turns"):
        np.testing.assert_array_equal(got[key], want[key], err_msg=key)
    assert len(s_got.requests) == 4


def test_rewritten_history_a_missing_session_header_and_no_request_are_clear_errors(char_tok):
    with pytest.raises(ValueError, match="request 1 of session .* does not extend the conversation"):
        run(char_tok, ["12", "34"], "openai_agent", fn="forgetful_agent", rows=(0,))
    import openai

    with pytest.raises(openai.BadRequestError, match="must carry the header 'X-Session-Id"):
        run(char_tok, ["12"], "openai_agent", fn="headerless_agent", rows=(0,))
    with pytest.raises(ValueError, match="without a request in session"):
        run(char_tok, ["12"], "openai_agent", fn="idle_agent", rows=(0,))
    with pytest.raises(AttributeError, match="no function 'nope'"):
        run(char_tok, ["12"], "openai_agent", fn="nope", rows=(0,))


def test_a_reply_cut_at_a_stop_string_is_closed_before_the_next_message(chatml_tools_tok):
    """The endpoint cuts the first reply at the agent's stop string (the tokens up to the one
    that completed it are kept), before the model's stop token: the next prompt closes the turn
    with the template's whole end of turn, its stop token included, as non-trained tokens."""
    tok = chatml_tools_tok
    got, server = run(tok, ["1776 Observation: none", "ok"], "openai_agent", fn="stop_string_agent",
                      max_response=512, rows=(0,))
    n = int(got["response_attention_mask"][0].sum())
    text = tok.decode(got["prompt_ids"][0] + [int(t) for t in got["responses"][0][:n]],
                      skip_special_tokens=False)
    assert text.endswith("<|im_start|>assistant\n1776 Observation<|im_end|>\n<|im_start|>user\ngo on"
                         "<|im_end|>\n<|im_start|>assistant\nok<|im_end|>"), text
    second = tok.decode(server.requests[1]["prompt_ids"], skip_special_tokens=False)
    assert second.endswith("1776 Observation<|im_end|>\n<|im_start|>user\ngo on<|im_end|>\n"
                           "<|im_start|>assistant\n"), second
    # trained: the two replies' own tokens (the second's stop token included), not the glue
    assert got["response_mask"][0].sum() == len(tok.encode("1776 Observation")) + len(tok.encode("ok")) + 1
