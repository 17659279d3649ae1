"""verl compatibility: rows as verl's GSM8K multi-turn preprocessing writes them, tool configs in
verl's YAML format, tool classes written against verl's API (tests/agent/verl_style_tools.py,
only the import lines changed), verl's BaseTool calling conventions and its num_turns count."""
import asyncio
import json

import pytest

from jaxrl_llm import agent
from jaxrl_llm.agent.tools import (
    BaseTool,
    ToolResponse,
    create_tool_instance,
    load_tools,
    run_tool_call,
)
from jaxrl_llm.agent.tools._base import create_arguments

import verl_style_tools
from agent_helpers import ScriptedServer
from test_agent_loop import multi_turn
from rollout import SamplingParams

# examples/sglang_multiturn/config/tool_config/gsm8k_tool_config.yaml, with the class path ours
VERL_TOOL_CONFIG = """\
tools:
  - class_name: "verl_style_tools.{cls}"
    config:
      type: native
    tool_schema:
      type: "function"
      function:
        name: "calc_gsm8k_reward"
        description: "A tool for calculating the reward of gsm8k."
        parameters:
          type: "object"
          properties:
            answer:
              type: "string"
              description: "The model's answer to the GSM8K math problem, must be a digits"
          required: ["answer"]
"""


def verl_gsm8k_row(solution="72", question="Natalia sold 48 clips ... How many?"):
    """extra_info as examples/data_preprocess/gsm8k_multiturn_w_tool.py writes it."""
    return {"split": "train", "index": 0, "answer": f"... #### {solution}", "question": question,
            "need_tools_kwargs": True,
            "tools_kwargs": {"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": solution}}},
            "interaction_kwargs": {"query": question, "ground_truth": solution}}


def call(answer):
    return ('<tool_call>{"name": "calc_gsm8k_reward", "arguments": {"answer": "%s"}}</tool_call>'
            % answer)


def run_row(tok, replies, tools, extra_info, interactions=None):
    """One trajectory through the tool agent loop: (AgentLoopOutput, server)."""
    server = ScriptedServer(tok, {0: replies})
    ctx = agent.AgentContext(server=server, tokenizer=tok, multi_turn=multi_turn(),
                             max_prompt_length=64, max_response_length=512,
                             sampling=SamplingParams(temperature=0.0), seed=0, tools=tools,
                             interactions=interactions or {})
    sample = agent.AgentSample(raw_prompt=[{"role": "user", "content": "q"}], data_source="gsm8k",
                               ground_truth="72", extra_info=extra_info, agent_name="tool_agent",
                               row=0)
    return asyncio.run(agent.ToolAgentLoop(ctx).run(sample)), server


def load_verl_config(tmp_path, cls, isolated=False):
    path = tmp_path / "gsm8k_tool_config.yaml"
    path.write_text(VERL_TOOL_CONFIG.format(cls=cls))
    return load_tools(path, isolated={"timeout_s": 30.0, "memory_limit_gb": 1.5} if isolated
                      else None)


@pytest.mark.parametrize("cls, isolated", [("AnswerTool", False), ("StrictCreateTool", False),
                                           ("StrictCreateTool", True)])
def test_verl_gsm8k_row_and_tool_config_run_unchanged_without_interactions(char_tok, tmp_path, cls,
                                                                          isolated):
    """The row's unnamed interaction_kwargs are ignored (no interaction configured); the tool
    reads its ground truth from create_kwargs=; one instance serves the whole trajectory (the
    step reward penalises a repeated answer) and is scored by calc_reward, then released. In a
    process of its own (isolated) the class's own create signature decides what it is passed."""
    tools = load_verl_config(tmp_path, cls, isolated)
    tool = tools["calc_gsm8k_reward"]
    assert isinstance(tool, getattr(verl_style_tools, cls)) != isolated
    verl_style_tools.RELEASED.clear()
    try:
        out, server = run_row(char_tok, [call(71), call(72), "#### 72"], tools, verl_gsm8k_row())
    finally:
        if isolated:
            tool.close()
    sent = char_tok.decode(server.requests[2]["prompt_ids"], skip_special_tokens=False)
    assert "<tool>parsed 71 reward 0.0" in sent and "<tool>parsed 72 reward 1.0" in sent
    assert out.extra_fields["tool_rewards"] == {"calc_gsm8k_reward": 1.0}
    assert len(verl_style_tools.RELEASED) == (0 if isolated else 1)
    assert out.metrics["num_tool_errors"] == 0.0
    assert out.num_turns == 6  # prompt + 3 assistant turns + 2 tool rounds


def verl_gsm8k_parquet_rows(solutions):
    """Whole rows as verl's gsm8k_multiturn_w_tool.py / gsm8k_tool_agent_loop.py write them."""
    rows = []
    for i, solution in enumerate(solutions):
        question = f"Q{i}: how many clips? Let's think step by step and output the final answer after `####`."
        extra = verl_gsm8k_row(solution, question)
        extra["index"] = i
        rows.append({"data_source": "openai/gsm8k", "agent_name": "tool_agent", "prompt": [
            {"role": "system", "content": "You are a math expert. Use the `calc_gsm8k_reward` tool."},
            {"role": "user", "content": question}], "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": solution}, "extra_info": extra})
    return rows


def test_verl_gsm8k_parquet_rows_load_and_run_unchanged(char_tok, tmp_path):
    """The parquet file (nested struct columns, as HF datasets writes verl's rows) goes through
    our RL dataset and each row through the tool agent loop with its own ground truth."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from jaxrl_llm.data import RLDataset
    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(verl_gsm8k_parquet_rows(["72", "10"])), path)
    dataset = RLDataset(str(path), char_tok, max_prompt_length=512, shuffle=False)
    tools = load_verl_config(tmp_path, "AnswerTool")
    for example, answer in zip(dataset, ["72", "10"]):
        assert example.agent_name == "tool_agent" and example.ground_truth == answer
        out, _ = run_row(char_tok, [call(answer), f"#### {answer}"], tools, example.extra_info)
        assert out.extra_fields["tool_rewards"] == {"calc_gsm8k_reward": 1.0}


def test_an_mcp_tool_config_is_refused_naming_the_entry(tmp_path):
    path = tmp_path / "mcp_tool_config.yaml"
    path.write_text(VERL_TOOL_CONFIG.format(cls="AnswerTool").replace("type: native", "type: mcp"))
    with pytest.raises(ValueError, match=r"tools\[0\]: config.type 'mcp' is not supported"):
        load_tools(path)


def test_a_row_naming_an_interaction_that_is_not_configured_is_an_error(char_tok, tmp_path):
    row = verl_gsm8k_row()
    row["interaction_kwargs"]["name"] = "gsm8k"
    with pytest.raises(ValueError, match=r"interaction 'gsm8k'.*no interactions are configured"):
        run_row(char_tok, ["#### 72"], load_verl_config(tmp_path, "AnswerTool"), row)


def test_verl_interaction_config_and_rows_with_interaction_run_unchanged(char_tok, tmp_path):
    """examples/sglang_multiturn/config/interaction_config/gsm8k_interaction_config.yaml's format
    and gsm8k_multiturn_w_interaction.py's rows: the interaction gets the row's
    interaction_kwargs at start and in every generate_response (the query in its reply)."""
    from jaxrl_llm.agent.interactions import load_interactions
    path = tmp_path / "gsm8k_interaction_config.yaml"
    path.write_text('interaction:\n  - name: "gsm8k"\n'
                    '    class_name: "verl_style_tools.RetryInteraction"\n    config: {}\n')
    row = verl_gsm8k_row()
    row["interaction_kwargs"]["name"] = "gsm8k"
    out, server = run_row(char_tok, ["#### 70", "#### 72"], {}, row,
                          interactions=load_interactions(path))
    sent = char_tok.decode(server.requests[1]["prompt_ids"], skip_special_tokens=False)
    assert "<user>Incorrect, try again: Natalia sold 48 clips" in sent
    assert out.extra_fields["interaction_score"] == 1.0
    assert out.num_turns == 4  # prompt + 2 assistant turns + 1 user reply


def test_with_interactions_configured_a_row_must_name_one(char_tok, tmp_path):
    from jaxrl_llm.agent.interactions import AnswerCheckInteraction
    with pytest.raises(ValueError, match=r"interaction None.*defines \['check'\]"):
        run_row(char_tok, ["#### 72"], {}, verl_gsm8k_row(),
                interactions={"check": AnswerCheckInteraction({})})


def test_legacy_tool_bare_id_unpacked_create_and_str_response_in_the_loop(char_tok, tmp_path):
    path = tmp_path / "tools.json"
    path.write_text(json.dumps({"tools": [{"class_name": "verl_style_tools.LegacyCounterTool",
                                           "config": {"type": "native"}, "tool_schema": {
        "type": "function", "function": {"name": "count", "description": "adds", "parameters": {
            "type": "object", "properties": {"by": {"type": "integer"}}, "required": []}}}}]}))
    tools = load_tools(path)
    step = '<tool_call>{"name": "count", "arguments": {"by": 2}}</tool_call>'
    out, server = run_row(char_tok, [step, step, "ok"], tools,
                          {"tools_kwargs": {"count": {"create_kwargs": {"start": 10}}}})
    sent = char_tok.decode(server.requests[2]["prompt_ids"], skip_special_tokens=False)
    assert "<tool>count=12<assistant>" in sent and "<tool>count=14<assistant>" in sent
    assert out.metrics["num_tool_errors"] == 0.0


# ---------------------------------------------------------------- verl's example configs verbatim

# examples/sglang_multiturn/config/tool_config/gsm8k_tool_config.yaml, as verl ships it
VERL_GSM8K_TOOL_CONFIG = VERL_TOOL_CONFIG.replace("verl_style_tools.{cls}",
                                                  "verl.tools.gsm8k_tool.Gsm8kTool")
# examples/sglang_multiturn/config/interaction_config/gsm8k_interaction_config.yaml
VERL_GSM8K_INTERACTION_CONFIG = """\
interaction:
  - name: "gsm8k"
    class_name: "verl.interactions.gsm8k_interaction.Gsm8kInteraction"
    config: {}
"""


def test_verl_gsm8k_example_tool_config_loads_unchanged_and_scores(char_tok, tmp_path):
    """verl's class path stands for our built-in gsm8k_reward: right answer -> reward 1 and a
    step reward of 0; the same answer again -> the -0.05 penalty; calc_reward scores the last."""
    from jaxrl_llm.agent.tools import Gsm8kRewardTool
    path = tmp_path / "gsm8k_tool_config.yaml"
    path.write_text(VERL_GSM8K_TOOL_CONFIG)
    tools = load_tools(path)
    assert isinstance(tools["calc_gsm8k_reward"], Gsm8kRewardTool)
    out, server = run_row(char_tok, [call(71), call(72), call(72), "#### 72"], tools,
                          verl_gsm8k_row())
    sent = char_tok.decode(server.requests[3]["prompt_ids"], skip_special_tokens=False)
    assert sent.count("<tool>Parsed answer '72': reward 1") == 2
    assert "<tool>Parsed answer '71': reward 0" in sent
    assert out.extra_fields["tool_rewards"] == {"calc_gsm8k_reward": 1.0}

    async def steps():
        tool = tools["calc_gsm8k_reward"]
        iid = await create_tool_instance(tool, {"ground_truth": "1234"})
        got = [(await tool.execute(iid, {"answer": a}))[1] for a in ("1,234", "1234", "1234")]
        return got, await tool.calc_reward(iid)
    assert asyncio.run(steps()) == ([-0.05, 0.0, -0.05], 1.0)  # "1,234" is not "1234" (verl)


def test_gsm8k_reward_tool_without_ground_truth_tells_the_model(char_tok, tmp_path):
    path = tmp_path / "gsm8k_tool_config.yaml"
    path.write_text(VERL_GSM8K_TOOL_CONFIG)
    out, server = run_row(char_tok, [call(72), "ok"], load_tools(path), {})
    sent = char_tok.decode(server.requests[1]["prompt_ids"], skip_special_tokens=False)
    assert "could not start: ValueError: gsm8k_reward needs the row's ground truth" in sent


def test_verl_gsm8k_example_interaction_config_loads_unchanged(char_tok, tmp_path):
    """verl's Gsm8kInteraction path stands for our built-in gsm8k interaction: strict "#### N"
    scoring of the last answer, a retry message until right."""
    from jaxrl_llm.agent.interactions import Gsm8kInteraction, load_interactions
    from jaxrl_llm.agent.interactions._gsm8k import CORRECT, INCORRECT
    path = tmp_path / "gsm8k_interaction_config.yaml"
    path.write_text(VERL_GSM8K_INTERACTION_CONFIG)
    interactions = load_interactions(path)
    assert isinstance(interactions["gsm8k"], Gsm8kInteraction)
    row = verl_gsm8k_row()
    row["interaction_kwargs"]["name"] = "gsm8k"
    out, server = run_row(char_tok, ["72", "#### 71", "#### 72"], {}, row, interactions=interactions)
    sent = char_tok.decode(server.requests[2]["prompt_ids"], skip_special_tokens=False)
    assert sent.count(f"<user>{INCORRECT}") == 2 and CORRECT not in sent  # "72" lacks "####"
    assert out.extra_fields["interaction_score"] == 1.0 and len(server.requests) == 3


# ---------------------------------------------------------------- the calling conventions

async def _c_var(self, instance_id=None, ground_truth=None, **kwargs): ...
async def _c_named(self, instance_id=None, ground_truth=None): ...
async def _c_only_dict(self, instance_id=None, create_kwargs=None): ...
async def _c_both(self, instance_id=None, ground_truth=None, create_kwargs=None): ...


@pytest.mark.parametrize("create, expected", [
    (_c_var, {"ground_truth": "7", "create_kwargs": {"ground_truth": "7"}}),
    (_c_named, {"ground_truth": "7"}),
    (_c_only_dict, {"create_kwargs": {"ground_truth": "7"}}),
    (_c_both, {"ground_truth": "7", "create_kwargs": {"ground_truth": "7"}}),
    (BaseTool.create, {"ground_truth": "7", "create_kwargs": {"ground_truth": "7"}}),
])
def test_create_arguments_serve_both_verl_conventions(create, expected):
    assert create_arguments(create, {"ground_truth": "7"}) == expected


def test_create_arguments_leave_a_literal_create_kwargs_key_alone():
    assert create_arguments(_c_var, {"create_kwargs": 1}) == {"create_kwargs": 1}


_SCHEMA = {"type": "function", "function": {"name": "t", "description": "",
                                            "parameters": {"type": "object", "properties": {}}}}


class _Returns(BaseTool):
    def __init__(self, created=None, executed=None):
        super().__init__(tool_schema=_SCHEMA)
        self.created, self.executed = created, executed

    async def create(self, instance_id=None, **kwargs):
        return self.created

    async def execute(self, instance_id, parameters, **kwargs):
        return self.executed


@pytest.mark.parametrize("created, instance_id", [("abc", "abc"), (("abc", ToolResponse("hi")), "abc"),
                                                  ((7, None), 7)])
def test_create_may_return_a_bare_id_or_an_id_response_pair(created, instance_id):
    assert asyncio.run(create_tool_instance(_Returns(created=created), {})) == instance_id


@pytest.mark.parametrize("created", [None, ("a", "b", "c"), {"id": 1}])
def test_create_returning_no_id_is_an_error_naming_the_tool(created):
    with pytest.raises(TypeError, match="tool 't': create returned"):
        asyncio.run(create_tool_instance(_Returns(created=created), {}))


class _PydanticLikeResponse:  # the attributes verl's pydantic ToolResponse has
    def __init__(self, text=None, image=None, video=None):
        self.text, self.image, self.video = text, image, video


@pytest.mark.parametrize("executed, expected", [
    ((ToolResponse(text="a"), 0.5, {"k": 1}), (ToolResponse("a"), 0.5, {"k": 1})),
    (("plain", None, None), (ToolResponse("plain"), 0.0, {})),
    ((_PydanticLikeResponse("b"), 1, {}), (ToolResponse("b"), 1.0, {})),
    ((ToolResponse(), 0.0, {}), (ToolResponse(""), 0.0, {})),
    ((ToolResponse(text=None), 0.0, {}), (ToolResponse(""), 0.0, {})),
])
def test_execute_return_forms_as_verl_accepts_them(executed, expected):
    assert asyncio.run(run_tool_call(_Returns(executed=executed), "i", {})) == expected


@pytest.mark.parametrize("executed, message", [
    ((ToolResponse(text="x", image=["img"]), 0.0, {}), "returned images or videos"),
    ((_PydanticLikeResponse("x", video=["v"]), 0.0, {}), "returned images or videos"),
    (({"text": "x"}, 0.0, {}), "returned a dict response"),
    ((ToolResponse(text=3), 0.0, {}), "returned text of type int"),
])
def test_execute_returns_the_loop_cannot_show_are_tool_errors(executed, message):
    response, reward, metrics = asyncio.run(run_tool_call(_Returns(executed=executed), "i", {}))
    assert message in response.text and metrics == {"error": "bad_return"} and reward == 0.0
