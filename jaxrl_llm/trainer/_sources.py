"""Rollout sources: where a training step's rollout comes from, and when the rollout engine gets
the newest weights. One class per trainer mode behind one protocol (`RolloutSource`); the
trainer's step calls `next`, trains, calls `after_update`, and never asks which mode it runs.

- `SyncSource` (`trainer.v1.trainer_mode='sync'`): draws prompts, generates with the current
  weights, syncs after every actor update.
- `OneStepOffSource` (separate placement, the batch driver in the background): step k+1's
  rollout runs while step k trains; the sync happens at the start of the next step, when the
  engine is idle.
- `RolloutBufferSource` (separate_async with the rollouter: agent loops on the request-level
  server, a trajectory queue between producer and trainer): groups are fed ahead, taken when
  finished, weights synced after each step under the rollouter (see `agent.Rollouter`).
- `ColocatedBufferSource` (colocate_async): the same rollouter on the training devices. Warm-up
  batches start generating before training needs them; when a step's groups are ready, the
  unfinished requests are held (tokens and log-probs kept, the server suspended while the
  actor trains), the weights are synced, and they resume where they stopped (partial rollout).

A source gets what it needs in a `SourceContext` (the config, the worker group, the prompt
loader, a seed function, the step timer, the function that generates a batch of prompts) and
imports nothing from the trainer. Batch assembly, scoring and training stay the trainer's.
"""
from __future__ import annotations

import base64
import dataclasses
import io
import math
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Protocol

import numpy as np

import rollout
from jaxrl_llm import _chaos
from jaxrl_llm.config import RunConfig
from jaxrl_llm.data import PromptLoader, RolloutResult
from jaxrl_llm.workers import HostWorker


class StepTimer:
    """Seconds per phase of the current step (`timing_s/<phase>`), shared by trainer and source."""

    def __init__(self):
        self.timing: dict[str, float] = {}

    def reset(self) -> dict[str, float]:
        self.timing = {}
        return self.timing

    @contextmanager
    def phase(self, name: str):
        t0 = time.perf_counter()
        yield
        self.add(name, time.perf_counter() - t0)

    def add(self, name: str, seconds: float) -> None:
        self.timing[name] = self.timing.get(name, 0.0) + seconds


@dataclass(frozen=True)
class SourceContext:
    """What a source works with. `group`: the worker group (`call`, `call_async`, `wait`);
    `seed(salt, step)`: the run's seed for a step; `generate(examples, sampling, seed)`: one
    rollout of `sampling.n` samples per example with the current weights (agent loop or batch
    driver, the trainer's choice)."""

    config: RunConfig
    group: Any
    loader: PromptLoader
    seed: Callable[[int, int], int]
    timer: StepTimer
    generate: Callable[..., RolloutResult]

    def call0(self, method, *args, **kwargs):
        return self.group.call(method, *args, **kwargs)[0]

    def sync(self, metrics: dict, method=HostWorker.sync_weights) -> None:
        out = self.call0(method)
        metrics.update({f"rollout/sync_{k}": float(v) for k, v in out.items()})


class RolloutSource(Protocol):
    """One trainer mode's rollout and weight-sync rule."""

    # the groups `next` returns were already filtered by DAPO's dynamic sampling
    # (`algorithm.filter_groups`), so the trainer takes them as they are
    filters_groups: bool

    def next(self, step: int, round_: int = 0) -> tuple[list, RolloutResult, dict]:
        """Step `step`'s (0-based) prompts, their rollout and the rollout's metrics; `round_` > 0
        is an extra generation round of the same step (DAPO's dynamic sampling)."""

    def after_update(self, step: int) -> dict:
        """After step `step`'s actor update: the mode's weight sync (if due); its metrics."""

    def end_step(self, timing: dict) -> dict:
        """The mode's metrics of a finished step (its timing known)."""

    def settle(self, steps_done: int) -> None:
        """Before validation: the engine idle and holding the newest weights."""

    def state(self) -> dict:
        """Checkpoint entries (`data`: the loader position the next step draws from, plus the
        mode's own)."""

    def restore(self, meta: dict) -> None:
        """Puts `state()`'s entries (from a checkpoint's meta) back."""

    def after_save(self, step: int, state: dict) -> None:
        """After a checkpoint with `state` was written (chaos kill points)."""

    def close(self, wait: bool = True) -> None:
        """Ends work in flight (`wait=False`: abandon it, the workers failed)."""


class SyncSource:
    """Synchronous: generate with the current weights, sync after every actor update."""

    filters_groups = False

    def __init__(self, ctx: SourceContext):
        self.ctx = ctx

    def next(self, step, round_=0):
        c, ctx = self.ctx.config, self.ctx
        examples = next(ctx.loader)
        with ctx.timer.phase("gen"):
            gen = ctx.generate(examples, c.rollout, seed=ctx.seed(1 + 100 * round_, step))
        return examples, gen, {"rollout/off_policy_steps": 0.0}

    def after_update(self, step):
        metrics: dict = {}
        with self.ctx.timer.phase("update_weights"):
            self.ctx.sync(metrics)
        return metrics

    def end_step(self, timing):
        return {}

    def settle(self, steps_done):
        pass

    def state(self):
        return {"data": self.ctx.loader.get_state()}

    def restore(self, meta):
        self.ctx.loader.set_state(meta["data"])

    def after_save(self, step, state):
        pass

    def close(self, wait=True):
        pass


class OneStepOffSource(SyncSource):
    """One step off policy (separate placement): step k+1's rollout, generated with the weights
    after step k-1, runs on the rollout devices while step k trains. The sync is at the start of
    a step, after its rollout was taken, when the engine is idle."""

    def __init__(self, ctx: SourceContext):
        super().__init__(ctx)
        # (handle of the generate call in flight, its prompts, the loader state before them,
        # its rollout once collected (the handle then None when it came from a checkpoint))
        self._pending = None

    def _kwargs(self, examples, step: int) -> dict:
        c = self.ctx.config
        return dict(prompts=[e.prompt_ids for e in examples], n=c.rollout.n,
                    max_new_tokens=c.data.max_response_length, seed=self.ctx.seed(1, step),
                    sampling=rollout.SamplingParams.from_config(c.rollout))

    def next(self, step, round_=0):
        ctx = self.ctx
        if self._pending is None:
            examples, gen, metrics = super().next(step, round_)
        else:
            with ctx.timer.phase("gen"):  # only the time this step waited for the rollout
                examples, gen = self._collect()
            self._pending = None
            ctx.timer.timing["gen_async"] = gen.time_s  # its full duration, mostly hidden
            metrics = {"rollout/off_policy_steps": 1.0}
        if step + 1 < ctx.config.trainer.total_training_steps:
            with ctx.timer.phase("update_weights"):
                ctx.sync(metrics)
            state = ctx.loader.get_state()
            nxt = next(ctx.loader)
            handle = ctx.group.call_async(HostWorker.generate, **self._kwargs(nxt, step + 1),
                                          gather=False)  # no collectives while the actor trains
            self._pending = (handle, nxt, state, None)
        return examples, gen, metrics

    def after_update(self, step):
        return {}  # the next step syncs, once its rollout is taken

    def _collect(self) -> tuple[list, RolloutResult]:
        """The rollout in flight, waited for and gathered (kept: a second call returns it again)."""
        handle, examples, state, gen = self._pending
        if gen is None:
            self.ctx.group.wait(handle)
            gen = self.ctx.call0(HostWorker.collect_rollout)  # several hosts: gathers their shares
            self._pending = (None, examples, state, gen)
        return examples, gen

    def settle(self, steps_done):
        if self._pending is not None and self._pending[0] is not None:
            self.ctx.group.wait(self._pending[0])  # a handle can be waited on again: the next step does
        self.ctx.sync({})

    def state(self):
        # the saved data position is before the prompts of a rollout in flight; that rollout
        # (generated with the weights before the last update, which the checkpoint does not
        # hold) is waited for and saved, so a resumed run draws its prompts again and trains on
        # it, as the uninterrupted run does
        if self._pending is None:
            return {"data": self.ctx.loader.get_state()}
        _, gen = self._collect()
        return {"data": self._pending[2], "one_step_off": {"rollout": encode_rollout(gen)}}

    def restore(self, meta):
        super().restore(meta)
        self._pending = None
        if "one_step_off" in meta:  # older checkpoints: the prompts are drawn and generated again
            state = self.ctx.loader.get_state()
            examples = next(self.ctx.loader)
            self._pending = (None, examples, state, decode_rollout(meta["one_step_off"]["rollout"]))

    def close(self, wait=True):
        if self._pending is not None and self._pending[0] is not None and wait:
            try:  # a rollout still in flight: let it end before the workers go
                self.ctx.group.wait(self._pending[0])
            except Exception:  # noqa: BLE001 - we are closing anyway
                pass
        self._pending = None


class RolloutBufferSource(SyncSource):
    """The rollouter (verl's fully async Rollouter + MessageQueue) on the request-level server:
    whole loader batches are fed as prompt groups ahead of need, a step takes
    `groups_per_step` finished groups (prompt order), weights are synced under the rollouter
    every `sync_every` steps. `run_ahead` (verl's staleness s) bounds the groups started per sync
    interval; `max_off_policy` bounds a trained token's age in syncs. With
    `algorithm.filter_groups` the rollouter evicts the groups DAPO's filter rejects as they
    finish (their slots go to prompts fed ahead), so a step's groups are already filtered."""

    filters_groups = True

    def __init__(self, ctx: SourceContext, *, groups_per_step: int, sync_every: int, run_ahead: float,
                 max_off_policy: int | None):
        super().__init__(ctx)
        self.groups_per_step, self.sync_every = groups_per_step, sync_every
        self.run_ahead, self.max_off_policy = run_ahead, max_off_policy
        # loader batches handed to the rollouter, groups handed and not yet trained, trained
        # groups with a token from an older policy version, last rollouter counters
        self._fed_batches = self._outstanding = self._stale_groups = 0
        self._producer_last: tuple[float, dict] | None = None
        # the rollouter's groups_evicted at the last take: an evicted group (filtered by DAPO's
        # dynamic sampling, or failed) leaves without being taken, its slot going to a fed prompt
        self._evicted_seen = self._filtered_seen = self._last_evicted = 0

    def _feed(self) -> None:
        """Hands the rollouter whole loader batches until it has the groups it may start before
        the next sync plus one step's worth. Batch b's prompt i samples with the synchronous
        trainer's seed for step b and rows i*n .. i*n+n-1, so run_ahead 0 reproduces it exactly."""
        ctx, c = self.ctx, self.ctx.config
        per_sync = self.sync_every * self.groups_per_step
        ahead = math.floor((1 + self.run_ahead) * per_sync + 1e-9) + self.groups_per_step
        n, size = c.rollout.n, c.data.train_batch_size
        fg = c.algorithm.filter_groups
        if fg.enable:  # prompts for the groups the filter will evict: the step's budget, else as many as last step
            ahead += (fg.max_num_gen_batches - 1) * size if fg.max_num_gen_batches > 0 else self._last_evicted
        while self._outstanding < ahead:
            b = self._fed_batches
            examples = next(ctx.loader)
            groups = [dict(index=b * size + i, seed=ctx.seed(1, b), first_row=i * n, n=n,
                           sample=dict(raw_prompt=e.raw_prompt, data_source=e.data_source,
                                       ground_truth=e.ground_truth, extra_info=e.extra_info,
                                       agent_name=e.agent_name))
                      for i, e in enumerate(examples)]
            ctx.call0(HostWorker.async_feed, groups)
            self._fed_batches += 1
            self._outstanding += len(groups)

    def next(self, step, round_=0):
        """One step's groups from the trajectory queue (rows by prompt index), with the
        staleness, partial-rollout and idle metrics."""
        ctx, k = self.ctx, self.groups_per_step
        self._feed()
        with ctx.timer.phase("gen"):  # the trainer's wait for finished groups
            gen = ctx.call0(HostWorker.async_take, k, max_staleness=self.max_off_policy)
        stats = gen.producer
        evicted = int(stats["groups_evicted"]) - self._evicted_seen
        filtered = int(stats["groups_filtered"]) - self._filtered_seen
        self._evicted_seen, self._filtered_seen = int(stats["groups_evicted"]), int(stats["groups_filtered"])
        self._outstanding -= k + evicted  # so the next _feed replaces the evicted groups too
        self._last_evicted = evicted
        version, lo, hi = gen.policy_version, gen.group_min_version, gen.group_max_version
        stale = version - lo
        self._stale_groups += int((stale > 0).sum())
        versions = gen.rollout_versions
        lag = (version - versions)[versions >= 0]
        stats, now = gen.producer, time.perf_counter()
        metrics: dict[str, float] = {}
        if self._producer_last is not None:
            t_prev, prev = self._producer_last
            idle = (stats["idle_s"] - prev["idle_s"]) / max(now - t_prev, 1e-9)
            metrics["fully_async/rollouter/idle_ratio"] = float(min(max(idle, 0.0), 1.0))
        self._producer_last = (now, stats)
        metrics.update({
            "fully_async/staleness/mean": float(stale.mean()), "fully_async/staleness/max": float(stale.max()),
            "fully_async/staleness/bound": float(-1 if self.max_off_policy is None else self.max_off_policy),
            "rollout/policy_version": float(version),
            "rollout/policy_version_lag": float(lag.mean()) if lag.size else 0.0,
            "fully_async/count/stale_samples_processed": float(self._stale_groups),
            "fully_async/partial/partial_ratio": float((hi != lo).mean()),
            "fully_async/partial/max_partial_span": float((hi - lo).max()),
            "fully_async/queue_size": stats["queue_size"],
            "fully_async/dropped_stale_groups": stats["groups_dropped_stale"]})
        if ctx.config.algorithm.filter_groups.enable:  # verl's name: groups the filter rejected this step
            metrics["filter_groups/filtered_groups"] = float(filtered)
        return list(gen.samples), gen, metrics

    def after_update(self, step):
        metrics: dict = {}
        if (step + 1) % self.sync_every == 0:
            with self.ctx.timer.phase("update_weights"):
                self.ctx.sync(metrics, HostWorker.async_sync)
        return metrics

    def end_step(self, timing):
        return {"fully_async/trainer/idle_ratio": timing["gen"] / max(timing["step"], 1e-9)}

    def settle(self, steps_done):
        if steps_done % self.sync_every:  # the last step did not sync
            self.ctx.sync({}, HostWorker.async_sync)

    def state(self):
        # the trajectory queue and the prompts handed out but not finished
        return {"data": self.ctx.loader.get_state(),
                "fully_async": {**self.ctx.call0(HostWorker.async_state), "fed_batches": self._fed_batches,
                                "stale_groups": self._stale_groups}}

    def restore(self, meta):
        super().restore(meta)
        if "fully_async" in meta:
            state = meta["fully_async"]
            self.ctx.call0(HostWorker.async_restore, state)
            self._fed_batches, self._stale_groups = int(state["fed_batches"]), int(state["stale_groups"])
            self._outstanding = len(state["pending"]) + len(state["queued"])
            counters = state.get("counters", {})  # the rollouter restores its cumulative counters
            self._filtered_seen = int(counters.get("groups_filtered", 0))
            self._evicted_seen = int(counters.get("groups_failed", 0)) + self._filtered_seen

    def after_save(self, step, state):
        queue = state["fully_async"]
        if queue["queued"] or queue["pending"]:
            _chaos.kill_point("async_queue", step)


class ColocatedBufferSource(RolloutBufferSource):
    """colocate_async: the rollouter on the colocated engine's server. `next` takes a step's
    finished groups and then holds the rest (`HostWorker.async_hold`: no group admitted, running
    requests keep their slots, tokens and log-probs, the server asleep (`rollout.free_cache_engine`:
    its KV cache released for the update, the held requests re-prefilled at wake) or suspended,
    so it does not decode while the actor trains on the same devices); `after_update` syncs the new weights under the
    rollouter, which resumes the held requests with the new policy version."""

    def __init__(self, ctx: SourceContext, **kwargs):
        super().__init__(ctx, **kwargs)
        self._held = False

    def next(self, step, round_=0):
        examples, gen, metrics = super().next(step, round_)
        with self.ctx.timer.phase("hold"):
            held = self.ctx.call0(HostWorker.async_hold)
        self._held = True
        metrics.update({"colocate_async/held_groups": float(held["held_groups"]),
                        "colocate_async/server_suspended": float(held["suspended"]),
                        "colocate_async/kv_bytes_released": float(held["kv_bytes_released"])})
        return examples, gen, metrics

    def after_update(self, step):
        self._held = False  # async_sync resumes the server and the rollouter
        return super().after_update(step)

    def end_step(self, timing):
        if self._held:  # no actor update this step (critic warm-up): resume without a sync
            self.ctx.call0(HostWorker.async_release)
            self._held = False
        return super().end_step(timing)


def encode_rollout(gen: RolloutResult) -> dict:
    """A batch-driver `RolloutResult` as checkpoint metadata (JSON): its arrays in one compressed
    npz (base64), its other set fields as they are. Fields the batch driver leaves at their
    defaults are left out; one of another kind is refused (the agent loop's rollouts are not
    checkpointed this way)."""
    arrays, fields = {}, {}
    for f in dataclasses.fields(gen):
        value = getattr(gen, f.name)
        if isinstance(value, np.ndarray):
            arrays[f.name] = value
        elif f.default is not dataclasses.MISSING and value == f.default or (
                f.default_factory is not dataclasses.MISSING and value == f.default_factory()):
            continue
        elif isinstance(value, (int, float, str)) or (
                isinstance(value, tuple) and all(isinstance(v, str) for v in value)):
            fields[f.name] = list(value) if isinstance(value, tuple) else value
        else:
            raise TypeError(f"RolloutResult.{f.name} ({type(value).__name__}) cannot be checkpointed")
    buf = io.BytesIO()
    np.savez_compressed(buf, **arrays)
    return {"arrays": base64.b64encode(buf.getvalue()).decode("ascii"), "fields": fields}


def decode_rollout(d: dict) -> RolloutResult:
    """`encode_rollout`'s inverse."""
    with np.load(io.BytesIO(base64.b64decode(d["arrays"]))) as npz:
        arrays = {k: npz[k] for k in npz.files}
    fields = {k: tuple(v) if isinstance(v, list) else v for k, v in d["fields"].items()}
    return RolloutResult(**arrays, **fields)
