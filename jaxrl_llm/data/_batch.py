"""`Batch`: the RL batch that passes between the controller and the workers, with verl's field
names (docs/concepts.md, 'The batch').

Rows are sequences (`B` = prompts × samples). A field is declared once below with its dims and
dtype kind; setting it checks that it is host numpy (a `Batch` crosses Ray, global `jax.Array`s
never do) of that kind, with dims that agree with the fields already set: `B` rows, `p` prompt
tokens, `t` response tokens, `s` = `p + t` whole-sequence tokens. A misspelt field is an
`AttributeError` (and a type checker's error); reading a field that was never set is a
`MissingFieldError` naming it and what the batch holds. Name-driven code (a worker picking its
inputs, the metrics) reads fields through the read-only `Mapping` interface.

`RolloutResult`: what a worker's rollout call returns to the controller (rows, masks, log-probs,
per-token policy versions, worker-side scores, group bookkeeping, timing), a frozen dataclass of
host numpy and plain Python (it crosses Ray).

A `Batch` is also a JAX pytree of its set fields (e.g. `jax.tree.map` over all of them).
Building rollout batches, placing rewards and advantages is `jaxrl_llm.trainer`'s job.
"""
from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, overload

import jax
import numpy as np

_KINDS = {"int": (np.integer, np.bool_), "float": (np.floating,)}


class MissingFieldError(KeyError, AttributeError):
    """A `Batch` field was read before any stage set it."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


@dataclasses.dataclass(frozen=True)
class _Field:
    dims: tuple[str, ...]  # "B" rows, "p" prompt, "t" response, "s" = p + t
    kind: str  # "int" or "float"
    doc: str
    name: str = ""

    def __set_name__(self, owner, name: str) -> None:
        object.__setattr__(self, "name", name)

    @overload
    def __get__(self, obj: None, owner: Any = None) -> _Field: ...
    @overload
    def __get__(self, obj: Batch, owner: Any = None) -> np.ndarray: ...

    def __get__(self, obj, owner=None):
        if obj is None:
            return self
        return obj[self.name]

    def __set__(self, obj: Batch, value: np.ndarray) -> None:
        obj._set(self.name, value)

    def __delete__(self, obj: Batch) -> None:
        obj._data.pop(self.name, None)


@jax.tree_util.register_pytree_node_class
class Batch(Mapping):
    """The RL batch: verl's fields as host numpy arrays, each checked when set.

    `Batch(prompts=..., responses=..., ...)`; `batch.old_log_probs = x`; `batch.update(out)`
    for a worker's result dict; `batch["values"]` / `"values" in batch` by name."""

    prompts = _Field(("B", "p"), "int", "prompt tokens, left-padded with the pad id")
    responses = _Field(("B", "t"), "int", "generated tokens, right-padded")
    response_mask = _Field(("B", "t"), "int", "1 on model tokens of the response (holes at tool tokens)")
    input_ids = _Field(("B", "s"), "int", "concat(prompts, responses); SFT: the whole conversation")
    attention_mask = _Field(("B", "s"), "int", "1 on real tokens: one run per row")
    position_ids = _Field(("B", "s"), "int", "cumsum(attention_mask) - 1, clipped at 0")
    group_ids = _Field(("B",), "int", "prompt index of each row (GRPO groups)")
    rollout_log_probs = _Field(("B", "t"), "float", "the engine's log-prob of each sampled token")
    token_level_scores = _Field(("B", "t"), "float", "the sequence score on its last model token")
    reward_baselines = _Field(("B",), "float", "ReMax: the greedy response's sequence reward")
    old_log_probs = _Field(("B", "t"), "float", "actor log-probs before the update")
    ref_log_prob = _Field(("B", "t"), "float", "reference-model log-probs")
    values = _Field(("B", "t"), "float", "critic values")
    rollout_is_weights = _Field(("B", "t"), "float", "truncated importance weights (rollout correction)")
    token_level_rewards = _Field(("B", "t"), "float", "scores minus the in-reward KL penalty")
    advantages = _Field(("B", "t"), "float", "estimator output, 0 where masked")
    returns = _Field(("B", "t"), "float", "value targets / the estimator's returns")
    loss_mask = _Field(("B", "s"), "int", "SFT: 1 on the tokens the loss trains (assistant turns)")
    routed_experts = _Field(("B", "s", "layers", "k"), "int",
                            "router replay: the engine's experts per token and layer, -1 where none")

    FIELDS: tuple[str, ...] = ()  # every declared field, in declaration order (set below)
    __slots__ = ("_data",)  # no other attributes: a misspelt field cannot be set silently

    def __init__(self, **fields: np.ndarray):
        self._data: dict[str, np.ndarray] = {}
        self.update(fields)

    # -- setting --------------------------------------------------------------------------------
    def update(self, fields: Mapping[str, np.ndarray]) -> Batch:
        """Sets each named field (e.g. a worker's `{"values": ...}`), checked; returns self."""
        for name, value in fields.items():
            if name not in self.FIELDS:
                raise AttributeError(f"Batch has no field {name!r}{_did_you_mean(name, self.FIELDS)}; "
                                     f"its fields are {', '.join(self.FIELDS)}")
            self._set(name, value)
        return self

    def _set(self, name: str, value) -> None:
        spec: _Field = type(self).__dict__[name]
        if isinstance(value, jax.Array):
            raise TypeError(f"Batch.{name} is a jax.Array; a Batch holds host numpy only (it crosses "
                            "Ray): pass np.asarray(jax.device_get(x))")
        if not isinstance(value, np.ndarray):
            raise TypeError(f"Batch.{name} must be a numpy array, got {type(value).__name__}")
        if not issubclass(value.dtype.type, _KINDS[spec.kind]):
            raise TypeError(f"Batch.{name} must hold {spec.kind}s ({spec.doc}), got dtype {value.dtype}")
        want = "[" + ", ".join(spec.dims) + "]"
        if value.ndim != len(spec.dims):
            raise ValueError(f"Batch.{name} must have shape {want} ({spec.doc}), got shape {value.shape}")
        bound = self._sizes(exclude=name)
        for dim, got in zip(spec.dims, value.shape):
            if dim in bound and bound[dim][0] != got:
                size, field = bound[dim]
                raise ValueError(f"Batch.{name} has shape {value.shape} but its {dim!r} axis must be "
                                 f"{size} ({field!r} has {size}); shape {want}")
        dims = dict(zip(spec.dims, value.shape))
        p = dims.get("p", bound.get("p", (None,))[0])
        t = dims.get("t", bound.get("t", (None,))[0])
        s = dims.get("s", bound.get("s", (None,))[0])
        if None not in (p, t, s) and p + t != s:
            raise ValueError(f"Batch.{name} has shape {value.shape}: the sequence fields are {s} tokens "
                             f"wide but prompts + responses are {p} + {t}")
        self._data[name] = value

    def _sizes(self, exclude: str = "") -> dict[str, tuple[int, str]]:
        """dim -> (size, the first field that fixes it), over the fields set (but `exclude`)."""
        out: dict[str, tuple[int, str]] = {}
        for name, value in self._data.items():
            if name != exclude:
                for dim, n in zip(type(self).__dict__[name].dims, np.shape(value)):
                    out.setdefault(dim, (n, name))
        return out

    def sizes(self) -> dict[str, int]:
        """The batch's dims: `B`, and `p` / `t` / `s` where a field fixes them."""
        return {dim: n for dim, (n, _) in self._sizes().items()}

    # -- reading --------------------------------------------------------------------------------
    def __getitem__(self, name: str) -> np.ndarray:
        try:
            return self._data[name]
        except KeyError:
            pass
        if name in self.FIELDS:
            have = ", ".join(self._data) or "nothing"
            raise MissingFieldError(f"Batch.{name} was never set ({type(self).__dict__[name].doc}); "
                                    f"the batch holds {have}")
        raise KeyError(f"Batch has no field {name!r}{_did_you_mean(name, self.FIELDS)}")

    def __iter__(self) -> Iterator[str]:
        return iter(self._data)

    def __len__(self) -> int:
        """The number of fields set (a Mapping's length); `rows` is the number of rows."""
        return len(self._data)

    @property
    def rows(self) -> int:
        return next(iter(self._data.values())).shape[0] if self._data else 0

    def arrays(self, names: Iterable[str]) -> dict[str, np.ndarray]:
        """The named fields as a plain dict (a jitted step's input); a missing one is an error."""
        return {k: self[k] for k in names}

    # -- rows -----------------------------------------------------------------------------------
    def select(self, rows) -> Batch:
        """The rows `rows` (a bool mask or indices) of every field."""
        idx = np.flatnonzero(rows) if np.asarray(rows).dtype == bool else np.asarray(rows)
        return Batch(**{k: v[idx] for k, v in self._data.items()})

    @staticmethod
    def concat(batches: list[Batch]) -> Batch:
        """Rows of several batches with the same fields, in order."""
        names = list(batches[0])
        for b in batches[1:]:
            if list(b) != names:
                raise ValueError(f"Batch.concat: fields differ ({names} vs {list(b)})")
        return Batch(**{k: np.concatenate([b[k] for b in batches]) for k in names})

    def __repr__(self) -> str:
        dims = ", ".join(f"{d}={n}" for d, n in self.sizes().items())
        return f"Batch({dims}; {', '.join(self._data)})"

    # -- pytree (leaves may be anything inside a JAX transform: no checks) --------------------
    def tree_flatten(self):
        return tuple(self._data.values()), tuple(self._data)

    @classmethod
    def tree_unflatten(cls, names, leaves):
        out = cls.__new__(cls)
        out._data = dict(zip(names, leaves))
        return out


Batch.FIELDS = tuple(k for k, v in vars(Batch).items() if isinstance(v, _Field))


@dataclasses.dataclass(frozen=True, eq=False)
class RolloutResult:
    """One rollout as a worker returns it: `b` rows (prompt i's `n` samples are rows
    i*n .. i*n+n-1, or the rows' own order for agent and asynchronous rollouts), `t` response
    tokens. Only what the call produced is set; the rest keeps its empty default."""

    responses: np.ndarray  # int32[b, t] generated tokens (tool/user tokens too for agents), right-padded
    response_mask: np.ndarray  # int32[b, t] 1 on model tokens (holes at tool/user tokens)
    rollout_log_probs: np.ndarray  # float32[b, t] the engine's log-prob of each sampled token
    finish_reasons: tuple[str, ...]  # per row: "stop" | "length" | ...
    response_attention_mask: np.ndarray | None = None  # int32[b, t] agents: the whole response (one run)
    rollout_versions: np.ndarray | None = None  # int32[b, t] policy version of each model token, -1 elsewhere
    prompt_ids: tuple[tuple[int, ...], ...] | None = None  # agents: each row's own prompt (rendered)
    prompt_index: np.ndarray | None = None  # int32[b] batch driver: the prompt each row answers
    response_lengths: np.ndarray | None = None  # int32[b] batch driver: generated tokens per row
    # actor.router_replay, batch driver: int8/int16[b, P + t, layers, k] the experts each layer chose
    # for every token the engine fed, columns = the prompt left-padded to P then the response; -1: none
    routed_experts: np.ndarray | None = None
    # scored on the worker (agent loops: each trajectory as it finished); None: score on the controller
    scores: np.ndarray | None = None  # float32[b]
    reward_extra: dict = dataclasses.field(default_factory=dict)  # {key: float32[b]} reward extras
    metrics: dict = dataclasses.field(default_factory=dict)  # {name: float} agent / reward metrics
    num_turns: np.ndarray | None = None  # int32[b]
    turn_texts: tuple = ()  # per row: the assistant turns' texts
    messages: tuple = ()  # per row: the loop's conversation [{role, content}] or None
    # group bookkeeping (asynchronous rollouts: groups in prompt order)
    samples: tuple[dict, ...] = ()  # per group: the data row (agent sample fields)
    group_index: np.ndarray | None = None  # int32[g] the prompt's position in the data order
    group_min_version: np.ndarray | None = None  # int32[g] oldest policy version of a group's tokens
    group_max_version: np.ndarray | None = None  # int32[g] newest
    policy_version: int = -1  # the server's policy version when the rollout was taken
    producer: dict = dataclasses.field(default_factory=dict)  # the rollouter's counters at that time
    # timing
    time_s: float = 0.0  # the call's duration on the worker
    wait_s: float = 0.0  # time spent waiting for finished groups (asynchronous rollouts)

    @property
    def rows(self) -> int:
        return int(self.responses.shape[0])

    def replace(self, **fields) -> RolloutResult:
        return dataclasses.replace(self, **fields)


def _did_you_mean(name: str, choices) -> str:
    close = difflib.get_close_matches(name, choices, n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""
