"""Router replay (R3) plumbing of agent trajectories (host numpy only, no model): turn records merged
per trajectory (tool_agent's turns and openai_agent's recorded requests), collated into the
driver's row layout, and carried through the async queue's JSON."""
import dataclasses
import json

import numpy as np

from jaxrl_llm.agent._loop import AgentLoopOutput, merge_turn_experts
from jaxrl_llm.agent._replay import PromptGroup, TrajectoryGroup
from jaxrl_llm.agent._runner import collate_experts


def _rec(values, n=None):
    """A record [len, L=2, k=1] holding `values` per position (-1 past n)."""
    e = np.repeat(np.asarray(values, np.int8)[:, None, None], 2, axis=1)
    if n is not None:
        e[n:] = -1
    return e


def test_merge_keeps_earlier_turns_experts_and_takes_the_later_turns_for_new_tokens():
    first = _rec([1, 1, 1, 1, 1], n=4)  # 3 prompt + 2 completion tokens, the last not fed
    second = _rec([2] * 9, n=8)  # re-prefilled whole (no parked KV): turn 2's view of everything
    merged = merge_turn_experts(first, second)
    np.testing.assert_array_equal(merged[:, 0, 0], [1, 1, 1, 1, 2, 2, 2, 2, -1])
    assert merge_turn_experts(None, second) is not second  # a copy
    assert merge_turn_experts(first, None) is first and merge_turn_experts(None, None) is None


def _out(prompt, response, experts):
    return AgentLoopOutput(prompt_ids=prompt, response_ids=response, response_mask=[1] * len(response),
                           response_logprobs=[0.0] * len(response), num_turns=2, metrics={},
                           extra_fields={}, routed_experts=experts)


def test_collate_lays_rows_out_like_the_driver_and_json_round_trips():
    a = _out([7, 8], [9, 10, 11], _rec([3, 4, 5, 6, 7], n=4))
    b = _out([7, 8, 9, 10], [11], None)  # a row with no record (a server without record_experts)
    ex = collate_experts([a, b], t=5)
    assert ex.shape == (2, 4 + 5, 2, 1) and ex.dtype == np.int8
    np.testing.assert_array_equal(ex[0, :, 0, 0], [-1, -1, 3, 4, 5, 6, -1, -1, -1])
    assert (ex[1] == -1).all()
    assert collate_experts([b], t=5) is None
    group = TrajectoryGroup(PromptGroup(0, {}, 0, 0, 1), [("tool_agent", a, 1.0, None, 2.0)], 3, 0.0)
    back = TrajectoryGroup.from_json(json.loads(json.dumps(group.to_json())))
    got = back.results[0][1].routed_experts
    assert got.dtype == np.int8 and got.shape == a.routed_experts.shape
    np.testing.assert_array_equal(got, a.routed_experts)
    plain = TrajectoryGroup(group.prompt, [("tool_agent", b, 1.0, None, 2.0)], 3, 0.0)
    assert TrajectoryGroup.from_json(json.loads(json.dumps(plain.to_json()))).results[0][1].routed_experts is None


def test_openai_agent_merges_its_recorded_requests_as_the_tool_loop_merges_turns(char_tok):
    """openai_agent: the endpoint's recorded requests (each with the server's experts) become one
    trajectory whose experts merge like `ToolAgentLoop`'s turns; unrecorded requests give None."""
    from types import SimpleNamespace

    from jaxrl_llm.agent._openai_agent import OpenAIAgentLoop
    from rollout._openai import RecordedTurn

    loop = OpenAIAgentLoop(SimpleNamespace(tokenizer=char_tok))
    first = RecordedTurn("a", [7, 8, 9], [10, 11], [0.0] * 2, [0] * 2, "stop", 0, _rec([1] * 5, n=4))
    # the user's tokens 20, 21 after the reply; this request re-prefilled everything (no parked KV)
    second = RecordedTurn("b", [7, 8, 9, 10, 11, 20, 21], [12], [0.0], [0], "stop", 0, _rec([2] * 8, n=7))
    traj = loop._trajectory("s", [first, second])
    assert traj.prompt_ids + traj.ids == second.prompt_ids + second.response_ids
    np.testing.assert_array_equal(traj.experts[:, 0, 0], [1, 1, 1, 1, 2, 2, 2, -1])
    plain = [dataclasses.replace(t, routed_experts=None) for t in (first, second)]
    assert loop._trajectory("s", plain).experts is None
