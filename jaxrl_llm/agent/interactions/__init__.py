"""Interactions (verl's `BaseInteraction`): simulated users that reply to the model between
turns, the built-in `answer_check`, and loading them from verl's interaction config."""
from jaxrl_llm.agent.interactions._answer_check import (
    AnswerCheckInteraction,
    answers_match,
    last_number,
)
from jaxrl_llm.agent.interactions._base import BaseInteraction
from jaxrl_llm.agent.interactions._gsm8k import Gsm8kInteraction
from jaxrl_llm.agent.interactions._registry import (
    BUILTIN_INTERACTIONS,
    VERL_INTERACTION_ALIASES,
    get_interaction_class,
    load_interactions,
)

__all__ = [
    "BUILTIN_INTERACTIONS",
    "AnswerCheckInteraction",
    "BaseInteraction",
    "Gsm8kInteraction",
    "VERL_INTERACTION_ALIASES",
    "answers_match",
    "get_interaction_class",
    "last_number",
    "load_interactions",
]
