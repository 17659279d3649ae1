"""Agent loops over a scripted server: masks, log-probs, tool turns, errors, interactions,
budgets, and the runner's collation with the streaming reward loop."""
import asyncio
import threading

import numpy as np
import pytest

from jaxrl_llm import agent, rewards
from jaxrl_llm.agent.interactions import AnswerCheckInteraction
from jaxrl_llm.agent.tools import CalculatorTool, function_tool
from jaxrl_llm.config import MultiTurnConfig
from jaxrl_llm.data.tasks import tool_call_text
from rollout import SamplingParams

from agent_helpers import ScriptedServer

CALL = tool_call_text("37*48")


def multi_turn(**kw):
    base = dict(enable=True, default_agent_loop="tool_agent", max_assistant_turns=0,
                max_user_turns=0, max_parallel_calls=1, max_tool_response_length=256,
                tool_response_truncate_side="middle", tool_timeout_s=5.0, tool_memory_limit_gb=4.0,
                tool_workers=1, sandbox="auto", tool_config_path="",
                function_tool_path="", interaction_config_path="", format="hermes",
                tokenization_sanity_check_mode="strict")
    base.update(kw)
    return MultiTurnConfig(**base)


def run_one(tok, replies, *, tools=None, interactions=None, extra_info=None, max_response=256,
            agent_name="tool_agent", max_prompt=16, **mt):
    server = ScriptedServer(tok, {0: replies})
    runner = agent.AgentRunner(server, tok, multi_turn(**mt), max_prompt_length=max_prompt,
                               max_response_length=max_response, pad_token_id=0,
                               tools=tools if tools is not None else {"calculator": CalculatorTool()},
                               interactions=interactions or {})
    sample = agent.AgentSample(raw_prompt=[{"role": "user", "content": "37*48="}],
                               data_source="arithmetic", ground_truth="1776",
                               extra_info=extra_info or {}, agent_name=agent_name, row=0)
    out = runner.run([sample], sampling=SamplingParams(temperature=0.0), seed=0)
    return out, server


def test_tool_turn_tokens_have_mask_zero_and_model_tokens_keep_log_probs(char_tok):
    out, server = run_one(char_tok, [CALL, "1776"])
    eos = char_tok.eos_token_id
    call_ids = char_tok.encode(CALL) + [eos]
    tool_ids = char_tok.encode("<tool>1776<assistant>")
    answer_ids = char_tok.encode("1776") + [eos]
    n = len(call_ids) + len(tool_ids) + len(answer_ids)
    assert out["responses"][0, :n].tolist() == call_ids + tool_ids + answer_ids
    mask = [1] * len(call_ids) + [0] * len(tool_ids) + [1] * len(answer_ids)
    assert out["response_mask"][0, :n].tolist() == mask
    assert out["response_mask"][0, n:].sum() == 0 and out["response_attention_mask"][0].sum() == n
    logp = out["rollout_log_probs"][0, :n]
    np.testing.assert_allclose(logp, np.where(np.asarray(mask) == 1, -0.5, 0.0))
    # turn 2 is asked with the whole conversation so far, in the same session
    second = server.requests[1]
    assert second["prompt_ids"] == out["prompt_ids"][0] + call_ids + tool_ids
    assert second["session_id"] == server.requests[0]["session_id"] in server.released
    assert out["num_turns"].tolist() == [4]  # verl's count: prompt, call, tool round, answer
    assert out["metrics"]["tool_calls/mean"] == 1.0 and out["metrics"]["tool_errors/total"] == 0.0
    assert out["metrics"]["agent/tokenization_mismatch/mean"] == 0.0
    assert out["turn_texts"][0] == [CALL, "1776"]


@pytest.mark.parametrize("reply, expected", [
    ('<tool_call>{"name": "calculator", "arguments": {"expression": </tool_call>',
     "Error: could not parse the tool call"),
    ('<tool_call>{"name":"abacus","arguments":{}}</tool_call>', "Error: unknown tool 'abacus'"),
    ('<tool_call>{"name":"calculator","arguments":{"expression":"1/0"}}</tool_call>', "Error"),
])
def test_bad_tool_calls_become_error_messages_and_the_trajectory_continues(char_tok, reply, expected):
    out, server = run_one(char_tok, [reply, "5"])
    assert len(server.requests) == 2  # the model got a second turn after the error
    sent = char_tok.decode(server.requests[1]["prompt_ids"], skip_special_tokens=False)
    assert f"<tool>{expected}" in sent
    assert out["metrics"]["tool_errors/total"] == 1.0


def test_a_tool_that_raises_or_hangs_is_reported_to_the_model(char_tok):
    @function_tool
    async def stall(x: int) -> str:
        """Never answers."""
        await asyncio.Event().wait()

    @function_tool
    def boom(x: int) -> str:
        """Always fails."""
        raise RuntimeError("kaput")

    tools = {"stall": stall, "boom": boom}
    call = '<tool_call>{"name":"%s","arguments":{"x":1}}</tool_call>'
    out, server = run_one(char_tok, [call % "stall", call % "boom", "7"], tools=tools,
                          tool_timeout_s=0.2)
    sent = char_tok.decode(server.requests[2]["prompt_ids"], skip_special_tokens=False)
    assert "timed out after 0.2 s" in sent and "kaput" in sent
    assert out["metrics"]["tool_errors/total"] == 2.0 and out["num_turns"].tolist() == [6]


def test_parallel_calls_beyond_the_limit_are_not_run(char_tok):
    two = CALL + tool_call_text("2*3")
    out, server = run_one(char_tok, [two, "1776"], max_parallel_calls=1)
    sent = char_tok.decode(server.requests[1]["prompt_ids"], skip_special_tokens=False)
    assert sent.count("<tool>") == 1 and "1776" in sent and "<tool>6" not in sent
    out, server = run_one(char_tok, [two, "1776"], max_parallel_calls=2)
    sent = char_tok.decode(server.requests[1]["prompt_ids"], skip_special_tokens=False)
    # verl counts one round of tool replies as one turn: prompt, call, round, answer
    assert "<tool>1776<tool>6<assistant>" in sent and out["num_turns"].tolist() == [4]


def test_interaction_lets_the_model_retry_until_right(char_tok):
    inter = {"check": AnswerCheckInteraction({})}
    out, server = run_one(char_tok, ["12", "1776"], tools={}, interactions=inter,
                          extra_info={"interaction_kwargs": {"name": "check"}})
    sent = char_tok.decode(server.requests[1]["prompt_ids"], skip_special_tokens=False)
    assert "<user>Your answer is wrong" in sent
    n1 = len(char_tok.encode("12")) + 1
    user_len = len(server.requests[1]["prompt_ids"]) - len(out["prompt_ids"][0]) - n1
    mask = out["response_mask"][0]
    assert mask[:n1].all() and not mask[n1:n1 + user_len].any() and mask[n1 + user_len]
    assert out["num_turns"].tolist() == [4] and len(server.requests) == 2


def test_response_budget_caps_all_turns_together(char_tok):
    budget = len(char_tok.encode(CALL)) + 4  # the call fits, the tool reply + answer do not
    out, server = run_one(char_tok, [CALL, "1776"], max_response=budget)
    assert out["finish_reasons"] == ["length"] and len(server.requests) == 1
    assert out["response_attention_mask"][0].sum() <= budget


def test_assistant_turn_limit(char_tok):
    out, server = run_one(char_tok, [CALL, CALL, CALL], max_assistant_turns=2)
    assert len(server.requests) == 2 and out["num_turns"].tolist() == [4]


def test_single_turn_agent_is_one_request(char_tok):
    out, server = run_one(char_tok, ["42"], agent_name="single_turn_agent")
    assert len(server.requests) == 1 and out["num_turns"].tolist() == [2]  # as verl's
    assert out["response_mask"][0].sum() == 3


def test_unknown_agent_name_is_a_clear_error(char_tok):
    with pytest.raises(ValueError, match="unknown agent loop 'nope'"):
        run_one(char_tok, ["1"], agent_name="nope")


def test_truncate_text_sides():
    assert agent.truncate_text("abcdefgh", 4, "left") == "abcd...(truncated)"
    assert agent.truncate_text("abcdefgh", 4, "right") == "(truncated)...efgh"
    assert agent.truncate_text("abcdefgh", 4, "middle") == "ab\n...(truncated)...\ngh"
    assert agent.truncate_text("abc", 4, "middle") == "abc"


class RecordingManager:
    """A RewardManager stand-in (same `score_batch`) that records the order rows are scored in
    and signals when row 0 is done: RewardLoop's behaviour does not depend on where the scorer
    runs (the real manager is tested in tests/rewards)."""

    def __init__(self):
        self.events, self.row0_scored = [], threading.Event()

    def describe(self):
        return "recording scorer"

    def score_batch(self, data_sources, solution_strs, ground_truths, extra_infos):
        info, solution, truth = extra_infos[0], solution_strs[0], ground_truths[0]
        self.events.append(info["row"])
        if info["row"] == 0:
            self.row0_scored.set()
        if info["row"] == 2:
            return np.zeros(1, np.float32), {}, {"reward/num_errors": 1.0, "reward/num_timeouts": 0.0}
        extra = {"turns": np.asarray([info["num_turns"]], np.float32),
                 "calc": np.asarray([info["tool_rewards"].get("calculator", -1.0)], np.float32)}
        return (np.asarray([float(solution == truth)], np.float32), extra,
                {"reward/num_errors": 0.0, "reward/num_timeouts": 0.0})


def _runner_with_recorder(char_tok, replies, **kw):
    server = ScriptedServer(char_tok, replies)
    manager = RecordingManager()
    runner = agent.AgentRunner(server, char_tok, multi_turn(), max_prompt_length=16,
                               max_response_length=128, pad_token_id=0,
                               reward_loop=rewards.RewardLoop(manager),
                               tools={"calculator": CalculatorTool()}, interactions={}, **kw)
    samples = [agent.AgentSample([{"role": "user", "content": "37*48="}], "arithmetic", "1776",
                                 {"row": r}, "", r) for r in sorted(replies)]
    return server, manager, runner, samples


def test_runner_scores_each_trajectory_as_it_finishes(char_tok):
    """Row 1 cannot start generating until row 0 has been scored: scoring is streamed, not
    done after the batch. Reward extras (dict results) and tool rewards reach the metrics."""
    server, manager, runner, samples = _runner_with_recorder(char_tok, {0: [CALL, "1776"], 1: ["99"]})

    async def wait_for_row0_score():
        ok = await asyncio.get_running_loop().run_in_executor(None, manager.row0_scored.wait, 30)
        assert ok, "row 0 was never scored while row 1 waited"
    server.hooks[1] = wait_for_row0_score
    out = runner.run(samples, sampling=SamplingParams(temperature=0.0), seed=0)
    runner.reward_loop.close()
    assert manager.events == [0, 1]
    assert out["scores"].tolist() == [1.0, 0.0]
    assert out["reward_extra"]["turns"].tolist() == [4.0, 2.0]
    assert out["reward_extra"]["calc"].tolist() == [0.0, -1.0]  # row 1 never created the tool
    assert out["metrics"]["reward_extra/turns/mean"] == 3.0


def test_reward_failures_over_the_batch_trip_the_breaker(char_tok):
    replies = {0: ["1776"], 1: ["1"], 2: ["2"]}
    *_, runner, samples = _runner_with_recorder(char_tok, replies, max_error_fraction=0.5)
    out = runner.run(samples, sampling=SamplingParams(temperature=0.0), seed=0)
    assert out["metrics"]["reward/num_errors"] == 1.0  # 1 of 3 failed: under the limit
    *_, runner, samples = _runner_with_recorder(char_tok, replies, max_error_fraction=0.2)
    with pytest.raises(rewards.RewardFunctionError, match="1 of 3 agent trajectories failed"):
        runner.run(samples, sampling=SamplingParams(temperature=0.0), seed=0)


# A ChatML template with a tools section and tool turns shown as user turns (Qwen2.5's layout).
TOOL_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nTools:\n<tools>{% for t in tools %}\n{{ t | tojson }}"
    "{% endfor %}\n</tools><|im_end|>\n{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user{% endif %}"
    "{{ '\\n' }}<tool_response>\n{{ m.content }}\n</tool_response>"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>\n{% endif %}"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture
def chatml_tools_tok(tmp_path):
    import json
    import os
    import shutil

    from jaxrl_llm.models import load_tokenizer

    src = os.path.join(os.path.dirname(__file__), "..", "fixtures", "models", "tokenizer_chatml")
    for name in ("tokenizer.json", "generation_config.json"):
        shutil.copy(os.path.join(src, name), tmp_path / name)
    with open(os.path.join(src, "tokenizer_config.json")) as f:
        cfg = json.load(f)
    cfg["chat_template"] = TOOL_TEMPLATE
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    return load_tokenizer(str(tmp_path))


def test_bpe_template_renders_tools_and_tool_turns_like_the_whole_conversation(chatml_tools_tok):
    tok = chatml_tools_tok
    call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "37*48"}}\n</tool_call>'
    with pytest.raises(ValueError, match="raise data.max_prompt_length"):
        run_one(tok, [call, "1776"])
    out, server = run_one(tok, [call, "1776"], max_response=512, max_prompt=512)
    prompt = tok.decode(out["prompt_ids"][0], skip_special_tokens=False)
    assert '"name": "calculator"' in prompt and "<tools>" in prompt  # the schema is in the prompt
    sent = tok.decode(server.requests[1]["prompt_ids"], skip_special_tokens=False)
    # the "\n" the template writes after <|im_end|> (never generated) comes with the tool turn
    assert sent.endswith("</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n1776\n"
                         "</tool_response><|im_end|>\n<|im_start|>assistant\n")
    assert out["metrics"]["agent/tokenization_mismatch/mean"] == 0.0
    assert out["response_mask"][0].sum() == len(tok.encode(call)) + 1 + len(tok.encode("1776")) + 1


def test_sanity_check_reports_a_mismatch(char_tok):
    """A model turn whose ids are not what tokenizing its text gives (here: an extra stop token
    in the middle) is flagged in strict mode and passes when the check is disabled."""
    class Odd(ScriptedServer):
        async def agenerate(self, *a, **k):
            out = await super().agenerate(*a, **k)
            out.token_ids = [self.tok.eos_token_id] + out.token_ids
            out.log_probs = [self.logprob] + out.log_probs
            out.policy_versions = [self.version] + out.policy_versions
            return out

    for mode, flagged in (("strict", 1.0), ("disable", 0.0)):
        server = Odd(char_tok, {0: ["42"]})
        runner = agent.AgentRunner(server, char_tok, multi_turn(tokenization_sanity_check_mode=mode),
                                   max_prompt_length=16, max_response_length=64, pad_token_id=0,
                                   tools={}, interactions={})
        sample = agent.AgentSample([{"role": "user", "content": "6*7="}], "arithmetic", "42", {}, "", 0)
        out = runner.run([sample], sampling=SamplingParams(temperature=0.0), seed=0)
        assert out["metrics"]["agent/tokenization_mismatch/mean"] == flagged


def test_qwen3_coder_calls_get_values_typed_by_the_tools_schema(char_tok):
    """The loop hands the tools' schemas to the parser: "1776" reaches the calculator as the
    string its schema asks for, not as the number 1776 (which it would refuse)."""
    call = ("<tool_call>\n<function=calculator>\n<parameter=expression>\n1776\n</parameter>\n"
            "</function>\n</tool_call>")
    out, server = run_one(char_tok, [call, "1776"], format="qwen3_coder")
    sent = char_tok.decode(server.requests[1]["prompt_ids"], skip_special_tokens=False)
    assert "<tool>1776<assistant>" in sent and out["metrics"]["tool_errors/total"] == 0.0
