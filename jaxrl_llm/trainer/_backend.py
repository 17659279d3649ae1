"""Where the workers live: in this process (`local`) or as one Ray actor per host (`ray`).

Both expose `call(method, *args, **kwargs) -> list` (one result per host, same order) so the
controller's loop is identical. A worker that raises surfaces as `WorkerError` carrying the
remote traceback; the controller then stops cleanly.
"""
from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)

# Environment a Ray worker process needs to see the same devices as the driver would.
_FORWARD_ENV = ("XLA_FLAGS", "JAX_PLATFORMS", "JAX_ENABLE_X64", "CUDA_VISIBLE_DEVICES",
                "TOKENIZERS_PARALLELISM", "JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES")


class WorkerError(RuntimeError):
    """A worker raised; the message holds its (remote) traceback."""


class LocalGroup:
    """The workers of a one-host run, in this process (debugging, profiling, tests)."""

    def __init__(self, cls, *args, **kwargs):
        self.workers = [cls(*args, **kwargs)]

    def call(self, method: str, *args, **kwargs) -> list:
        try:
            return [getattr(w, method)(*args, **kwargs) for w in self.workers]
        except Exception as e:  # noqa: BLE001 - re-raised with context, original chained
            raise WorkerError(f"worker call {method!r} failed: {type(e).__name__}: {e}") from e

    def shutdown(self) -> None:
        for w in self.workers:
            if hasattr(w, "close"):
                w.close()
        self.workers = []


class RayGroup:
    """One Ray actor per host; every call goes to all of them (SPMD multi-controller).

    `num_hosts` actors are placed one per node by a `{"jaxrl_host": 1}` custom resource when the
    cluster declares it (`scripts/ray/cluster.sh` does), otherwise spread over nodes. On a single
    machine a local Ray is started with the machine's CPUs.
    """

    def __init__(self, cls, *args, num_hosts: int = 1, distributed: dict | None = None, **kwargs):
        import ray

        if not ray.is_initialized():
            address = os.environ.get("RAY_ADDRESS")
            env = {k: os.environ[k] for k in _FORWARD_ENV if k in os.environ}
            ray.init(address=address, include_dashboard=False, log_to_driver=True,
                     runtime_env={"env_vars": env} if env else None,
                     num_cpus=None if address else os.cpu_count(), ignore_reinit_error=True)
        self._ray = ray
        resources = ray.cluster_resources()
        opts = {"num_cpus": 0}
        if resources.get("jaxrl_host", 0) >= num_hosts and num_hosts > 1:
            opts["resources"] = {"jaxrl_host": 1}
        elif num_hosts > 1:
            opts["scheduling_strategy"] = "SPREAD"
        actor_cls = ray.remote(**opts)(cls)
        self.workers = []
        for i in range(num_hosts):
            kw = dict(kwargs)
            if distributed is not None:
                kw["distributed"] = {**distributed, "process_id": i}
            self.workers.append(actor_cls.remote(*args, **kw))
        self.call("info")  # surface construction errors now

    def call(self, method: str, *args, **kwargs) -> list:
        refs = [getattr(w, method).remote(*args, **kwargs) for w in self.workers]
        try:
            return self._ray.get(refs)
        except self._ray.exceptions.RayError as e:
            raise WorkerError(f"worker call {method!r} failed on a Ray actor:\n{e}") from None

    def shutdown(self) -> None:
        for w in self.workers:
            try:
                self._ray.get(w.close.remote())
            except Exception:  # noqa: BLE001 - best effort: the actor may already be dead
                pass
            self._ray.kill(w)
        self.workers = []


def make_group(backend: str, cls, *args, **kwargs):
    if backend == "local":
        kwargs.pop("num_hosts", None)
        return LocalGroup(cls, *args, **kwargs)
    if backend == "ray":
        return RayGroup(cls, *args, **kwargs)
    raise ValueError(f"trainer.backend={backend!r}; choose 'ray' or 'local'")
