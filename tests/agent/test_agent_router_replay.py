"""Router replay (R3) plumbing of agent trajectories (host numpy only, no model): turn records merged
per trajectory, collated into the driver's row layout, and carried through the async queue's JSON."""
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
    b = _out([7, 8, 9, 10], [11], None)  # a loop that records nothing (e.g. openai_agent)
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
