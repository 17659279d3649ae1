"""The openai_agent loop in the trainer: a user's agent written against the official `openai`
client (tests/agent/openai_agents.py) talks to the endpoint served over the trainer's own
request-level server; its trajectories equal the in-process tool agent's on the real engine for
the same seed, and a training step runs on them."""
import dataclasses
import os

import numpy as np
import pytest

from jaxrl_llm.trainer import RLTrainer
from jaxrl_llm.workers import HostWorker
from test_trainer_agent import tools_run
from trainer_helpers import ROOT

pytest.importorskip("openai")
AGENTS = os.path.join(ROOT, "tests", "agent", "openai_agents.py")


@pytest.fixture(scope="module")
def started(tmp_path_factory):
    trainer = RLTrainer(tools_run(tmp_path_factory.mktemp("openai_agent"), **{
        "rollout.multi_turn.openai_agent_path": AGENTS,
        "rollout.multi_turn.openai_agent_name": "calculator_agent",
        "rollout.multi_turn.max_assistant_turns": 4}))  # the agent's own MAX_TURNS
    trainer.call0(HostWorker.start_rl, trainer.config.trainer.total_training_steps)
    yield trainer
    trainer.close()


def test_openai_agent_trajectories_equal_the_tool_agents_on_the_engine(started):
    from rollout import SamplingParams

    examples = next(started.loader)
    n = started.config.rollout.n
    outs = {}
    for name in ("tool_agent", "openai_agent"):
        samples = [dict(raw_prompt=e.raw_prompt, data_source=e.data_source,
                        ground_truth=e.ground_truth, extra_info=e.extra_info, agent_name=name,
                        row=i * n + j) for i, e in enumerate(examples) for j in range(n)]
        outs[name] = started.call0(HostWorker.agent_generate, samples, seed=5,
                                   sampling=SamplingParams.from_config(started.config.rollout))
    want, got = outs["tool_agent"], outs["openai_agent"]
    np.testing.assert_array_equal(got.responses, want.responses)
    np.testing.assert_array_equal(got.response_mask, want.response_mask)
    np.testing.assert_array_equal(got.num_turns, want.num_turns)
    np.testing.assert_array_equal(got.rollout_versions, want.rollout_versions)
    assert got.prompt_ids == want.prompt_ids
    np.testing.assert_allclose(got.rollout_log_probs, want.rollout_log_probs, atol=1e-5)
    np.testing.assert_array_equal(got.scores, want.scores)


def test_a_training_step_on_openai_agent_trajectories(started):
    # the task's rows name tool_agent; here every row names the openai_agent loop
    examples = started.train_set.examples
    examples[:] = [dataclasses.replace(e, agent_name="openai_agent") for e in examples]
    m = started.train_step()
    for key in ("num_turns/mean", "agent/openai_agent/count", "agent/openai_agent/total_s/mean",
                "actor/pg_loss"):
        assert key in m, [k for k in sorted(m) if "agent" in k or "turn" in k]
    assert np.isfinite(m["actor/pg_loss"])
    assert m["agent/openai_agent/count"] >= 1 and "agent/tool_agent/count" not in m
    # the endpoint records the engine's log-probs: the trainer's own (fp32, on-policy)
    assert m["rollout/logprob_abs_diff/mean"] < 1e-4
