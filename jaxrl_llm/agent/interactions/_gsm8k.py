"""Built-in `gsm8k` interaction: the simulated user of verl's GSM8K multi-turn example, so that
example's interaction config (`verl.interactions.gsm8k_interaction.Gsm8kInteraction`, an alias
of this class) and rows run unchanged. After each model turn without a tool call it scores the
last assistant message with GSM8K's strict rule (the last "#### N", `rewards.gsm8k_score`):
right -> "Your response is correct!" and the conversation ends; wrong -> "Your response is
incorrect! You need to reflect on your answer and try again." and the model answers again (until
`rollout.multi_turn.max_user_turns`). `calculate_score` is the last message's score.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from jaxrl_llm.agent.interactions._answer_check import _text
from jaxrl_llm.agent.interactions._base import BaseInteraction
from jaxrl_llm.rewards import gsm8k_score

CORRECT = "Your response is correct!"
INCORRECT = "Your response is incorrect! You need to reflect on your answer and try again."


class Gsm8kInteraction(BaseInteraction):
    """Config: only `name`. `start_interaction` needs `ground_truth`."""

    def __init__(self, config: Mapping[str, Any] | None = None):
        super().__init__(config)
        unknown = set(self.config) - {"name"}
        if unknown:
            raise ValueError(f"gsm8k interaction: unknown config keys {sorted(unknown)}; it "
                             f"takes none")
        self._state: dict[str, dict[str, Any]] = {}

    async def start_interaction(self, instance_id: str | None = None, ground_truth: Any = None,
                                **kwargs) -> str:
        if ground_truth is None:
            raise ValueError("gsm8k interaction needs ground_truth: put it in the row's "
                             "extra_info.interaction_kwargs")
        instance_id = await super().start_interaction(instance_id)
        self._state[instance_id] = {"ground_truth": ground_truth, "score": 0.0}
        return instance_id

    async def generate_response(self, instance_id: str, messages: list[dict[str, Any]],
                                **kwargs) -> tuple[bool, str, float, dict[str, Any]]:
        state = self._state[instance_id]
        last = next((m for m in reversed(messages) if m.get("role") == "assistant"), {})
        state["score"] = gsm8k_score(_text(last), state["ground_truth"])
        if state["score"] == 1.0:
            return True, CORRECT, 1.0, {}
        return False, INCORRECT, state["score"], {}

    async def calculate_score(self, instance_id: str, **kwargs) -> float:
        return self._state[instance_id]["score"]

    async def finalize_interaction(self, instance_id: str, **kwargs) -> None:
        self._state.pop(instance_id, None)
