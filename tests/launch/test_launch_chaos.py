"""scripts/chaos.py and its kill points (jaxrl_llm/_chaos.py): the plan it prints, the hook's
matching, a kill as a tool call starts, the report failing when a check did not run, and one real
kill-and-resume at a save (the script's other phases run in the full matrix, docs/reliability.md;
the trainer's kill points are tested in tests/trainer/test_trainer_reliability.py and
test_trainer_async.py)."""
import importlib.util
import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from jaxrl_llm import _chaos

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "chaos.py"


def _script():
    spec = importlib.util.spec_from_file_location("chaos_script", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_chaos_dry_run_prints_reference_and_one_start_per_phase_then_the_final_one(tmp_path):
    res = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--phases", "generation,save",
                          "--steps", "3", "--out", str(tmp_path)], capture_output=True, text=True,
                         cwd=ROOT, timeout=120)
    assert res.returncode == 0, res.stderr
    lines = [line[2:] for line in res.stdout.splitlines() if line.startswith("+ ")]
    assert len(lines) == 4
    assert lines[1].startswith("JAXRL_CHAOS_KILL_AT=generation:2 ")
    assert lines[2].startswith("JAXRL_CHAOS_KILL_AT=save:3 ")
    cmds = [shlex.split(line.split(" ", 1)[1] if line.startswith("JAXRL") else line) for line in lines]
    dirs = [next(a for a in c if a.startswith("--config.trainer.default_local_dir=")) for c in cmds]
    assert dirs[0].endswith("/reference") and all(d.endswith("/chaos") for d in dirs[1:])
    assert all("--config.trainer.total_training_steps=3" in c and "--config.trainer.save_freq=1" in c
               and any(a.endswith("length_parity.py") for a in c) for c in cmds)
    assert not (tmp_path / "quickstart").exists()  # a dry run runs nothing


def test_kill_spec_is_phase_and_step_and_a_bad_one_names_the_variable():
    assert _chaos.parse("update:3") == ("update", 3)
    assert _chaos.parse("") is None and _chaos.parse(None) is None
    for bad in ("updat:3", "update", "update:x"):
        with pytest.raises(ValueError, match=f"JAXRL_CHAOS_KILL_AT={bad!r}: expected <phase>:<step>"):
            _chaos.parse(bad)


@pytest.fixture
def kills(monkeypatch):
    """Arms the hook with `arm(phase, step)`; the kills it would do are recorded, not done."""
    got = []
    monkeypatch.setattr(_chaos, "_kill", lambda phase, step: got.append((phase, step)))
    monkeypatch.setattr(_chaos, "_step", 0)
    return lambda phase, step: monkeypatch.setattr(_chaos, "_target", (phase, step)), got


def test_kill_point_fires_at_its_phase_from_its_step_only(kills):
    arm, got = kills
    _chaos.kill_point("update", 5)  # unarmed: nothing
    arm("update", 2)
    _chaos.kill_point("generation", 5)
    _chaos.kill_point("update", 1)
    assert got == []
    _chaos.kill_point("update", 2)
    _chaos.at_step(3)
    _chaos.kill_point("update")  # the step the trainer announced
    assert got == [("update", 2), ("update", 3)]


def test_a_tool_call_reaches_its_kill_point_before_it_runs(kills):
    """The tool agent loop over a scripted server that writes one calculator call."""
    from jaxrl_llm import agent
    from jaxrl_llm.agent.tools import CalculatorTool
    from jaxrl_llm.config import MultiTurnConfig
    from jaxrl_llm.data.tasks import tool_call_text
    from jaxrl_llm.models import CharTokenizer
    from rollout import SamplingParams

    tok = CharTokenizer()

    class Out:
        def __init__(self, text):
            self.token_ids = tok.encode(text) + [tok.eos_token_id]
            self.log_probs = [-0.5] * len(self.token_ids)
            self.finish_reason, self.policy_versions = "stop", [0] * len(self.token_ids)

    class Server:
        turns = [tool_call_text("37*48"), "1776"]

        async def agenerate(self, request_id, prompt_ids, **kw):
            return Out(self.turns.pop(0))

        def release_session(self, session_id):
            pass

    mt = MultiTurnConfig(enable=True, default_agent_loop="tool_agent", max_assistant_turns=0,
                         max_user_turns=0, max_parallel_calls=1, max_tool_response_length=256,
                         tool_response_truncate_side="middle", tool_timeout_s=5.0,
                         tool_memory_limit_gb=4.0, tool_workers=1, tool_config_path="",
                         function_tool_path="", interaction_config_path="", format="hermes",
                         tokenization_sanity_check_mode="strict", sandbox="process")
    runner = agent.AgentRunner(Server(), tok, mt, max_prompt_length=16, max_response_length=256,
                               pad_token_id=0, tools={"calculator": CalculatorTool()}, interactions={})
    sample = agent.AgentSample(raw_prompt=[{"role": "user", "content": "37*48="}], data_source="arithmetic",
                               ground_truth="1776", extra_info={}, agent_name="tool_agent", row=0)
    arm, got = kills
    arm("tool_call", 4)
    _chaos.at_step(4)
    runner.run([sample], sampling=SamplingParams(temperature=0.0), seed=0)
    assert got == [("tool_call", 4)]


def test_the_report_fails_when_a_kill_did_not_land_or_the_weights_did_not_move(tmp_path, monkeypatch):
    """Every start 'finishes' without the kill and the weights never change: "ok" is false and
    each missed check is named (the old script said ok with zero resumes)."""
    chaos = _script()
    monkeypatch.setattr(chaos, "start", lambda cmd, env, log, timeout: (0, "step 1: score=0"))
    monkeypatch.setattr(chaos, "weight_change", lambda run_dir: (1, 3, 0.0))
    monkeypatch.setattr(chaos, "newest_checkpoint", lambda run_dir: 1)
    args = chaos.parse_args(["--phases", "update,save", "--steps", "3", "--out", str(tmp_path)])
    report = chaos.run_case("quickstart", args)
    assert report["ok"] is False
    text = "\n".join(report["problems"])
    assert "weights did not change between checkpoints 1 and 3" in text
    assert "the kill at update (step >= 2) did not land: the run finished" in text
    assert "the kill at save" in text and "did not resume from checkpoint 1" in text
    assert json.dumps(report)  # the report is JSON


def test_one_kill_at_a_save_resumes_and_matches_the_uninterrupted_run(tmp_path):
    """The one real chaos case CI affords: 2 tiny steps, the trainer killed between orbax's
    finalisation of step 2 and its completion marker; the restart resumes from step 1."""
    res = subprocess.run([sys.executable, str(SCRIPT), "--phases", "save", "--steps", "2",
                          "--out", str(tmp_path)], capture_output=True, text=True, cwd=ROOT, timeout=1200)
    report = json.loads(res.stdout)
    assert res.returncode == 0 and report["ok"], report
    assert report["kills"] == [{"phase": "save", "step": 2, "landed": True, "resumed_from": None}]
    assert report["resumes"] == 1  # the final start, from step 1 (step 2 has no marker)
    assert report["weights_moved"]["max_abs_change"] > 0


def test_one_kill_of_the_async_run_resumes_bit_for_bit(tmp_path):
    """The async case (fully async, run-ahead 0.5, trainer.v1.deterministic_schedule) killed by
    kill -9 before the step-2 checkpoint is complete: the restart resumes from step 1 (the
    rollouter's queue and unfinished prompts restored) and equals the uninterrupted run bit for
    bit (weights and metrics; the engine's log-prob rounding aside, see scripts/chaos.py)."""
    res = subprocess.run([sys.executable, str(SCRIPT), "--case", "async", "--phases", "save",
                          "--steps", "2", "--out", str(tmp_path)], capture_output=True, text=True,
                         cwd=ROOT, timeout=1200)
    report = json.loads(res.stdout)
    assert res.returncode == 0 and report["ok"], report
    assert report["exact"] == {"metrics": True, "engine_log_probs": False, "weights": True}
    assert report["kills"] == [{"phase": "save", "step": 2, "landed": True, "resumed_from": None}]
    assert report["resumes"] == 1  # the final start, from step 1 (step 2 has no marker)
    assert report["weights_moved"]["max_abs_change"] > 0


def test_exactness_follows_the_schedule(tmp_path):
    """Bit-exact where the schedule does not depend on timing; the weights only where the
    engine's rounding cannot reach them."""
    chaos = _script()
    async_cfg = f"{ROOT}/configs/quickstart_async.py:tiny,local"
    assert chaos.exactness(f"{ROOT}/configs/quickstart.py:tiny,local", [])["weights"]
    assert chaos.exactness(async_cfg, []) == {"metrics": False, "engine_log_probs": False, "weights": False}
    on = ["--config.trainer.v1.deterministic_schedule=True"]
    assert chaos.exactness(async_cfg, on) == {"metrics": True, "engine_log_probs": False, "weights": False}
    off = on + ["--config.algorithm.rollout_correction.rollout_is="]
    assert chaos.exactness(async_cfg, off)["weights"]
    assert chaos._close(1.0, 1.0 + 1e-9, "actor/pg_loss") and not chaos._close(
        1.0, 1.0 + 1e-9, "actor/pg_loss", {"metrics": True})
    assert chaos._close(1.0, 1.0 + 1e-9, "rollout/probs_diff/mean", {"metrics": True})
