"""The `Replica` protocol: what `ReplicaRouter` needs from one rollout replica, and `LocalReplica`,
the in-process one over a `RolloutServer`.

`ProcessReplica` (rollout/_process_replica.py) is one in a child process, over a pipe; a replica
on another host (a Ray actor or an RPC handle: later work) implements the same members; the
router never reaches past them.
"""
from __future__ import annotations

import concurrent.futures
from typing import Protocol, runtime_checkable

import numpy as np

from ._sampling import SamplingParams
from ._server import RolloutServer


@runtime_checkable
class Replica(Protocol):
    """What the router needs from one rollout replica (in process: `LocalReplica`).

    Contract: `validate` and `submit` raise ValueError / TypeError for a bad request (the router
    re-raises those to its caller); any other exception from `submit`, or any exception set on a
    request's Future, means the replica failed. `error` is not None once the replica has failed
    (the router reads it to tell a failed replica from a bad sync or control call). Request
    Futures resolve with a `GenerateOutput`; aborted or closed requests resolve with
    finish_reason "abort", never with an exception.

    Streaming (optional): a replica whose class sets `streams = True` also takes
    `submit(..., on_tokens=)` with `RolloutServer.submit`'s contract (`LocalReplica`,
    `ProcessReplica`); the router passes it only to those: a replica without the attribute
    streams nothing (its requests' tokens all come with their outputs).
    """

    @property
    def capacity(self) -> int:
        """Requests it runs at once (its decode slots): the default bound per replica."""

    @property
    def error(self) -> BaseException | None: ...

    @property
    def policy_version(self) -> int: ...

    @property
    def suspended(self) -> bool: ...

    @property
    def asleep(self) -> bool: ...

    @property
    def stats(self) -> dict: ...

    def validate(self, request_id: str, prompt_ids, *, sampling: SamplingParams,
                 max_new_tokens: int, session_id: str | None, seed: int, row: int,
                 step_offset: int) -> list[int]:
        """Checks a request as `submit` would (raises); returns the prompt as a list of ints."""

    def submit(self, request_id: str, prompt_ids, *, sampling: SamplingParams, max_new_tokens: int,
               session_id: str | None, seed: int, row: int,
               step_offset: int) -> concurrent.futures.Future: ...

    def abort(self, request_id: str) -> bool: ...

    def release_session(self, session_id: str) -> None: ...

    def submit_update(self, params, *, version: int | None,
                      in_flight: str) -> concurrent.futures.Future: ...

    def suspend(self) -> None: ...

    def resume(self) -> None: ...

    def sleep(self) -> dict: ...

    def wake(self) -> dict: ...

    def close(self) -> None: ...


def check_step_offset(step_offset) -> None:
    if isinstance(step_offset, bool) or not isinstance(step_offset, (int, np.integer)) or step_offset < 0:
        raise ValueError(f"step_offset must be an int >= 0, got {step_offset!r}")


class LocalReplica:
    """A `Replica` over a `RolloutServer` in this process (`server`: the server itself)."""

    streams = True  # submit takes on_tokens (the server's streaming)

    def __init__(self, server: RolloutServer):
        self.server = server

    @property
    def capacity(self) -> int:
        return int(self.server.engine.max_concurrent_decodes)

    @property
    def error(self) -> BaseException | None:
        return self.server._error  # set, under the server's lock, before its futures fail

    @property
    def policy_version(self) -> int:
        return self.server.policy_version

    @property
    def suspended(self) -> bool:
        return self.server.suspended

    @property
    def asleep(self) -> bool:
        return self.server.asleep

    @property
    def stats(self) -> dict:
        return self.server.stats

    def validate(self, request_id, prompt_ids, *, sampling, max_new_tokens, session_id, seed, row,
                 step_offset) -> list[int]:
        prompt = self.server._validate(request_id, prompt_ids, sampling, max_new_tokens,
                                       session_id, seed, row)
        check_step_offset(step_offset)
        return prompt

    def submit(self, request_id, prompt_ids, **kwargs) -> concurrent.futures.Future:
        return self.server.submit(request_id, prompt_ids, **kwargs)

    def abort(self, request_id: str) -> bool:
        return self.server.abort(request_id)

    def release_session(self, session_id: str) -> None:
        self.server.release_session(session_id)

    def submit_update(self, params, *, version, in_flight) -> concurrent.futures.Future:
        return self.server.submit_update(params, version=version, in_flight=in_flight)

    def suspend(self) -> None:
        self.server.suspend()

    def resume(self) -> None:
        self.server.resume()

    def sleep(self) -> dict:
        return self.server.sleep()

    def wake(self) -> dict:
        return self.server.wake()

    def close(self) -> None:
        self.server.close()
