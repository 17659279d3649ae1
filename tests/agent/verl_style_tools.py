"""Tools (and an interaction) written against verl's API (its `BaseTool` lifecycle and calling conventions), to
prove they run in our tool agent loop with only their import lines changed. Written for these
tests in verl's style (not copied): `AnswerTool` reads the row's ground truth the way verl's
GSM8K tool does (a `ground_truth=` keyword, else `kwargs["create_kwargs"]`), keeps state per
instance, returns verl's (ToolResponse, step reward, metrics) and scores in `calc_reward`;
`LegacyCounterTool` is an older-style tool: `create` returns a bare id, `execute` a str;
`RetryInteraction` is a simulated user in the style of verl's GSM8K interaction that also reads
the row's interaction_kwargs in `generate_response` (verl passes them there)."""
import re
from typing import Any, Optional
from uuid import uuid4

# verl: from verl.tools.base_tool import BaseTool
# verl: from verl.tools.schemas import OpenAIFunctionToolSchema, ToolResponse
# verl: from verl.interactions.base import BaseInteraction
from jaxrl_llm.agent.interactions import BaseInteraction
from jaxrl_llm.agent.tools import BaseTool, OpenAIFunctionToolSchema, ToolResponse

RELEASED: list[str] = []  # instance ids released, in order (tests read and clear it)


class AnswerTool(BaseTool):
    def __init__(self, config: dict, tool_schema: OpenAIFunctionToolSchema):
        super().__init__(config, tool_schema)
        self._instance_dict = {}

    def get_openai_tool_schema(self) -> OpenAIFunctionToolSchema:
        return self.tool_schema

    async def create(self, instance_id: Optional[str] = None, ground_truth: Optional[str] = None,
                     **kwargs) -> tuple[str, ToolResponse]:
        if instance_id is None:
            instance_id = str(uuid4())
        if ground_truth is None:
            ground_truth = kwargs.get("create_kwargs", {}).get("ground_truth", None)
        self._instance_dict[instance_id] = {"response": "", "ground_truth": ground_truth,
                                            "reward": 0.0}
        return instance_id, ToolResponse()

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs
                      ) -> tuple[ToolResponse, float, dict]:
        answer = str(parameters.get("answer", ""))
        self._instance_dict[instance_id]["response"] = answer
        reward = await self.calc_reward(instance_id)
        step = 0.0 if reward > self._instance_dict[instance_id]["reward"] else -0.05
        self._instance_dict[instance_id]["reward"] = reward
        return ToolResponse(text=f"parsed {answer} reward {reward}"), step, {}

    async def calc_reward(self, instance_id: str, **kwargs) -> float:
        state = self._instance_dict[instance_id]
        numbers = re.findall(r"-?\d+", state["response"])
        return float(bool(numbers) and numbers[-1] == str(state["ground_truth"]))

    async def release(self, instance_id: str, **kwargs) -> None:
        del self._instance_dict[instance_id]
        RELEASED.append(instance_id)


class StrictCreateTool(AnswerTool):
    """verl's newer style: `create` takes only `create_kwargs=` (no **kwargs)."""

    async def create(self, instance_id: Optional[str] = None, create_kwargs: Optional[dict] = None):
        return await super().create(instance_id, create_kwargs=create_kwargs or {})


class LegacyCounterTool(BaseTool):
    def __init__(self, config: dict, tool_schema: OpenAIFunctionToolSchema):
        super().__init__(config, tool_schema)
        self.counts = {}

    async def create(self, instance_id=None, start=0):
        instance_id = instance_id or str(uuid4())
        self.counts[instance_id] = int(start)
        return instance_id

    async def execute(self, instance_id, parameters, **kwargs):
        self.counts[instance_id] += int(parameters.get("by", 1))
        return f"count={self.counts[instance_id]}", None, None


class RetryInteraction(BaseInteraction):
    def __init__(self, config: dict):
        super().__init__(config)
        self._instance_dict = {}

    async def start_interaction(self, instance_id: Optional[str] = None,
                                ground_truth: Optional[str] = None, **kwargs) -> str:
        if instance_id is None:
            instance_id = str(uuid4())
        self._instance_dict[instance_id] = {"response": "", "ground_truth": ground_truth,
                                            "reward": 0.0}
        return instance_id

    async def generate_response(self, instance_id: str, messages: list[dict[str, Any]], **kwargs
                                ) -> tuple[bool, str, float, dict]:
        content = next((m.get("content") for m in reversed(messages)
                        if m.get("role") == "assistant"), "")
        self._instance_dict[instance_id]["response"] = content
        reward = await self.calculate_score(instance_id)
        self._instance_dict[instance_id]["reward"] = reward
        if reward == 1.0:
            return True, "Your response is correct!", reward, {}
        return False, f"Incorrect, try again: {kwargs['query']}", reward, {}

    async def calculate_score(self, instance_id: str, **kwargs) -> float:
        state = self._instance_dict[instance_id]
        numbers = re.findall(r"-?\d+", state["response"] or "")
        return float(bool(numbers) and numbers[-1] == str(state["ground_truth"]))

    async def finalize_interaction(self, instance_id: str, **kwargs) -> None:
        del self._instance_dict[instance_id]
