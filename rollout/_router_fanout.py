"""Fan-out behind `ReplicaRouter` (a mixin of the router): weight syncs and suspend / resume /
sleep / wake go to every live replica at once and return when all are done.

Syncs go through each replica's `submit_update`, the blocking controls through the router's thread
pool. Every replica gets the same explicit version, so `policy_version` is one number; a sync takes one
params tree for all replicas (`params`) or one per replica (`replica_params`: a sequence indexed
by replica, or a callable `index -> params`, called in the caller's thread in index order, only
for live replicas: where each replica's engine lives on its own devices).

The router's state (its lock and condition, the replica list, the versions and counters) is the
router's; this module holds only the fan-out, so the router's module stays about routing.
"""
from __future__ import annotations

import concurrent.futures
import functools
import threading
from collections.abc import Callable
from typing import Any

from ._replica import Replica
from ._server import _set_future


def _combine(results: list[dict]) -> dict:
    """Per-replica result dicts -> one: numbers summed, `*_s` durations max-ed, flags true when
    true on every replica (zero_copy), except weights_released: true when true on any (a sync is
    then due before `wake`)."""
    out: dict = {}
    for result in results:
        for k, v in result.items():
            if isinstance(v, bool):
                out[k] = (out.get(k, False) or v) if k == "weights_released" else (out.get(k, True) and v)
            elif isinstance(v, (int, float)) and k.endswith("_s"):
                out[k] = max(out.get(k, v), v)
            elif isinstance(v, (int, float)):
                out[k] = out.get(k, 0) + v
    return out



class FanOutMixin:
    """`ReplicaRouter`'s fan-out methods (they use the router's attributes; see its __init__)."""

    def submit_update(self, params=None, *, version: int | None = None, in_flight: str = "hold",
                      replica_params=None) -> concurrent.futures.Future:
        """A weight sync to every live replica (`RolloutServer.submit_update` each), all at the
        same version (`version`, else one more than the last sync asked). Give `params` (one tree
        for all) or `replica_params` (a sequence indexed by replica, or a callable index ->
        params, called here in index order for the live replicas only). Returns one Future of the
        replicas' sync stats combined (numbers summed, `*_s` max-ed, zero_copy if on all) plus
        policy_version and replicas (how many synced). A replica that fails meanwhile is dropped
        and left out; any other error (a bad tree) fails the Future with the first replica's
        error, `policy_version` unchanged (replicas that did apply it are ahead: sync again).
        Safe on a replica's scheduler thread."""
        if in_flight not in ("hold", "finish"):
            raise ValueError(f"in_flight must be 'hold' or 'finish', got {in_flight!r}")
        if version is not None and (isinstance(version, bool) or not isinstance(version, int)):
            raise TypeError(f"version must be an int or None, got {version!r}")
        if (params is None) == (replica_params is None):
            raise ValueError("give exactly one of params (one tree for every replica) or "
                             "replica_params (a sequence or a callable index -> params)")
        if replica_params is not None and not callable(replica_params) and \
                len(replica_params) != len(self.replicas):
            raise ValueError(f"replica_params has {len(replica_params)} entries for "
                             f"{len(self.replicas)} replicas; give one per replica (by index)")
        with self._lock:
            self._check_running()
            live = {i: self.replicas[i] for i in range(len(self.replicas)) if i not in self._dead}
            target = version if version is not None else self._target_version + 1
            self._target_version, seq = target, next(self._sync_seq)
            self._syncs_running += 1
            self._sync_gen += 1
        futures, trees = {}, {}
        try:
            for i, replica in live.items():
                trees[i] = tree = params if replica_params is None else (
                    replica_params(i) if callable(replica_params) else replica_params[i])
                try:
                    futures[i] = replica.submit_update(tree, version=target, in_flight=in_flight)
                except Exception as error:  # noqa: BLE001 - sorted out with the others' results
                    futures[i] = concurrent.futures.Future()
                    futures[i].set_exception(error)
        except BaseException:  # the caller's replica_params raised
            self._sync_ended(None)
            raise
        keep = None  # restart without restart_params: every index's tree of this sync, if known
        if self._restart is not None and self._restart_params is None:
            keep = trees if callable(replica_params) else {
                i: params if replica_params is None else replica_params[i] for i in range(len(self.replicas))}
        out = self._gather(futures, functools.partial(self._synced, target, seq, keep), live)
        out.add_done_callback(self._sync_ended)
        return out

    def _sync_ended(self, _) -> None:
        with self._idle:
            self._syncs_running -= 1
            self._idle.notify_all()

    def _synced(self, target: int, seq: int, trees: dict[int, Any] | None, results: dict[int, dict]) -> dict:
        with self._lock:
            if seq > self._applied_seq:
                self._version, self._applied_seq = target, seq
                if trees is not None:  # restart: the weights a new replica i gets (none: unknown)
                    self._synced_trees = trees
        stats = _combine(list(results.values()))
        return {**stats, "policy_version": target, "replicas": len(results)}

    def update_params(self, params=None, *, version: int | None = None, in_flight: str = "hold",
                      replica_params=None) -> dict:
        """`submit_update(...)` and wait: every live replica synced, `policy_version` = the new
        version (not from a replica's scheduler thread)."""
        return self.submit_update(params, version=version, in_flight=in_flight,
                                  replica_params=replica_params).result()

    def _gather(self, futures: dict[int, concurrent.futures.Future],
                finish: Callable[[dict[int, Any]], Any],
                owners: dict[int, Replica]) -> concurrent.futures.Future:
        """One Future over per-replica futures (`owners`: the replicas they came from). A replica
        that failed (its `error` set) is dropped and left out; another exception (a bad tree,
        resume while asleep) fails it."""
        out: concurrent.futures.Future = concurrent.futures.Future()
        left = [len(futures)]
        lock = threading.Lock()

        def done(_):
            with lock:
                left[0] -= 1
                if left[0]:
                    return
            results, errors = {}, []
            for i, f in sorted(futures.items()):
                error = f.exception()
                if error is None:
                    results[i] = f.result()
                elif owners[i].error is not None or self.replicas[i] is not owners[i] or i in self._dead:
                    self._fail_replica(i, error, replica=owners[i])
                else:
                    errors.append((i, error))
            if errors:
                i, error = errors[0]
                _set_future(out, error=error)
            elif not results:
                _set_future(out, error=self._error or self._no_replica_error())
            else:
                try:
                    _set_future(out, finish(results))
                except Exception as error:  # noqa: BLE001
                    _set_future(out, error=error)

        if not futures:
            with self._lock:
                _set_future(out, error=self._error or self._no_replica_error())
        for f in futures.values():
            f.add_done_callback(done)
        return out

    def _fan_out(self, name: str) -> concurrent.futures.Future:
        """`replica.<name>()` on every live replica in parallel (the router's thread pool)."""
        with self._lock:
            self._check_running()
            live = {i: self.replicas[i] for i in range(len(self.replicas)) if i not in self._dead}
        futures = {i: self._pool.submit(getattr(r, name)) for i, r in live.items()}
        return self._gather(futures, lambda results: _combine(
            [r for r in results.values() if isinstance(r, dict)]), live)

    def suspend(self) -> None:
        """`suspend()` on every live replica; returns once all hold (see RolloutServer.suspend)."""
        self.submit_suspend().result()

    def submit_suspend(self) -> concurrent.futures.Future:
        """Queues `suspend()` on every replica; a Future resolved once all hold. Safe to call on
        a replica's scheduler thread."""
        return self._fan_out("suspend")

    def resume(self) -> None:
        self._fan_out("resume").result()

    def sleep(self) -> dict:
        """`sleep()` on every live replica: {"kv_bytes", "weight_bytes"} summed, "weights_released"
        if any replica released them."""
        return self._fan_out("sleep").result()

    def wake(self) -> dict:
        """`wake()` on every live replica: {"recomputed_requests", "recomputed_tokens"} summed."""
        return self._fan_out("wake").result()
