"""Host-local data → global arrays: each host feeds its own rows of the batch."""
from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec, Sharding

from sharding._rules import Rules, logical_to_spec


def global_batch_sharding(mesh: Mesh, rules: Rules | str, ndim: int) -> NamedSharding:
    """Dim 0 split by the rules' `batch` axes, the other `ndim - 1` dims replicated."""
    if ndim < 1:
        raise ValueError(f"global_batch_sharding: ndim must be >= 1, got {ndim}")
    return NamedSharding(mesh, logical_to_spec(("batch",) + (None,) * (ndim - 1), rules))


def host_local_to_global(mesh: Mesh, spec_or_sharding: PartitionSpec | Sharding,
                         local_array: Any) -> Any:
    """Global `jax.Array`(s) from this host's rows (`jax.make_array_from_process_local_data`).

    `local_array` may be a pytree (e.g. a dict batch); every leaf gets the same sharding, so a spec
    that names only the leading dim suits leaves of any rank.
    """
    sharding = (spec_or_sharding if isinstance(spec_or_sharding, Sharding)
                else NamedSharding(mesh, spec_or_sharding))
    return jax.tree.map(lambda x: jax.make_array_from_process_local_data(sharding, x), local_array)


def process_batch_slice(global_batch: int, *, process_index: int | None = None,
                        process_count: int | None = None) -> slice:
    """The rows of a `global_batch`-row batch that this host loads (contiguous, in process order)."""
    index = jax.process_index() if process_index is None else process_index
    count = jax.process_count() if process_count is None else process_count
    if global_batch % count:
        raise ValueError(f"global batch size {global_batch} is not divisible by the number of "
                         f"processes ({count})")
    per_host = global_batch // count
    return slice(index * per_host, (index + 1) * per_host)


def to_host(x: Any) -> np.ndarray:
    """A (global) array as numpy on this host, also when it spans several processes.

    Arrays that are replicated or live on this host's devices (always, on one host) are read
    directly; a sharded multi-host array is all-gathered first (a collective: every process calls
    this at the same point of the same program, so it lines up).
    """
    if not isinstance(x, jax.Array) or x.is_fully_addressable or x.is_fully_replicated:
        return np.asarray(x)
    from jax.experimental import multihost_utils
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
