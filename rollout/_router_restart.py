"""Restarting a dead replica behind `ReplicaRouter` (its restart half, a mixin of the router).

With `ReplicaRouter(restart=fn)` (off by default) a replica that died is closed (a child process
reaped) and rebuilt by `restart(index)` on a thread of its own, synced to the router's policy
version with `restart_params(index)` or the tree that index got at the last applied sync (the
router keeps a reference to it only when restarting without `restart_params`; no copy), synced
again if a sync ran meanwhile, suspended or put to sleep like the others, then put back in the
balancer under the same index. While it restarts, requests that no live replica can take wait in
the router's queue.

`max_restarts` bounds the attempts per index, failed ones included: a restart that raises (the
factory, a child that never reports ready, the sync) is retried at once while attempts are left,
with a warning each time, after a wait that doubles with each failure in a row
(`restart_backoff_s`, 2x, 4x, ..., at most 60 s; `close` cuts it short), so a cause that needs
time to clear (a device still held by the dead process, a port in TIME_WAIT) gets it and a
factory that always fails does not spin. Once no attempt is left the replica is dropped for
good with a warning, as is a death past max_restarts; the run goes on with the others (or, with
none left, every waiting request fails with one error). The first attempt after a death starts
at once.

The router's state (its lock and condition, the replica list, the counters) is the router's;
this module holds only the restart logic, so the router's module stays about routing.
"""
from __future__ import annotations

import logging
import threading

from ._replica import LocalReplica, Replica
from ._server import RolloutServer, _set_future

log = logging.getLogger("rollout._router")  # the router's warnings, one logger


MAX_RESTART_DELAY_S = 60.0


def restart_delay(backoff_s: float, failures: int) -> float:
    """Seconds to wait before the next restart attempt after `failures` failed ones in a row."""
    return min(backoff_s * 2.0 ** (failures - 1), max(backoff_s, MAX_RESTART_DELAY_S))


class _Closing(Exception):
    """The router closed while a replica was restarting."""


class RestartMixin:
    """`ReplicaRouter`'s restart methods (they use the router's attributes; see its __init__)."""

    def _start_restart(self, i: int) -> bool:
        """Under the lock, as dead replica i is dropped: starts its restart thread when the router
        restarts replicas and attempts are left; whether it did."""
        if self._restart is None or self._closing or self._restarts[i] >= self._max_restarts:
            return False
        self._restarts[i] += 1
        self._restarting.add(i)
        thread = threading.Thread(target=self._restart_replica, args=(i,), daemon=True,
                                  name=f"ReplicaRouter-restart-{i}")
        self._restart_threads.append(thread)  # close() joins it
        thread.start()
        return True

    def _restart_replica(self, i: int) -> None:
        """On its own thread: closes dead replica i (reaps a process), builds its successor with
        `restart(i)`, brings it to the router's weights and state, and puts it back in the
        balancer; a failed attempt is retried while max_restarts allows, then replica i is
        dropped for good, with a warning."""
        self._call(i, lambda r: r.close())
        while True:
            new = None
            try:
                if self._closing:
                    raise _Closing()
                new = self._restart(i)
                new = LocalReplica(new) if isinstance(new, RolloutServer) else new
                if not isinstance(new, Replica):
                    raise TypeError(f"restart({i}) returned {type(new).__name__}, neither a RolloutServer "
                                    f"nor a rollout.Replica")
                self._bring_up(i, new)
                return
            except Exception as error:  # noqa: BLE001 - retried or dropped; the run goes on
                if new is not None:
                    self._call_on(new, lambda r: r.close())
                if not self._restart_failed(i, error):
                    return

    def _restart_failed(self, i: int, error: Exception) -> bool:
        """After a failed attempt for replica i: True to try again (an attempt left), else drops
        it for good (failing every waiting request if no replica is left)."""
        closing = isinstance(error, _Closing)
        with self._idle:
            self._counts["failed_restarts"] += not closing
            retry = not closing and not self._closing and self._restarts[i] < self._max_restarts
            if retry:
                self._restarts[i] += 1
                self._failures_in_a_row[i] += 1
                delay = restart_delay(self._restart_backoff_s, self._failures_in_a_row[i])
            else:
                self._restarting.discard(i)
                self._idle.notify_all()
                left = self._fail_if_none_left()
        if retry:
            log.warning("rollout replica %d: restart failed (%r); trying again in %.3g s (restart %d of %d)",
                        i, error, delay, self._restarts[i], self._max_restarts)
            with self._idle:  # close() notifies: the wait ends at once and the next attempt sees _closing
                self._idle.wait_for(lambda: self._closing, timeout=delay)
            return True
        if not closing:
            log.warning("rollout replica %d: restart failed (%r); dropped for good (max_restarts=%d "
                        "attempts used)", i, error, self._max_restarts)
        for req in left:
            _set_future(req.future, error=self._error)
        return False

    def _bring_up(self, i: int, new: Replica) -> None:
        """Syncs `new` to the router's version (again if a sync ran meanwhile), matches suspend /
        sleep, and puts it in place of dead replica i once no sync is running (under the lock, so
        every later sync includes it)."""
        while True:
            with self._idle:
                while self._syncs_running and not self._closing:
                    self._idle.wait()
                if self._closing:
                    raise _Closing()
                gen, version = self._sync_gen, self._version
                tree = self._synced_trees.get(i)
            if new.policy_version != version:
                if self._restart_params is not None:
                    tree = self._restart_params(i)
                if tree is None:
                    raise RuntimeError(f"the router is at policy version {version} but has no weights "
                                       f"for the restarted replica {i} (at {new.policy_version}); pass "
                                       f"restart_params to ReplicaRouter")
                new.submit_update(tree, version=version, in_flight="hold").result()
            if self.asleep:
                new.sleep()
            elif self.suspended:
                new.suspend()
            with self._idle:
                if self._closing:
                    raise _Closing()
                if gen != self._sync_gen or self._syncs_running:
                    continue  # a sync started meanwhile: sync again
                self._retired.update(self._dead_stats.pop(i, {}))
                self.replicas[i], self._last_stats[i] = new, {}
                del self._dead[i]
                self._restarting.discard(i)
                self._failures_in_a_row[i] = 0
                self._counts["restarted_replicas"] += 1
                self._idle.notify_all()
            break
        log.warning("rollout replica %d restarted at policy version %d and back in the balancer", i, version)
        self._pump()

    def wait_restarts(self, timeout: float | None = None) -> bool:
        """Blocks until no replica is restarting (each back in the balancer or dropped); False
        if `timeout` seconds passed first."""
        with self._idle:
            return self._idle.wait_for(lambda: not self._restarting, timeout)
