"""Where the workers live: in this process (`local`) or as one Ray actor per host (`ray`).

Both expose `call(method, *args, **kwargs) -> list` (one result per host, same order) so the
controller's loop is identical, and `call_async` / `wait` for a call that runs while the
controller goes on (the one-step-off-policy rollout; the worker then serves two calls at once).
`method` is a function of the worker class, e.g. `group.call(HostWorker.generate, prompts, ...)`,
never a name: a misspelt method fails where it is written (an AttributeError, and a type
checker's error, which also checks the arguments against the method's signature), not deep in
a Ray call. A worker that raises surfaces as `WorkerError` carrying the remote traceback; the
controller then stops cleanly.
"""
from __future__ import annotations

import atexit
import logging
import os
import tempfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Concatenate, ParamSpec, TypeVar

log = logging.getLogger(__name__)

# Environment a Ray worker process needs to see the same devices as the driver would.
_FORWARD_ENV = ("XLA_FLAGS", "JAX_PLATFORMS", "JAX_ENABLE_X64", "CUDA_VISIBLE_DEVICES",
                "TOKENIZERS_PARALLELISM", "JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES",
                "JAX_COMPILATION_CACHE_DIR", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS")


# Runs first in every Ray worker process: a node without a TPU does not start libtpu there
_WORKER_SETUP_HOOK = "jaxrl_llm._cli.skip_absent_tpu"

# Custom Ray resource that marks a node as one training host (one HostWorker actor each).
HOST_RESOURCE = "jaxrl_host"


class WorkerError(RuntimeError):
    """A worker raised; the message holds its (remote) traceback."""


P = ParamSpec("P")
R = TypeVar("R")
Method = Callable[Concatenate[Any, P], R]  # a worker class's function: `HostWorker.generate`


def method_name(cls: type, method: Callable) -> str:
    """The name under which the workers (instances of `cls`) run `method`, a public function
    of `cls` or of a base class of it; anything else (a name string, another class's function)
    is a TypeError saying what to pass."""
    if isinstance(method, str):
        raise TypeError(f"pass the worker method itself, e.g. {cls.__name__}.{method}, not its name "
                        f"{method!r}: a misspelt method then fails where it is written")
    name = getattr(method, "__name__", "")
    if name.startswith("_") or not any(vars(k).get(name) is method for k in cls.__mro__):
        raise TypeError(f"{getattr(method, '__qualname__', method)!r} is not a public method of the "
                        f"worker class {cls.__name__}")
    return name


class LocalGroup:
    """The workers of a one-host run, in this process (debugging, profiling, tests)."""

    def __init__(self, cls, *args, max_concurrency: int = 1, **kwargs):
        self.cls = cls
        self.workers = [cls(*args, **kwargs)]
        # a background thread serves call_async (JAX dispatch is thread-safe; the two calls must
        # use disjoint state, e.g. rollout on its own devices while the actor trains)
        self._pool = ThreadPoolExecutor(max_concurrency - 1) if max_concurrency > 1 else None

    def call(self, method: Method[P, R], *args: P.args, **kwargs: P.kwargs) -> list[R]:
        name = method_name(self.cls, method)
        try:
            return [getattr(w, name)(*args, **kwargs) for w in self.workers]
        except Exception as e:  # noqa: BLE001 - re-raised with context, original chained
            raise WorkerError(f"worker call {name!r} failed: {type(e).__name__}: {e}") from e

    def call_async(self, method: Method[P, R], *args: P.args, **kwargs: P.kwargs):
        """Starts `call` in the background; `wait(handle)` returns its result (or raises)."""
        if self._pool is None:
            raise RuntimeError("call_async needs a group made with max_concurrency >= 2")
        method_name(self.cls, method)  # a wrong method fails here, not in the background
        return self._pool.submit(self.call, method, *args, **kwargs)

    def wait(self, handle) -> list:
        return handle.result()

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        for w in self.workers:
            if hasattr(w, "close"):
                w.close()
        self.workers = []


class RayGroup:
    """One Ray actor per host; every call goes to all of them (SPMD multi-controller).

    Placement (`host_placements`): with `num_hosts > 1` actor i is pinned to the i-th node that
    declares the `jaxrl_host` custom resource (`scripts/ray/cluster.sh` gives each node one),
    or to the i-th alive node when no node declares it; a one-node cluster (tests, one machine
    with fake devices) holds all actors. Multi-host actors call `jax.distributed.initialize`
    first thing; unless `distributed` names a coordinator, one is picked on actor 0's node (a
    free port there). On a single machine a local Ray is started with the machine's CPUs.
    """

    def __init__(self, cls, *args, num_hosts: int = 1, distributed: dict | None = None,
                 max_concurrency: int = 1, **kwargs):
        import ray

        if not ray.is_initialized():
            address = os.environ.get("RAY_ADDRESS")
            if not address:
                _no_stale_tpu_logs()
            ray.init(address=address, include_dashboard=False, log_to_driver=True,
                     runtime_env=worker_runtime_env(),
                     num_cpus=None if address else os.cpu_count(), ignore_reinit_error=True)
        self._ray = ray
        placements = host_placements(ray, num_hosts)
        if num_hosts > 1 and not (distributed or {}).get("coordinator_address"):
            distributed = {**(distributed or {}), "num_processes": num_hosts,
                           "coordinator_address": free_address_on(ray, placements[0])}
        if distributed is not None:
            distributed = {**distributed, "num_processes": num_hosts}
        # max_concurrency > 1 makes a threaded actor: call_async and call run side by side
        self.cls = cls
        actor_cls = ray.remote(num_cpus=0, max_concurrency=max_concurrency)(cls)
        self.workers = []
        for i in range(num_hosts):
            kw = dict(kwargs)
            if distributed is not None:
                kw["distributed"] = {**distributed, "process_id": i}
            # this process's devices/env now, also when Ray was started earlier
            opts = {**placements[i], "runtime_env": worker_runtime_env()}
            self.workers.append(actor_cls.options(**opts).remote(*args, **kw))
        self.call(cls.info)  # surface construction errors now

    def call(self, method: Method[P, R], *args: P.args, **kwargs: P.kwargs) -> list[R]:
        return self.wait(self.call_async(method, *args, **kwargs))

    def call_async(self, method: Method[P, R], *args: P.args, **kwargs: P.kwargs):
        """Starts the call on every actor; `wait(handle)` returns the results (or raises)."""
        name = method_name(self.cls, method)
        return name, [getattr(w, name).remote(*args, **kwargs) for w in self.workers]

    def wait(self, handle) -> list:
        method, refs = handle
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


def forward_env() -> dict[str, str]:
    """The variables of `_FORWARD_ENV` that are set in this process, less a JAX_PLATFORMS that
    `_cli.skip_absent_tpu` chose for this machine (another node may hold a TPU; the workers'
    setup hook decides there)."""
    from jaxrl_llm._cli import PLATFORMS_AUTO_ENV, PLATFORMS_ENV

    env = {k: os.environ[k] for k in _FORWARD_ENV if k in os.environ}
    if PLATFORMS_ENV in env and env[PLATFORMS_ENV] == os.environ.get(PLATFORMS_AUTO_ENV):
        del env[PLATFORMS_ENV]
    return env


def worker_runtime_env() -> dict:
    """Ray's runtime_env of the workers: the forwarded variables and the setup hook that keeps
    a node without a TPU from starting libtpu."""
    env = forward_env()
    return {"worker_process_setup_hook": _WORKER_SETUP_HOOK, **({"env_vars": env} if env else {})}


def _no_stale_tpu_logs() -> None:
    """A local Ray streams the files of `$TPU_LOG_DIR` (default /tmp/tpu_logs, libtpu's log
    folder, left by any earlier run on the machine) into this process's output. On a machine
    without a TPU nothing there is ours: unless the user set TPU_LOG_DIR, point it at an empty
    folder (removed at exit) for the Ray that is about to start."""
    from jaxrl_llm._cli import tpu_present

    if "TPU_LOG_DIR" in os.environ or tpu_present():
        return
    empty = tempfile.mkdtemp(prefix="jaxrl_llm-no-tpu-logs-")
    os.environ["TPU_LOG_DIR"] = empty
    atexit.register(_remove_if_empty, empty)


def _remove_if_empty(path: str) -> None:
    try:
        os.rmdir(path)
    except OSError:
        pass


def host_placements(ray, num_hosts: int) -> list[dict]:
    """Ray actor options, one dict per host, that put each actor on its own node."""
    if num_hosts < 1:
        raise ValueError(f"num_hosts must be >= 1, got {num_hosts}")
    if num_hosts == 1:
        return [{}]
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    alive = sorted((n for n in ray.nodes() if n.get("Alive")), key=lambda n: n["NodeManagerAddress"])
    tagged = [n for n in alive if n.get("Resources", {}).get(HOST_RESOURCE, 0) >= 1]
    nodes = tagged or alive
    if len(nodes) == 1:
        log.warning("Ray cluster has one node: all %d host actors share it (fine for CPU tests, "
                    "not for accelerators)", num_hosts)
        nodes = nodes * num_hosts
    if len(nodes) < num_hosts:
        what = f"nodes with the {HOST_RESOURCE!r} resource" if tagged else "alive nodes"
        raise ValueError(f"num_hosts={num_hosts} but the Ray cluster has {len(nodes)} {what}; start a "
                         f"Ray worker on every host (scripts/ray/cluster.sh) or lower num_hosts")
    out = []
    for n in nodes[:num_hosts]:
        opts = {"scheduling_strategy": NodeAffinitySchedulingStrategy(node_id=n["NodeID"], soft=False)}
        if tagged and len(tagged) >= num_hosts:
            opts["resources"] = {HOST_RESOURCE: 1}
        out.append(opts)
    return out


def free_address_on(ray, placement: dict) -> str:
    """`ip:port` of a free TCP port on the node `placement` pins to (the JAX coordinator)."""
    opts = {k: v for k, v in placement.items() if k == "scheduling_strategy"}
    return ray.get(ray.remote(num_cpus=0)(_free_address).options(**opts).remote())


def _free_address() -> str:
    import socket

    import ray

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        port = s.getsockname()[1]
    return f"{ray.util.get_node_ip_address()}:{port}"


def make_group(backend: str, cls, *args, **kwargs):
    if backend == "local":
        kwargs.pop("num_hosts", None)
        return LocalGroup(cls, *args, **kwargs)
    if backend == "ray":
        return RayGroup(cls, *args, **kwargs)
    raise ValueError(f"trainer.backend={backend!r}; choose 'ray' or 'local'")
