"""Interactions by name and from verl's interaction config (YAML or JSON):

    interaction:
      - name: answer_check                 # the key the data's interaction_kwargs.name uses
        class_name: answer_check           # a built-in name, or "package.module.Class"
        config: {max_attempts: 2}
"""
from __future__ import annotations

import os

from jaxrl_llm.agent.interactions._answer_check import AnswerCheckInteraction
from jaxrl_llm.agent.interactions._base import BaseInteraction
from jaxrl_llm.agent.interactions._gsm8k import Gsm8kInteraction
from jaxrl_llm.agent.tools._files import config_entries, read_config_file, resolve_class

BUILTIN_INTERACTIONS: dict[str, type[BaseInteraction]] = {
    "answer_check": AnswerCheckInteraction, "gsm8k": Gsm8kInteraction}
# verl's example interaction classes -> our built-ins that behave alike (see tools' aliases)
VERL_INTERACTION_ALIASES: dict[str, str] = {
    "verl.interactions.gsm8k_interaction.Gsm8kInteraction": "gsm8k"}
_ENTRY_KEYS = {"name", "class_name", "config"}


def get_interaction_class(name: str) -> type[BaseInteraction]:
    """A built-in interaction class by name (or by the verl class path it stands in for), or
    a subclass by "module.Class" path."""
    return resolve_class(VERL_INTERACTION_ALIASES.get(name, name), BUILTIN_INTERACTIONS,
                         BaseInteraction, "interaction",
                         "jaxrl_llm.agent.interactions.BaseInteraction")


def _default_name(class_name: str) -> str:
    """verl's rule: "pkg.Gsm8kInteraction" -> "gsm8k"; a built-in keeps its own name."""
    short = class_name.rpartition(".")[2]
    return short.removesuffix("Interaction").lower() or short.lower()


def load_interactions(interaction_config_path: str | os.PathLike
                      ) -> dict[str, BaseInteraction]:
    """{name: interaction} from an interaction config file (format above), in file order."""
    path = os.fspath(interaction_config_path)
    interactions: dict[str, BaseInteraction] = {}
    for i, entry in enumerate(config_entries(read_config_file(path), "interaction", path)):
        unknown = set(entry) - _ENTRY_KEYS
        if unknown or "class_name" not in entry:
            raise ValueError(f"{path}: interaction[{i}] needs 'class_name' and may have "
                             f"'name' and 'config'; got keys {sorted(entry)}")
        name = entry.get("name") or _default_name(entry["class_name"])
        if name in interactions:
            raise ValueError(f"{path}: two interactions are named {name!r}; names must be "
                             f"unique (rows pick one by interaction_kwargs.name)")
        config = {**(entry.get("config") or {}), "name": name}
        interactions[name] = get_interaction_class(entry["class_name"])(config)
    return interactions
