"""Kill-and-resume in the modes other tests leave out: one-step-off policy (a rollout in flight
at the checkpoint) and DAPO's dynamic sampling in an async mode (evicted groups, prompts fed
ahead). Each run checkpoints every step; resuming from step 2 must give step 3 exactly as the
uninterrupted run had it: the same rows, tokens, rewards and losses."""
import json
import os
import re

import pytest

from jaxrl_llm.config import load_config
from jaxrl_llm.trainer import RLTrainer
from trainer_helpers import QUICKSTART, tiny_overrides

_RESUMABLE = {"trainer.total_training_steps": 3, "trainer.save_freq": 1, "trainer.max_to_keep": 3,
              "trainer.test_freq": 0, "trainer.val_before_train": False, "trainer.export_hf": False,
              "data.builtin_val_size": 0, "trainer.backend": "local"}
# what a run measures about itself (wall time, memory, queue fill) rather than what it trained
_NOT_COMPARED = ("timing_s/", "timing_per_token_ms/", "perf/", "fully_async/trainer", "fully_async/rollouter",
                 "fully_async/queue_size", "rollout/sync_time_s", "rollout/sync_wait_s",
                 "rollout/sync_pause_wait_s", "rollout/sync_held_requests", "colocate_async/held_groups")


def _rows(run_dir):
    return [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]


def _resume_repeats_step_3(tmp_path, config=f"{QUICKSTART}:tiny", **extra):
    """Runs 3 steps, resumes from step 2's checkpoint, and checks step 3 against the first run;
    returns the first run's rows."""
    run_dir = tmp_path / "run"
    load = lambda **x: load_config(config,  # noqa: E731
                                   tiny_overrides(run_dir, **{**_RESUMABLE, **extra, **x}))
    RLTrainer(load()).fit()
    first = _rows(run_dir)
    RLTrainer(load(**{"trainer.resume_mode": str(run_dir / "checkpoints" / "2")})).fit()
    again = _rows(run_dir)
    assert [r["training/global_step"] for r in again] == [1, 2, 3]
    compared = 0
    for key, value in first[2].items():
        # a duration (`..._s`, `..._s/mean`) differs between any two runs
        if not key.startswith(_NOT_COMPARED) and not re.search(r"_s(/|$)", key) and isinstance(value, float):
            assert key in again[2], key
            assert again[2][key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
            compared += 1
    assert compared > 40
    return first


def test_one_step_off_resume_repeats_the_next_step(tmp_path):
    """At the step-2 checkpoint step 3's rollout is in flight, generated with the weights before
    step 2's update; the resumed run must train step 3 on that same rollout."""
    first = _resume_repeats_step_3(tmp_path, **{
        "mesh.fsdp": 4, "placement.mode": "separate", "placement.rollout_mesh.tensor": 4,
        "model.init.num_key_value_heads": 4, "data.max_response_length": 24,
        "trainer.v1.trainer_mode": "separate_async", "trainer.v1.colocate_async.num_warmup_batches": 1.0,
        "trainer.v1.sampler.max_off_policy_threshold": 1})
    assert [r["rollout/off_policy_steps"] for r in first] == [0.0, 1.0, 1.0]
    meta = json.load(open(tmp_path / "run" / "checkpoints" / "2" / "meta" / "metadata"))
    assert set(meta["one_step_off"]["rollout"]) == {"arrays", "fields"}  # step 3's rollout, saved


_DAPO = {"algorithm.filter_groups.enable": True, "algorithm.filter_groups.metric": "acc",
         "algorithm.filter_groups.max_num_gen_batches": 4}


@pytest.mark.parametrize("mode", ["colocate_async", "separate_async"])
def test_dapo_filter_in_an_async_mode_resume_repeats_the_next_step(tmp_path, mode):
    """DAPO's dynamic sampling in the rollouter: groups are evicted and prompts fed ahead for
    them; the checkpoint keeps the queue, the unfinished prompts and the eviction counters, so
    the resumed step 3 trains the same groups and counts the same filtered groups."""
    if mode == "colocate_async":  # no warm-up batch: the rollouter starts only what is fed
        extra = {"trainer.v1.trainer_mode": mode, "trainer.v1.colocate_async.num_warmup_batches": 0.0}
    else:  # staleness 0: the rollouter pipeline, each step's groups generated with its weights
        extra = {"mesh.fsdp": 4, "placement.mode": "separate", "placement.rollout_mesh.tensor": 4,
                 "model.init.num_key_value_heads": 4, "data.train_batch_size": 4,
                 "actor.ppo_mini_batch_size": 4, "trainer.v1.trainer_mode": mode,
                 "trainer.v1.colocate_async.num_warmup_batches": 0.0,
                 "trainer.v1.sampler.max_off_policy_threshold": 0}
    first = _resume_repeats_step_3(tmp_path, **_DAPO, **extra)
    assert sum(r["filter_groups/filtered_groups"] for r in first) > 0  # the filter evicted groups


def test_colocate_async_with_the_agent_loop_resume_repeats_the_next_step(tmp_path):
    """The tools config's multi-turn agent loops under the colocated rollouter (no warm-up batch,
    so nothing is held over a step): step 3 redone from the step-2 checkpoint equals the
    uninterrupted one, turns and tool calls included."""
    tools = os.path.join(os.path.dirname(QUICKSTART), "quickstart_tools.py")
    first = _resume_repeats_step_3(tmp_path, f"{tools}:tiny,local", **{
        "trainer.v1.trainer_mode": "colocate_async", "trainer.v1.colocate_async.num_warmup_batches": 0.0,
        "sft.steps": 0, "data.val_files": "[]"})
    assert all(r["num_turns/min"] >= 1 for r in first)
