"""The controller <-> worker boundary: worker methods are passed as functions of the worker
class (a misspelt one fails where it is written, not in a Ray call), batches are `data.Batch`,
sampling settings `rollout.SamplingParams`."""
import numpy as np
import pytest

import rollout
from jaxrl_llm.config import load_config
from jaxrl_llm.data import Batch
from jaxrl_llm.trainer import LocalGroup, RLTrainer, WorkerError
from jaxrl_llm.workers import HostWorker
from trainer_helpers import QUICKSTART, tiny_overrides


class Echo:
    def __init__(self, base):
        self.base = base

    def add(self, x, *, y=0):
        return self.base + x + y

    def fail(self):
        raise ValueError("boom")

    def _private(self):
        return 0


class Other:
    def add(self, x):
        return x


def test_group_calls_take_worker_methods_not_names():
    group = LocalGroup(Echo, 10, max_concurrency=2)
    try:
        assert group.call(Echo.add, 1, y=2) == [13]
        assert group.wait(group.call_async(Echo.add, 5)) == [15]
        with pytest.raises(AttributeError, match="has no attribute 'ad'"):  # a typo fails at the call site
            group.call(Echo.ad, 1)
        with pytest.raises(TypeError, match=r"pass the worker method itself, e\.g\. Echo\.add, not its name"):
            group.call("add", 1)
        with pytest.raises(TypeError, match="'Other.add' is not a public method of the worker class Echo"):
            group.call(Other.add, 1)
        with pytest.raises(TypeError, match="not a public method"):
            group.call(Echo._private)
        with pytest.raises(TypeError, match="not its name"):  # refused before anything runs
            group.call_async("add", 1)
        with pytest.raises(WorkerError, match="worker call 'fail' failed: ValueError: boom"):
            group.call(Echo.fail)
    finally:
        group.shutdown()


def test_host_worker_batch_methods_refuse_a_plain_dict():
    fields = {"input_ids": np.zeros((2, 4), np.int32)}
    for method in (HostWorker.compute_old_log_prob, HostWorker.compute_values, HostWorker.compute_ref_log_prob):
        with pytest.raises(TypeError, match=rf"HostWorker.{method.__name__} takes a jaxrl_llm.data.Batch"):
            method(None, fields)
    with pytest.raises(TypeError, match="HostWorker.update_actor takes a jaxrl_llm.data.Batch"):
        HostWorker.update_actor(None, fields, mini_rows=2, seed=0)
    assert isinstance(Batch(**fields), Batch)


def test_the_controller_sends_sampling_params(tmp_path):
    run = load_config(f"{QUICKSTART}:tiny,local", tiny_overrides(tmp_path / "run"))
    trainer = RLTrainer.__new__(RLTrainer)  # only the config is needed to build the arguments
    trainer.config, trainer.global_step, trainer.agent_loop = run, 0, False
    sent = {}

    class _Group:  # records what the batch driver's generate is called with
        def call(self, method, *args, **kwargs):
            sent.update(kwargs, method=method)
            return [None]

    trainer.group = _Group()
    trainer._generate([], run.rollout, seed=0)
    kw = sent
    assert kw["method"] is HostWorker.generate
    r = run.rollout
    assert kw["sampling"] == rollout.SamplingParams(r.temperature, r.top_k, r.top_p)
    assert rollout.SamplingParams.from_config(run.rollout.val).temperature == run.rollout.val.temperature
