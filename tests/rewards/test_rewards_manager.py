"""RewardManager: batch scoring; a raising, hanging, dying or ill-typed scorer scores 0 and is
counted, later batches still work; custom reward functions load by path."""
import textwrap

import numpy as np
import pytest

from jaxrl_llm.rewards import RewardFunctionError, RewardManager, load_custom_reward_fn

CUSTOM = textwrap.dedent('''
    import os
    import time

    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        if solution_str == "raise":
            raise RuntimeError("scorer bug")
        if solution_str == "hang":
            time.sleep(600)
        if solution_str == "exit":
            os._exit(3)
        if solution_str == "bad":
            return "not a number"
        if solution_str == "dict":
            return {"score": 0.5, "acc": 1.0, "note": "ignored"}
        if solution_str == "echo":
            return float(extra_info["w"]) + (data_source == "mine")
        return float(solution_str == ground_truth)
''')


@pytest.fixture
def custom_fn(tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text(CUSTOM)
    return load_custom_reward_fn(path, "compute_score")


@pytest.mark.parametrize("num_workers", [0, 2])
def test_builtin_scorers_by_data_source(num_workers):
    with RewardManager(num_workers=num_workers, timeout_s=30.0) as manager:
        scores, extra, metrics = manager.score_batch(
            ["openai/gsm8k", "math", "arithmetic", "arithmetic", "countdown"],
            ["#### 1,000", r"\boxed{\dfrac12}", "7", "8", "<answer>(1+2)*3</answer>"],
            ["1000", "0.5", "7", "7",  # numpy values (parquet rows) reach the workers as JSON
             {"target": np.int64(9), "numbers": np.array([1, 2, 3])}],
            [{}, {}, {}, {}, {}])
    assert scores.dtype == np.float32
    assert scores.tolist() == [1.0, 1.0, 1.0, 0.0, 1.0]
    assert extra == {} and metrics == {"reward/num_errors": 0.0, "reward/num_timeouts": 0.0}


def test_custom_fn_by_path_gets_verl_arguments(custom_fn):
    assert custom_fn("mine", "echo", "x", {"w": 2}) == 3.0
    with RewardManager(num_workers=0, custom_fn=custom_fn) as manager:
        scores, extra, _ = manager.score_batch(["mine", "other", "any"], ["echo", "echo", "dict"],
                                               ["", "", ""], [{"w": 2}, {"w": 2}, None])
    assert scores.tolist() == [3.0, 2.0, 0.5]
    assert extra["acc"].tolist() == [0.0, 0.0, 1.0] and set(extra) == {"acc"}


def test_pool_survives_raising_hanging_dying_and_bad_scorers(custom_fn):
    sols = ["a", "raise", "hang", "dict", "b", "bad", "exit", "c"]
    truths = ["a", "", "", "", "x", "", "", "c"]
    with RewardManager(num_workers=2, timeout_s=1.0, custom_fn=custom_fn) as manager:
        scores, extra, metrics = manager.score_batch(["s"] * 8, sols, truths, [None] * 8)
        assert scores.tolist() == [1.0, 0.0, 0.0, 0.5, 0.0, 0.0, 0.0, 1.0]
        assert extra["acc"].tolist() == [0, 0, 0, 1, 0, 0, 0, 0]
        assert metrics == {"reward/num_errors": 3.0, "reward/num_timeouts": 1.0}
        # The hung and the dead workers were replaced: the next batch scores normally.
        scores, _, metrics = manager.score_batch(["s"] * 3, ["a", "b", "raise"],
                                                 ["a", "b", ""], None)
        assert scores.tolist() == [1.0, 1.0, 0.0]
        assert metrics == {"reward/num_errors": 1.0, "reward/num_timeouts": 0.0}


def test_in_process_mode_counts_errors(custom_fn):
    with RewardManager(num_workers=0, custom_fn=custom_fn) as manager:
        scores, _, metrics = manager.score_batch(["s"] * 3, ["a", "raise", "bad"], ["a", "", ""])
    assert scores.tolist() == [1.0, 0.0, 0.0] and metrics["reward/num_errors"] == 2.0


def test_config_errors_raise_before_scoring(tmp_path, custom_fn):
    manager = RewardManager(num_workers=0)
    with pytest.raises(ValueError, match="data_source 'nope'"):
        manager.score_batch(["nope"], ["1"], ["1"], [None])
    with pytest.raises(ValueError, match="equal lengths"):
        manager.score_batch(["arithmetic"], ["1", "2"], ["1"], [None])
    with pytest.raises(FileNotFoundError, match="missing.py"):
        load_custom_reward_fn(tmp_path / "missing.py", "compute_score")
    with pytest.raises(AttributeError, match="no function 'other'"):
        load_custom_reward_fn(custom_fn.path, "other")


HOSTILE = textwrap.dedent('''
    import os
    import time

    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        if solution_str == "huge":
            return 1e39  # finite in float64, inf in the float32 batch
        if solution_str == "hang":
            time.sleep(600)
        if solution_str == "exit":
            os._exit(1)
        if solution_str == "alloc":
            return float(len(bytearray(20 * 2**30)))
        return 1.0
''')


@pytest.fixture
def hostile_fn(tmp_path):
    path = tmp_path / "hostile.py"
    path.write_text(HOSTILE)
    return load_custom_reward_fn(path, "compute_score")


def test_a_score_that_overflows_float32_is_a_scorer_error(hostile_fn):
    with RewardManager(num_workers=0, custom_fn=hostile_fn) as manager:
        scores, _, metrics = manager.score_batch(["s"] * 2, ["huge", "ok"], ["", ""])
    assert np.isfinite(scores).all() and scores.tolist() == [0.0, 1.0]
    assert metrics["reward/num_errors"] == 1.0


def test_custom_fn_is_isolated_even_with_num_workers_0(hostile_fn):
    """Under the quickstart's num_workers=0 a custom scorer that hangs, exits or allocates 20 GB
    costs its row, not the trainer."""
    with RewardManager(num_workers=0, timeout_s=2.0, custom_fn=hostile_fn,
                       memory_limit_gb=2.0) as manager:
        scores, _, metrics = manager.score_batch(["s"] * 4, ["hang", "exit", "alloc", "ok"], [""] * 4)
    assert scores.tolist() == [0.0, 0.0, 0.0, 1.0]
    assert metrics == {"reward/num_errors": 2.0, "reward/num_timeouts": 1.0}


def test_circuit_breaker_names_the_function_and_first_error(hostile_fn):
    with RewardManager(num_workers=0, custom_fn=hostile_fn, max_error_fraction=0.5) as manager:
        manager.score_batch(["s"] * 2, ["huge", "ok"], ["", ""])  # 1 of 2: not more than half
        with pytest.raises(RewardFunctionError, match=r"3 of 4 .*hostile\.py.*compute_score.*row 0.*1e\+39"):
            manager.score_batch(["s"] * 4, ["huge", "huge", "ok", "huge"], [""] * 4)


def test_consecutive_timeouts_fail_fast(hostile_fn):
    with RewardManager(num_workers=2, timeout_s=0.5, custom_fn=hostile_fn,
                       max_consecutive_timeouts=2) as manager:
        with pytest.raises(RewardFunctionError, match="timed out 2 times in a row"):
            manager.score_batch(["s"] * 40, ["hang"] * 40, [""] * 40)


def test_reward_workers_that_keep_dying_stop_the_run_naming_function_and_exit_codes(hostile_fn):
    with RewardManager(num_workers=1, timeout_s=30.0, custom_fn=hostile_fn,
                       max_consecutive_worker_deaths=3) as manager:
        scores, _, _ = manager.score_batch(["s"] * 3, ["exit", "exit", "ok"], [""] * 3)
        assert scores.tolist() == [0.0, 0.0, 1.0]  # two deaths, then a score resets the count
        with pytest.raises(RewardFunctionError, match=r"hostile\.py.*compute_score.*died 3 "
                                                      r"times in a row.*exit codes \[1, 1, 1\]"):
            manager.score_batch(["s"] * 20, ["exit"] * 20, [""] * 20)
        # the third death in a row ends the batch: the last worker of batch 1 and two more
        assert manager._pool.num_started == 3 + 2


SECRET_FN = textwrap.dedent('''
    import os

    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        print("a print does not disturb the worker's replies", flush=True)
        return {"score": float(os.environ.get("JAXRL_TEST_SECRET", "") == "hunter2"),
                "home_is_scratch": float(os.environ["HOME"] == os.getcwd())}
''')


def test_a_reward_worker_does_not_see_the_trainers_secrets(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXRL_TEST_SECRET", "hunter2")
    path = tmp_path / "secret_reward.py"
    path.write_text(SECRET_FN)
    with RewardManager(num_workers=1, custom_fn=load_custom_reward_fn(path)) as manager:
        scores, extra, _ = manager.score_batch(["s"], ["x"], [""])
    assert scores.tolist() == [0.0] and extra["home_is_scratch"].tolist() == [1.0]


def test_a_reply_the_worker_would_not_send_is_rejected_not_trusted():
    from jaxrl_llm.rewards._pool import _outcome
    assert _outcome({"ok": True, "score": 1, "extras": {"acc": 0.5, "note": "x"}}) == (
        "ok", 1.0, {"acc": 0.5})
    assert _outcome({"ok": False, "error": "E: bad"}) == ("error", "E: bad", None)
    for reply in ({"ok": True, "score": float("nan"), "extras": {}},  # JSON can carry NaN
                  {"ok": True, "score": 1e39, "extras": {}},
                  {"ok": True, "score": "1", "extras": {}},
                  {"ok": True, "score": 1.0}, {"ok": "yes", "score": 1.0, "extras": {}},
                  {"ok": False, "error": 3}, {}):
        assert _outcome(reply) is None, reply
