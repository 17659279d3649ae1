"""Activation sharding constraints by logical name, active only inside `use_rules(...)`.

Models call `constrain(x, ("batch", "length", "embed"))` on activations. Outside a `use_rules`
block it returns `x` unchanged, so the same model code runs unsharded in unit tests. The context
is read when a function is traced. So that jit's trace cache never hands a function traced
under one setting to a call under another, `use_rules` also enters the mesh's abstract mesh and
tags the ops with the rule set's name (an XLA frontend attribute `jaxrl_sharding_rules`); both are
part of jit's cache key.
"""
from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Sequence

import hashlib

import jax
from jax.experimental.xla_metadata import set_xla_metadata
from jax.sharding import Mesh, NamedSharding

from sharding._rules import RULES, Rules, _as_table, get_rules, logical_to_spec

_ACTIVE: contextvars.ContextVar[tuple[Mesh, Rules] | None] = contextvars.ContextVar(
    "jaxrl_sharding_rules", default=None)


@contextlib.contextmanager
def use_rules(mesh: Mesh, rules: Rules | str) -> Iterator[None]:
    """Makes `constrain` shard activations on `mesh` by `rules` (a table or "train"/"rollout")."""
    if isinstance(rules, str):
        rules = get_rules(rules)
    _as_table(rules)  # validate now, not at the first constrain
    token = _ACTIVE.set((mesh, rules))
    try:
        # Both contexts are part of jit's trace-cache key (and, unlike jax.set_mesh, work inside jit).
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh), \
            set_xla_metadata(jaxrl_sharding_rules=_rules_tag(rules)):
            yield
    finally:
        _ACTIVE.reset(token)


def _rules_tag(rules: Rules) -> str:
    for name, table in RULES.items():
        if tuple(rules) == table:
            return name
    return "custom-" + hashlib.sha1(repr(tuple(rules)).encode()).hexdigest()[:12]


def current_mesh() -> Mesh | None:
    """The mesh of the innermost active `use_rules`, or None."""
    active = _ACTIVE.get()
    return None if active is None else active[0]


def current_rules() -> Rules | None:
    """The rules of the innermost active `use_rules`, or None."""
    active = _ACTIVE.get()
    return None if active is None else active[1]


def constrain(x: jax.Array, logical_axes: Sequence[str | None]) -> jax.Array:
    """`with_sharding_constraint` by logical names inside `use_rules`; identity outside it."""
    active = _ACTIVE.get()
    if active is None:
        return x
    if len(logical_axes) != x.ndim:
        raise ValueError(f"constrain: logical axes {tuple(logical_axes)} have {len(logical_axes)} "
                         f"entries but the array has shape {x.shape}")
    mesh, rules = active
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, logical_to_spec(logical_axes, rules, mesh)))
