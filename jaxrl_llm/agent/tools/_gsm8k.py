"""Built-in `gsm8k_reward`: the answer-checking tool of verl's GSM8K multi-turn example, so that
example's tool config (`verl.tools.gsm8k_tool.Gsm8kTool`, an alias of this class) and rows run
unchanged. The model submits an answer; the tool says what it parsed and whether it is right,
and `calc_reward` scores the last answer submitted.

Behaviour (as verl's example tool): the ground truth comes from the row's
`tools_kwargs.calc_gsm8k_reward.create_kwargs.ground_truth`; an answer is read as "#### " +
answer and scored with the last number in it (verl's "flexible" GSM8K extraction: the text as
written, so "1,234" does not match "1234") against the ground truth, 1.0 or 0.0; the step
reward is 0.0 when the score went up and -0.05 otherwise (a penalty for submitting without
improving); `calc_reward` scores the last answer.
"""
from __future__ import annotations

import re
import uuid
from typing import Any

from jaxrl_llm.agent.tools._base import BaseTool, ToolResponse, check_config_keys
from jaxrl_llm.agent.tools._schema import OpenAIFunctionToolSchema, make_schema

_NUMBER = re.compile(r"-?[0-9.,]+")
_CLIP_CHARS = 300
NO_IMPROVEMENT_PENALTY = -0.05


def last_gsm8k_number(text: str) -> str | None:
    """The last number-like run ("1,234", "-3.5") of the text's final 300 characters that is
    not just "." (commas kept, as verl's flexible extraction), or None."""
    for candidate in reversed(_NUMBER.findall(text[-_CLIP_CHARS:])):
        if candidate not in ("", "."):
            return candidate
    return None


def gsm8k_flexible_score(answer_text: str, ground_truth: Any) -> float:
    number = last_gsm8k_number(answer_text)
    return float(number is not None and number == str(ground_truth))


class Gsm8kRewardTool(BaseTool):
    """Built-in `gsm8k_reward` (alias `verl.tools.gsm8k_tool.Gsm8kTool`); no config keys."""

    @classmethod
    def default_tool_schema(cls) -> OpenAIFunctionToolSchema:
        return make_schema("calc_gsm8k_reward", "Check an answer to the GSM8K problem: 1.0 if "
                           "it is correct, 0.0 if not or if it cannot be parsed.",
                           {"answer": {"type": "string", "description": "The answer, digits."}},
                           ["answer"])

    def __init__(self, config: dict[str, Any] | None = None, tool_schema=None):
        super().__init__(config, tool_schema)
        check_config_keys("gsm8k_reward", self.config, set())
        self._state: dict[str, dict[str, Any]] = {}

    async def create(self, instance_id: str | None = None, ground_truth: Any = None, **kwargs
                     ) -> tuple[str, ToolResponse | None]:
        instance_id = instance_id or str(uuid.uuid4())
        if ground_truth is None:
            ground_truth = (kwargs.get("create_kwargs") or {}).get("ground_truth")
        if ground_truth is None:
            raise ValueError("gsm8k_reward needs the row's ground truth: put it in "
                             "extra_info.tools_kwargs.<tool name>.create_kwargs.ground_truth")
        self._state[instance_id] = {"ground_truth": ground_truth, "answer": "", "score": 0.0}
        return instance_id, None

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs
                      ) -> tuple[ToolResponse, float, dict]:
        state = self._state[instance_id]
        answer = str(parameters.get("answer", ""))
        state["answer"] = answer if answer.startswith("#### ") else "#### " + answer
        score = gsm8k_flexible_score(state["answer"], state["ground_truth"])
        step = 0.0 if score > state["score"] else NO_IMPROVEMENT_PENALTY
        state["score"] = score
        return ToolResponse(text=f"Parsed answer {answer!r}: reward {score:g}"), step, {}

    async def calc_reward(self, instance_id: str, **kwargs) -> float:
        state = self._state[instance_id]
        return gsm8k_flexible_score(state["answer"], state["ground_truth"])

    async def release(self, instance_id: str, **kwargs) -> None:
        self._state.pop(instance_id, None)
