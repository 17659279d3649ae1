"""Name -> function lookup with errors that list the valid names.

Configs name estimators, losses and modes by string (verl's names); this module turns a
misspelt name into an error a user can act on instead of a bare ``KeyError``.
"""
from __future__ import annotations

from typing import Callable, Mapping, TypeVar

T = TypeVar("T")


class UnknownNameError(KeyError, ValueError):
    """Raised for an unknown registry name; catchable as ``KeyError`` or ``ValueError``."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


def lookup(registry: Mapping[str, T], name: str, what: str) -> T:
    """Returns ``registry[name]`` or raises ``UnknownNameError`` naming the valid choices."""
    if name not in registry:
        raise UnknownNameError(
            f"Unknown {what} {name!r}. Valid names: {sorted(registry)}."
        )
    return registry[name]


def check_choice(name: str, choices: tuple[str, ...] | frozenset[str], what: str) -> None:
    """Raises ``UnknownNameError`` when ``name`` is not one of ``choices``."""
    if name not in choices:
        raise UnknownNameError(f"Unknown {what} {name!r}. Valid names: {sorted(choices)}.")


def register(registry: dict[str, Callable], name: str) -> Callable[[Callable], Callable]:
    """Decorator adding a function to ``registry`` under ``name`` (no silent overwrite)."""

    def deco(fn: Callable) -> Callable:
        if name in registry and registry[name] is not fn:
            raise ValueError(f"{name!r} is already registered to {registry[name]}.")
        registry[name] = fn
        return fn

    return deco
