"""colocate_async (`trainer.v1.trainer_mode`): the rollouter on the training devices. Warm-up
batches are generating before a step asks for them, the unfinished requests are held over the
update and the weight sync and resume with their tokens (partial rollout), with and without the
agent loop; a checkpoint resumes to the same next step's prompts."""
import json
import os

import numpy as np
import pytest

from jaxrl_llm.config import load_config
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
        assert m["fully_async/staleness/max"] <= run.trainer.v1.sampler.max_off_policy_threshold
    assert versions >= 2
    assert steps[1]["rollout/policy_version"] == steps[0]["rollout/policy_version"] + 1


def test_colocate_async_with_the_agent_loop_fits_and_resumes_the_next_step(tmp_path):
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
