"""The interaction interface (verl's `BaseInteraction`): a simulated user or environment that
answers the model between turns. One object serves many trajectories, keyed by instance id.

    instance_id = await interaction.start_interaction(**interaction_kwargs)
    done, reply, score, metadata = await interaction.generate_response(instance_id, messages)
    ...                                      # the loop appends `reply` as a user turn
    score = await interaction.calculate_score(instance_id)
    await interaction.finalize_interaction(instance_id)
"""
from __future__ import annotations

import uuid
from collections.abc import Mapping
from typing import Any


class BaseInteraction:
    """Subclass and override `generate_response` (and the others if the interaction keeps
    per-trajectory state)."""

    def __init__(self, config: Mapping[str, Any] | None = None):
        self.config = dict(config or {})
        self.name: str = self.config.get("name", "interaction_agent")

    async def start_interaction(self, instance_id: str | None = None, **kwargs) -> str:
        """Starts one trajectory's interaction; returns its id (a new uuid if None)."""
        return instance_id or str(uuid.uuid4())

    async def generate_response(self, instance_id: str, messages: list[dict[str, Any]],
                                **kwargs) -> tuple[bool, str, float, dict[str, Any]]:
        """(should_terminate, reply text, turn score, metadata) after the model's turn."""
        raise NotImplementedError(f"{type(self).__name__} must implement generate_response()")

    async def calculate_score(self, instance_id: str, **kwargs) -> float:
        return 0.0

    async def finalize_interaction(self, instance_id: str, **kwargs) -> None:
        return None
