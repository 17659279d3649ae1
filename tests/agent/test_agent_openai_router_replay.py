"""Router replay (R3) of openai_agent trajectories: a user's agent (the official `openai` client)
talks to the endpoint over a recording `RolloutServer` on the tiny Qwen3-MoE fixture (fp32); the
trajectory assembled from its three requests carries, for every token any request fed (prompt,
replies, the user messages between them), the experts of the model's own top-k on a full forward
of the whole trajectory, and -1 where nothing was fed."""
import os

import numpy as np
import pytest

import rollout
from jaxrl_llm import agent, models
from test_agent_loop import multi_turn
from moe_helpers import own_top_k

pytest.importorskip("openai")
HERE = os.path.dirname(__file__)
AGENTS = os.path.join(HERE, "openai_agents.py")
FIXTURE = os.path.abspath(os.path.join(HERE, "..", "fixtures", "models", "qwen3_moe"))


@pytest.fixture(scope="module")
def model():
    return models.from_pretrained(FIXTURE)


@pytest.fixture(scope="module")
def engine(model):  # the shapes of tests/rollout/test_server_router_replay.py (compiled once)
    return rollout.Engine.from_model(model, max_concurrent_decodes=2, max_prefill_length=16,
                                     max_target_length=48, record_experts=True)


@pytest.mark.parametrize("reuse", [True, False])  # parked KV reused, or each request re-prefilled
def test_openai_agent_rows_carry_the_engines_experts_for_every_fed_token(char_tok, model, engine,
                                                                         reuse):
    rows = (0, 1)
    with rollout.RolloutServer(engine, steps_per_sync=4, reuse_prefix=reuse) as server:
        runner = agent.AgentRunner(
            server, char_tok, multi_turn(openai_agent_path=AGENTS, openai_agent_name="follow_up_agent"),
            max_prompt_length=16, max_response_length=24, pad_token_id=0, tools={}, interactions={})
        samples = [agent.AgentSample(raw_prompt=[{"role": "user", "content": "hi"}],
                                     data_source="arithmetic", ground_truth="1", extra_info={},
                                     agent_name="openai_agent", row=r) for r in rows]
        try:
            got = runner.run(samples, sampling=rollout.SamplingParams(1.0), seed=3)
        finally:
            runner.close()
    ex = got["routed_experts"]
    width = max(len(p) for p in got["prompt_ids"])
    assert ex is not None and ex.shape == (len(rows), width + 24, 2, 2)
    for i, prompt in enumerate(got["prompt_ids"]):
        n = int(got["response_attention_mask"][i].sum())
        mask = got["response_mask"][i, :n]
        assert got["num_turns"][i] == 1 + 3 + 2  # three requests, two user messages between them
        assert (mask[:np.flatnonzero(mask)[-1]] == 0).any()  # user tokens a later request prefilled
        seq = list(prompt) + list(got["responses"][i, :n])
        row = ex[i, width - len(prompt):width + n]
        np.testing.assert_array_equal(np.sort(row[:-1], -1), own_top_k(model, seq)[:-1])
        assert (row[-1] == -1).all() and (ex[i, :width - len(prompt)] == -1).all()
        assert (ex[i, width + n:] == -1).all()
