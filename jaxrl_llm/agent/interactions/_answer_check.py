"""`answer_check`: checks the model's last answer against the ground truth and lets it retry
(like verl's gsm8k interaction). Correct -> "Your answer is correct!", score 1, done. Wrong ->
"Your answer is wrong. Please try again.", score 0, another turn, until `max_attempts`."""
from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from typing import Any

from jaxrl_llm.agent.interactions._base import BaseInteraction
from jaxrl_llm.agent.tools._files import import_object

CORRECT = "Your answer is correct!"
WRONG_RETRY = "Your answer is wrong. Please try again."
WRONG_FINAL = "Your answer is wrong."
_NUMBER = re.compile(r"-?\$?\d[\d,]*(?:\.\d+)?|-?\.\d+")
_CONFIG_KEYS = {"name", "max_attempts", "answer_extractor"}


def last_number(text: str) -> str | None:
    """The last number in `text` ("1,234.5", "-3", "$7"), as written; None if there is none."""
    matches = _NUMBER.findall(text or "")
    return matches[-1] if matches else None


def _as_float(value: Any) -> float | None:
    try:
        return float(str(value).replace(",", "").replace("$", "").strip().rstrip("."))
    except ValueError:
        return None


def answers_match(answer: Any, ground_truth: Any) -> bool:
    """Numerically equal (to 1e-6 relative) if both are numbers, else equal as stripped text."""
    a, b = _as_float(answer), _as_float(ground_truth)
    if a is not None and b is not None:
        return math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-9)
    return answer is not None and str(answer).strip() == str(ground_truth).strip()


def _text(message: Mapping[str, Any]) -> str:
    content = message.get("content") or ""
    if isinstance(content, list):  # content parts: [{"type": "text", "text": ...}, ...]
        return "".join(p.get("text", "") for p in content if isinstance(p, Mapping))
    return str(content)


def _resolve_extractor(extractor: Any) -> Callable[[str], Any]:
    if extractor is None:
        return last_number
    if isinstance(extractor, str):
        extractor = import_object(extractor, "answer_check answer_extractor")
    if not callable(extractor):
        raise TypeError(f"answer_check answer_extractor must be callable or a 'module.fn' "
                        f"path, got {extractor!r}")
    return extractor


class AnswerCheckInteraction(BaseInteraction):
    """Config: `max_attempts` (3), `answer_extractor` (a callable or "module.fn" path,
    text -> answer; default: the last number). `start_interaction` needs `ground_truth`."""

    def __init__(self, config: Mapping[str, Any] | None = None):
        super().__init__(config)
        unknown = set(self.config) - _CONFIG_KEYS
        if unknown:
            raise ValueError(f"answer_check: unknown config keys {sorted(unknown)}; "
                             f"allowed: {sorted(_CONFIG_KEYS)}")
        self.max_attempts = int(self.config.get("max_attempts", 3))
        if self.max_attempts < 1:
            raise ValueError(f"answer_check: max_attempts must be >= 1, got {self.max_attempts}")
        self.extract = _resolve_extractor(self.config.get("answer_extractor"))
        self._instances: dict[str, dict[str, Any]] = {}

    async def start_interaction(self, instance_id: str | None = None, **kwargs) -> str:
        if "ground_truth" not in kwargs:
            raise ValueError("answer_check needs ground_truth: put it in the row's "
                             "extra_info.interaction_kwargs")
        instance_id = await super().start_interaction(instance_id)
        self._instances[instance_id] = {"ground_truth": kwargs["ground_truth"],
                                        "attempts": 0, "score": 0.0}
        return instance_id

    def _state(self, instance_id: str) -> dict[str, Any]:
        if instance_id not in self._instances:
            raise KeyError(f"answer_check: no interaction {instance_id!r}; call "
                           f"start_interaction first (or it was finalized)")
        return self._instances[instance_id]

    async def generate_response(self, instance_id: str, messages: list[dict[str, Any]],
                                **kwargs) -> tuple[bool, str, float, dict[str, Any]]:
        state = self._state(instance_id)
        replies = [m for m in messages if m.get("role") == "assistant"]
        answer = self.extract(_text(replies[-1])) if replies else None
        state["attempts"] += 1
        correct = answer is not None and answers_match(answer, state["ground_truth"])
        state["score"] = 1.0 if correct else 0.0
        metadata = {"attempts": state["attempts"], "answer": answer}
        if correct:
            return True, CORRECT, 1.0, metadata
        if state["attempts"] >= self.max_attempts:
            return True, WRONG_FINAL, 0.0, metadata
        return False, WRONG_RETRY, 0.0, metadata

    async def calculate_score(self, instance_id: str, **kwargs) -> float:
        return self._state(instance_id)["score"]

    async def finalize_interaction(self, instance_id: str, **kwargs) -> None:
        self._instances.pop(instance_id, None)
