"""colocate_async (`trainer.v1.trainer_mode`): the rollouter on the training devices. Warm-up
batches are generating before a step asks for them; the unfinished requests are held over the
update and the weight sync (that a held request keeps its tokens and continues with the new
version is the Rollouter's partial rollout, tests/agent/test_agent_rollouter.py); two steps with
and without the agent loop; a checkpoint resumes to the same next step."""
import json
import os

import numpy as np
import pytest

from jaxrl_llm.config import ConfigError, load_config
from jaxrl_llm.trainer import RLTrainer
from jaxrl_llm.workers import HostWorker
from trainer_helpers import QUICKSTART, ROOT, tiny_overrides

_COLOCATE = {"trainer.v1.trainer_mode": "colocate_async", "trainer.backend": "local",
             "trainer.export_hf": False, "trainer.val_before_train": False, "data.builtin_val_size": 0,
             "trainer.v1.colocate_async.num_warmup_batches": 1.0}


def _rows(path):
    return [json.loads(line) for line in open(os.path.join(path, "metrics.jsonl"))]


def test_warmup_generates_ahead_and_held_requests_resume_with_their_tokens(tmp_path):
    run = load_config(f"{QUICKSTART}:tiny", tiny_overrides(tmp_path / "run", **_COLOCATE))
    size = run.data.train_batch_size
    trainer = RLTrainer(run)
    try:
        trainer.call0(HostWorker.start_rl, 2)
        host = trainer.group.workers[0]
        assert run.rollout_source == "colocated_buffer" and host.server is not None
        steps = []
        for _ in range(2):
            steps.append(trainer.train_step())
            if trainer.global_step == 0:
                # warm-up: the groups of the next num_warmup_batches batches were started with
                # this step's, before the next step asks for them
                assert host._rollouter.stats()["groups_started"] >= 2 * size
            trainer.global_step += 1
        versions = host.server.policy_version
    finally:
        trainer.close()
    for m in steps:
        assert np.isfinite(m["actor/pg_loss"])
        # held over the update: the server stops decoding where it can (suspend), the rollouter
        # admits nothing; the step then syncs, which resumes them with the new version
        assert "colocate_async/held_groups" in m and "rollout/sync_policy_version" in m
        # rollout.free_cache_engine (default): the engine slept through the update, its KV cache released
        assert m["colocate_async/kv_bytes_released"] > 0 and m["colocate_async/server_suspended"] == 1.0
        assert m["fully_async/staleness/max"] <= run.trainer.v1.sampler.max_off_policy_threshold
    assert versions >= 2
    assert steps[1]["rollout/policy_version"] == steps[0]["rollout/policy_version"] + 1


def test_colocate_async_with_the_agent_loop_fits_and_checkpoints_its_queue(tmp_path):
    tools = os.path.join(ROOT, "configs", "quickstart_tools.py")
    o = {**_COLOCATE, "trainer.total_training_steps": 2, "trainer.save_freq": 1, "trainer.max_to_keep": 2,
         "trainer.test_freq": 0}
    o = [f"{k}={v}" for k, v in {"trainer.default_local_dir": str(tmp_path / "a"), "trainer.progress_bar": False,
                                 "trainer.plot": False, "trainer.logger": "jsonl", "trainer.async_save": False,
                                 **o}.items()]
    RLTrainer(load_config(f"{tools}:tiny,local", o)).fit()
    first = _rows(tmp_path / "a")
    assert [r["training/global_step"] for r in first] == [1, 2]
    assert all(r["num_turns/min"] >= 1 and np.isfinite(r["actor/pg_loss"]) for r in first)
    meta = json.load(open(tmp_path / "a" / "checkpoints" / "1" / "meta" / "metadata"))
    assert "fully_async" in meta  # the queue and the unfinished prompts are checkpointed


def test_colocate_async_resume_repeats_the_next_step(tmp_path):
    """num_warmup_batches=0: the rollouter starts exactly the groups a step trains, so nothing is
    held and the run is deterministic; resuming from step 2's checkpoint (queue, unfinished
    prompts, data position, policy version) gives step 3 as the uninterrupted run had it."""
    o = {**_COLOCATE, "trainer.v1.colocate_async.num_warmup_batches": 0.0, "trainer.total_training_steps": 3,
         "trainer.save_freq": 1, "trainer.max_to_keep": 3, "trainer.test_freq": 0}
    load = lambda **x: load_config(f"{QUICKSTART}:tiny", tiny_overrides(tmp_path / "a", **{**o, **x}))  # noqa: E731
    RLTrainer(load()).fit()
    first = _rows(tmp_path / "a")
    RLTrainer(load(**{"trainer.resume_mode": str(tmp_path / "a" / "checkpoints" / "2")})).fit()
    again = _rows(tmp_path / "a")
    assert [r["training/global_step"] for r in again] == [1, 2, 3]
    compared = 0
    for key, value in first[2].items():
        if key.startswith(("critic/", "actor/", "response_length/", "rollout/policy_version",
                           "fully_async/staleness", "training/")) and isinstance(value, float):
            assert again[2][key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
            compared += 1
    assert compared > 20


class _GateServer:
    """A stand-in request-level server: emits a request's tokens one at a time, only while it
    may (`allow(k)` grants k more tokens) and is not suspended, each stamped with the policy
    version of the moment; the tokens depend only on (seed, row). `emitted` counts them."""

    def __init__(self, length):
        import threading

        self.length, self.policy_version, self.suspended, self.asleep = length, 0, False, False
        self.emitted, self._budget = 0, 0
        self._cv = threading.Condition()

    def allow(self, k):
        with self._cv:
            self._budget += k
            self._cv.notify_all()

    def wait_emitted(self, k):
        with self._cv:
            assert self._cv.wait_for(lambda: self.emitted >= k, timeout=30), self.emitted

    def suspend(self):
        with self._cv:
            self.suspended = True

    def resume(self):
        with self._cv:
            self.suspended = False
            self._cv.notify_all()

    def _next_token(self):  # blocks (in a worker thread) until a token may be emitted
        with self._cv:
            self._cv.wait_for(lambda: self._budget > 0 and not self.suspended, timeout=30)
            self._budget -= 1
            self.emitted += 1
            self._cv.notify_all()
            return self.policy_version

    async def agenerate(self, request_id, prompt_ids, *, sampling, max_new_tokens, session_id, seed, row):
        import asyncio
        import types

        ids = np.random.default_rng([seed, row]).integers(ord("a"), ord("z") + 1, size=self.length).tolist()
        versions = [await asyncio.to_thread(self._next_token) for _ in ids]
        return types.SimpleNamespace(token_ids=ids, log_probs=[-0.5] * len(ids), finish_reason="length",
                                     policy_versions=versions)

    def release_session(self, session_id):
        pass


def test_a_request_held_at_a_step_boundary_resumes_with_its_tokens(tmp_path):
    """HostWorker's hold / sync around the update: a request that has 3 of its 6 tokens when the
    step's batch is ready is held (rollouter paused, server suspended: no token while the actor
    trains, though tokens are allowed), the sync bumps the policy version and resumes it, and it
    finishes with its first 3 tokens from version 0, the rest from version 1, and exactly the
    tokens of an uninterrupted run."""
    import functools
    import types

    from jaxrl_llm import agent, models

    run = load_config(f"{QUICKSTART}:tiny", tiny_overrides(tmp_path / "run", **_COLOCATE,
                                                        **{"rollout.free_cache_engine": False}))
    server = _GateServer(length=6)
    runner = agent.AgentRunner(server, models.CharTokenizer(), run.rollout.multi_turn, max_prompt_length=16,
                               max_response_length=16, pad_token_id=0, tools={}, interactions={})
    host = types.SimpleNamespace(config=run, _rollouter=None, server=server,
                                 _agent_runner=lambda: runner)
    for name in ("_async", "async_hold", "async_sync", "async_release", "_resume_server"):
        setattr(host, name, functools.partial(getattr(HostWorker, name), host))

    def sync_weights():
        server.policy_version += 1
        return {"policy_version": server.policy_version}

    host.sync_weights = sync_weights
    r = host._async()
    try:
        assert r.partial_rollout  # always on in colocate_async
        r.feed([agent.PromptGroup(index=0, seed=11, first_row=0, n=1,
                                  sample=dict(raw_prompt=[{"role": "user", "content": "hi"}], data_source="t",
                                              ground_truth="x", extra_info={}, agent_name="single_turn_agent"))])
        server.allow(3)
        server.wait_emitted(3)
        held = host.async_hold()
        assert held == {"held_groups": 1, "suspended": True, "kv_bytes_released": 0}
        server.allow(3)  # tokens allowed, but the server is suspended: none comes
        assert server.emitted == 3 and len(r.queue) == 0
        host.async_sync()  # version 1, server and rollouter resumed
        (group,) = r.take(1, max_staleness=1, timeout=30)
    finally:
        r.close()
    out = group.results[0][1]
    assert out.response_versions == [0, 0, 0, 1, 1, 1]
    want = np.random.default_rng([11, 0]).integers(ord("a"), ord("z") + 1, size=6).tolist()
    assert out.response_ids == want


def test_dapo_filter_in_the_rollouter_refills_the_evicted_groups(tmp_path):
    """algorithm.filter_groups in colocate_async: the rollouter evicts each finished group whose
    rewards all agree (the tiny model's length-parity rewards agree for about half the groups)
    and a fed prompt takes its slot; each step still trains train_batch_size groups, and the
    trainer counts an evicted group as gone, so it feeds prompts for it (what it believes is
    outstanding is what the rollouter holds)."""
    o = {**_COLOCATE, "algorithm.filter_groups.enable": True, "algorithm.filter_groups.metric": "acc",
         "algorithm.filter_groups.max_num_gen_batches": 4}
    run = load_config(f"{QUICKSTART}:tiny", tiny_overrides(tmp_path / "run", **o))
    size = run.data.train_batch_size
    trainer = RLTrainer(run)
    taken = []
    next_ = trainer.source.next

    def counting(step, round_=0):
        examples, gen, metrics = next_(step, round_)
        taken.append(len(examples))
        return examples, gen, metrics
    trainer.source.next = counting
    try:
        trainer.call0(HostWorker.start_rl, 2)
        host = trainer.group.workers[0]
        steps = []
        for _ in range(2):
            steps.append(trainer.train_step())
            trainer.global_step += 1
            s = host._rollouter.stats()
            # every fed group not yet taken is queued, running or waiting, or was evicted (those
            # since the last take are counted at the next one)
            since = s["groups_evicted"] - trainer.source._evicted_seen
            assert trainer.source._outstanding - since == s["queue_size"] + s["running"] + s["waiting"]
    finally:
        trainer.close()
    assert taken == [size, size]  # one take of a full batch per step, no trainer-side rounds
    assert sum(m["filter_groups/filtered_groups"] for m in steps) > 0
    assert s["groups_filtered"] >= sum(m["filter_groups/filtered_groups"] for m in steps)
    for m in steps:
        assert np.isfinite(m["actor/pg_loss"])


def test_dapo_filter_budget_in_the_rollouter_names_max_num_gen_batches(tmp_path):
    """max_num_gen_batches=1: a step may evict (1 - 1) x train_batch_size = 0 groups, so the first
    group the filter rejects fails the step with the setting to raise."""
    o = {**_COLOCATE, "algorithm.filter_groups.enable": True, "algorithm.filter_groups.max_num_gen_batches": 1}
    trainer = RLTrainer(load_config(f"{QUICKSTART}:tiny", tiny_overrides(tmp_path / "run", **o)))
    try:
        trainer.call0(HostWorker.start_rl, 1)
        with pytest.raises(Exception, match=r"algorithm\.filter_groups\.max_num_gen_batches=1"):
            trainer.train_step()
    finally:
        trainer.close()


@pytest.mark.parametrize("mode", ["colocate_async", "separate_async"])
def test_dapo_filter_config_in_the_async_modes(mode):
    o = {"trainer.v1.trainer_mode": mode, "algorithm.filter_groups.enable": True,
         "algorithm.filter_groups.max_num_gen_batches": 3}
    if mode == "colocate_async":
        o["placement.mode"] = "colocated"
    else:  # two batches ahead: the rollouter pipeline, not the one-step-off batch driver
        o.update({"placement.mode": "separate", "mesh.fsdp": 4, "placement.rollout_mesh.tensor": 4,
                  "model.init.num_key_value_heads": 4, "data.train_batch_size": 4,
                  "actor.ppo_mini_batch_size": 4, "trainer.v1.colocate_async.num_warmup_batches": 2.0,
                  "trainer.v1.sampler.max_off_policy_threshold": 2})
    load = lambda **x: load_config(f"{QUICKSTART}:tiny", [f"{k}={v}" for k, v in {**o, **x}.items()])  # noqa: E731
    assert load(**{"algorithm.filter_groups.metric": "score"}).algorithm.filter_groups.enable
    with pytest.raises(ConfigError, match=r"filter_groups\.metric .*'seq_reward'"):
        load(**{"algorithm.filter_groups.metric": "seq_reward"})
    with pytest.raises(ConfigError, match=r"max_num_gen_batches=0 \(unlimited\)"):
        load(**{"algorithm.filter_groups.max_num_gen_batches": 0})
    if mode == "separate_async":  # one batch ahead, bound 1: the batch driver's pipeline has no rounds
        with pytest.raises(ConfigError, match="one-step-off pipeline"):
            load(**{"trainer.v1.colocate_async.num_warmup_batches": 1.0,
                    "trainer.v1.sampler.max_off_policy_threshold": 1})
