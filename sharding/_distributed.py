"""Multi-host start-up: one `jax.distributed.initialize` call, configured from the environment.

Sources, first match wins: explicit arguments; SLURM (`srun`); a TPU VM slice (JAX detects it
itself); `JAX_COORDINATOR_ADDRESS` / `JAX_NUM_PROCESSES` / `JAX_PROCESS_ID`; `JAXRL_DISTRIBUTED=auto`
(let `jax.distributed.initialize()` detect the cluster: TPU pods over ssh, where the TPU_*
variables are not exported, as `scripts/tpu/launch.sh` does). With none of them,
or a single process, it does nothing. Call it before anything touches a JAX device.

On CPU (tests: several processes with fake devices on one machine) cross-process collectives
need a CPU collectives implementation; `initialize_distributed` pins gloo there (JAX 0.10's
default, set explicitly so the choice does not depend on the JAX version).
"""
from __future__ import annotations

import dataclasses
import itertools
import os
import re
from collections.abc import Mapping, Sequence

import jax

DEFAULT_COORDINATOR_PORT = 12345
_STATE = {"initialized": False}


@dataclasses.dataclass(frozen=True)
class DistributedSpec:
    """Arguments for `jax.distributed.initialize`; `auto=True` lets JAX detect the cluster."""

    source: str  # "explicit" | "slurm" | "tpu" | "env" | "auto"
    coordinator_address: str | None = None
    num_processes: int | None = None
    process_id: int | None = None
    local_device_ids: tuple[int, ...] | None = None
    auto: bool = False

    def initialize_kwargs(self) -> dict:
        kwargs = {"coordinator_address": self.coordinator_address, "num_processes": self.num_processes,
                  "process_id": self.process_id,
                  "local_device_ids": None if self.local_device_ids is None
                  else list(self.local_device_ids)}
        return {k: v for k, v in kwargs.items() if v is not None}


def expand_hostlist(nodelist: str) -> list[str]:
    """Expands a SLURM node list: "node[01-03,07],gpu5" → node01 node02 node03 node07 gpu5."""
    hosts: list[str] = []
    for item in re.findall(r"(?:[^,\[]+|\[[^\]]*\])+", nodelist):
        parts = re.split(r"(\[[^\]]*\])", item)
        choices = []
        for part in parts:
            if part.startswith("["):
                choices.append(_expand_range(part[1:-1], nodelist))
            elif part:
                choices.append([part])
        hosts.extend("".join(p) for p in itertools.product(*choices))
    return hosts


def _expand_range(body: str, nodelist: str) -> list[str]:
    out = []
    for piece in body.split(","):
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", piece.strip())
        if not m:
            raise ValueError(f"cannot parse SLURM node list {nodelist!r} (range {piece!r})")
        lo, hi = m.group(1), m.group(2) or m.group(1)
        out.extend(str(n).zfill(len(lo)) for n in range(int(lo), int(hi) + 1))
    return out


def _int(env: Mapping[str, str], key: str) -> int:
    try:
        return int(env[key])
    except ValueError as e:
        raise ValueError(f"environment variable {key}={env[key]!r} is not an integer") from e


def _from_slurm(env: Mapping[str, str]) -> DistributedSpec | None:
    count_key = next((k for k in ("SLURM_NTASKS", "SLURM_JOB_NUM_NODES") if k in env), None)
    nodes_key = next((k for k in ("SLURM_JOB_NODELIST", "SLURM_NODELIST") if k in env), None)
    if "SLURM_PROCID" not in env or count_key is None or nodes_key is None:
        return None
    hosts = expand_hostlist(env[nodes_key])
    if not hosts:
        raise ValueError(f"environment variable {nodes_key} is empty")
    port = _int(env, "JAXRL_COORDINATOR_PORT") if "JAXRL_COORDINATOR_PORT" in env \
        else DEFAULT_COORDINATOR_PORT
    return DistributedSpec("slurm", f"{hosts[0]}:{port}", _int(env, count_key),
                           _int(env, "SLURM_PROCID"))


def _from_tpu(env: Mapping[str, str]) -> DistributedSpec | None:
    hostnames = [h for h in env.get("TPU_WORKER_HOSTNAMES", "").split(",") if h.strip()]
    if not ({"TPU_WORKER_HOSTNAMES", "TPU_WORKER_ID", "TPU_ACCELERATOR_TYPE"} & set(env)):
        return None
    if len(hostnames) == 1:
        return DistributedSpec("tpu", num_processes=1)  # a single-host TPU VM
    return DistributedSpec("tpu", auto=True)


def _from_jax_env(env: Mapping[str, str]) -> DistributedSpec | None:
    if "JAX_COORDINATOR_ADDRESS" not in env:
        return None
    missing = [k for k in ("JAX_NUM_PROCESSES", "JAX_PROCESS_ID") if k not in env]
    if missing:
        raise ValueError(f"JAX_COORDINATOR_ADDRESS is set but {missing} are not")
    return DistributedSpec("env", env["JAX_COORDINATOR_ADDRESS"], _int(env, "JAX_NUM_PROCESSES"),
                           _int(env, "JAX_PROCESS_ID"))


def _from_auto(env: Mapping[str, str]) -> DistributedSpec | None:
    value = env.get("JAXRL_DISTRIBUTED", "")
    if value in ("", "0", "off"):
        return None
    if value != "auto":
        raise ValueError(f"JAXRL_DISTRIBUTED={value!r}: use 'auto' (or unset it)")
    return DistributedSpec("auto", auto=True)


def resolve_distributed_env(env: Mapping[str, str], *, coordinator_address: str | None = None,
                            num_processes: int | None = None, process_id: int | None = None,
                            local_device_ids: Sequence[int] | int | None = None
                            ) -> DistributedSpec | None:
    """What `initialize_distributed` would do, without doing it; None means single host.

    Explicit arguments override the environment's values field by field; if no environment source
    is found, `coordinator_address`, `num_processes` and `process_id` must all be given.
    """
    if isinstance(local_device_ids, int):
        local_device_ids = (local_device_ids,)
    explicit = {"coordinator_address": coordinator_address, "num_processes": num_processes,
                "process_id": process_id,
                "local_device_ids": None if local_device_ids is None else tuple(local_device_ids)}
    given = {k: v for k, v in explicit.items() if v is not None}
    required = ("coordinator_address", "num_processes", "process_id")
    if all(k in given for k in required):
        spec = DistributedSpec("explicit", **given)
    else:
        spec = _from_slurm(env) or _from_tpu(env) or _from_jax_env(env) or _from_auto(env)
        if spec is None:
            if given:
                missing = [k for k in required if k not in given]
                raise ValueError(f"initialize_distributed: got {sorted(given)} but no cluster environment "
                                 f"(SLURM, TPU, JAX_COORDINATOR_ADDRESS) to supply {missing}; pass them")
            return None
        spec = dataclasses.replace(spec, **given)
    if spec.num_processes == 1:
        return None
    return spec


def initialize_distributed(*, coordinator_address: str | None = None,
                           num_processes: int | None = None, process_id: int | None = None,
                           local_device_ids: Sequence[int] | int | None = None) -> bool:
    """Calls `jax.distributed.initialize` once if this is a multi-process run.

    Returns True when JAX runs multi-process after the call (now or by an earlier call), False on a
    single host, where nothing is done. Calling it again is a no-op.
    """
    if _STATE["initialized"] or jax.distributed.is_initialized():
        _STATE["initialized"] = True
        return True
    spec = resolve_distributed_env(os.environ, coordinator_address=coordinator_address,
                                   num_processes=num_processes, process_id=process_id,
                                   local_device_ids=local_device_ids)
    if spec is None:
        return False
    if _platform_is_cpu():
        # CPU processes exchange collectives through gloo (must be set before the backend starts)
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(**spec.initialize_kwargs())
    _STATE["initialized"] = True
    return True


def _platform_is_cpu() -> bool:
    """Whether JAX is configured for CPU only (read from config/env: the backend is not started)."""
    platforms = jax.config.jax_platforms or os.environ.get("JAX_PLATFORMS", "")
    return platforms.strip().lower() == "cpu"
