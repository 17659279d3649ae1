"""Hostile model-written code through the agent loop: a scripted model calls the `python` tool
with code that reads a file outside, reads the parent's environment, connects to 127.0.0.1,
forks 1,000 processes, writes outside, sleeps forever and allocates 8 GB. Under the `bwrap`
sandbox each is contained and reported as a tool error (in the tool message and in
`tool_errors`) while the loop goes on to the next turn; the `process` backend is checked for
what it does contain and for what docs/agents.md says it does not.

Without a working bwrap the bwrap tests skip, except under CI (env CI set), where they fail."""
import json
import logging
import os
import secrets
import shutil
import socket
import subprocess
import sys

import pytest

from jaxrl_llm import agent
from jaxrl_llm.agent.tools import PythonTool, load_tools
from jaxrl_llm.config import ConfigError, load_config
from jaxrl_llm.sandbox import Limits, SandboxError, make_sandbox
from jaxrl_llm.sandbox import _sandbox
from rollout import SamplingParams

from agent_helpers import ScriptedServer
from test_agent_loop import multi_turn
from test_agent_tools import _wait_for_exit

SECRET_VAR = "JAXRL_SANDBOX_TEST_SECRET"
CONFIG = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "quickstart_tools.py")


@pytest.fixture
def bwrap_works():
    path = shutil.which("bwrap")
    why = _sandbox._probe_bwrap(path) if path else "bwrap is not installed"
    if why and os.environ.get("CI", "").lower() not in ("", "0", "false", "no"):
        pytest.fail(f"CI must run the bwrap sandbox tests, but bwrap cannot run here: {why}")
    if why:
        pytest.skip(f"bwrap cannot run here: {why}")


def python_call(code: str) -> str:
    body = json.dumps({"name": "python", "arguments": {"code": code}}, separators=(",", ":"))
    return f"<tool_call>{body}</tool_call>"


def run_calls(tok, codes, kind, **config):
    """One trajectory: a python call per code, then "done". (tool messages, output, server)."""
    tool = PythonTool(config={"timeout_s": 2, "memory_mb": 512, "max_processes": 64, **config},
                      sandbox=kind)
    server = ScriptedServer(tok, {0: [python_call(c) for c in codes] + ["done"]})
    runner = agent.AgentRunner(server, tok, multi_turn(tool_timeout_s=60,
                                                       max_tool_response_length=2000),
                               max_prompt_length=16, max_response_length=60000, pad_token_id=0,
                               tools={"python": tool}, interactions={})
    sample = agent.AgentSample(raw_prompt=[{"role": "user", "content": "hi"}],
                               data_source="x", ground_truth="", extra_info={},
                               agent_name="tool_agent", row=0)
    out = runner.run([sample], sampling=SamplingParams(temperature=0.0), seed=0)
    text = tok.decode(server.requests[-1]["prompt_ids"], skip_special_tokens=False)
    messages = [part.split("<assistant>")[0] for part in text.split("<tool>")[1:]]
    assert len(messages) == len(codes) and len(server.requests) == len(codes) + 1
    return messages, out


@pytest.fixture
def decoy(monkeypatch):
    """A secret in this process's os.environ and in the environment block of another process of
    this user (what /proc/<pid>/environ of the trainer shows)."""
    value = "s3cr3t" + secrets.token_hex(8)
    monkeypatch.setenv(SECRET_VAR, value)
    proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                            stdin=subprocess.PIPE, env={**os.environ, SECRET_VAR: value})
    yield value, proc.pid
    proc.stdin.close()
    proc.wait()


def hostile_codes(tmp_path, decoy_pid, port):
    secret_file, target = tmp_path / "secret.txt", tmp_path / "pwned.txt"
    secret_file.write_text("TOPSECRET-FILE")
    return secret_file, target, {
        "read_outside": f"print(open({str(secret_file)!r}).read())",
        "parent_environ": (
            "import os\n"
            f"pids = [{decoy_pid}, {os.getpid()}, os.getppid()] + [int(d) for d in "
            "os.listdir('/proc') if d.isdigit()]\n"
            "seen = [v for k, v in os.environ.items() if k == " + repr(SECRET_VAR) + "]\n"
            "for pid in pids:\n"
            "    try:\n"
            "        seen.append(open(f'/proc/{pid}/environ', 'rb').read().decode())\n"
            "    except OSError:\n"
            "        pass\n"
            "seen = [x for s in seen for x in s.split(chr(0)) if 's3cr3t' in x]\n"
            "if not seen:\n"
            "    raise SystemExit('no secret visible')\n"
            "print(seen)"),
        "connect_loopback": (
            "import socket\n"
            f"s = socket.create_connection(('127.0.0.1', {port}), timeout=2)\n"
            "s.sendall(b'hello')\nprint('connected')"),
        "fork_1000": (
            "import os, time\n"
            "for i in range(1000):\n"
            "    if os.fork() == 0:\n"
            "        time.sleep(600)\n"
            "        os._exit(0)\n"
            "print('forked 1000')"),
        "write_outside": f"open({str(target)!r}, 'w').write('pwned')\nprint('written')",
        "sleep_forever": "import time\ntime.sleep(10 ** 6)",
        "allocate_8gb": "b = bytearray(8 << 30)\nprint('allocated', len(b))",
    }


@pytest.fixture
def listener():
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen()
    srv.setblocking(False)
    yield srv
    srv.close()


def test_bwrap_contains_all_seven_hostile_snippets_and_reports_each_as_a_tool_error(
        char_tok, tmp_path, decoy, listener, bwrap_works):
    value, decoy_pid = decoy
    secret_file, target, codes = hostile_codes(tmp_path, decoy_pid, listener.getsockname()[1])
    messages, out = run_calls(char_tok, list(codes.values()), "bwrap")
    got = dict(zip(codes, messages))
    for name, message in got.items():
        assert message.startswith("Error: "), (name, message)
    assert "TOPSECRET" not in got["read_outside"] and "FileNotFoundError" in got["read_outside"]
    assert value not in got["parent_environ"] and "no secret visible" in got["parent_environ"]
    assert "connected" not in got["connect_loopback"]
    with pytest.raises(BlockingIOError):  # nobody knocked
        listener.accept()
    assert got["fork_1000"].startswith("Error: process limit reached (64 processes)")
    assert "forked 1000" not in got["fork_1000"]
    assert not target.exists() and "written" not in got["write_outside"]
    assert got["sleep_forever"].startswith("Error: timed out after 2 s")
    assert got["allocate_8gb"].startswith("Error: memory limit exceeded (512 MB)")
    # every failure is a tool error, and the model got its next turn after each
    assert out["metrics"]["tool_errors/total"] == 7.0 and out["metrics"]["tool_calls/mean"] == 7.0
    assert out["num_turns"].tolist() == [16] and out["turn_texts"][0][-1] == "done"
    assert subprocess.run(["true"]).returncode == 0  # the host still forks


def test_bwrap_code_still_runs_normally_in_its_scratch_dir(char_tok, bwrap_works):
    code = ("import os, numpy\nopen('f.txt', 'w').write('ok')\n"
            "print(open('f.txt').read(), os.getcwd() == os.environ['HOME'], numpy.arange(3).sum())")
    messages, out = run_calls(char_tok, [code], "bwrap")
    assert messages == ["ok True 3\n"] and out["metrics"]["tool_errors/total"] == 0.0


def test_bwrap_wrap_binds_ro_paths_read_only_and_nothing_else_of_the_tree(tmp_path, bwrap_works):
    shared, hidden, scratch = tmp_path / "shared.txt", tmp_path / "hidden.txt", tmp_path / "s"
    shared.write_text("visible")
    hidden.write_text("hidden")
    scratch.mkdir()
    code = (f"print(open({str(shared)!r}).read())\n"
            f"import os\nprint(os.path.exists({str(hidden)!r}))\n"
            f"try:\n    open({str(shared)!r}, 'w')\nexcept OSError as e:\n    print(e.errno)")
    argv, env = make_sandbox("bwrap").wrap([sys.executable, "-I", "-c", code], scratch=str(scratch),
                                          limits=Limits(cpu_s=10), ro_paths=[str(shared)])
    done = subprocess.run(argv, env=env, cwd=scratch, capture_output=True, text=True, timeout=60)
    assert done.stdout.split() == ["visible", "False", "30"], done.stderr  # 30: EROFS
    assert shared.read_text() == "visible"


def test_process_backend_scrubs_the_environment_and_limits_memory_and_time(char_tok, tmp_path,
                                                                          decoy):
    value, _ = decoy
    env_code = f"import os\nprint(os.environ.get({SECRET_VAR!r}, 'absent'), sorted(os.environ))"
    codes = [env_code, "b = bytearray(8 << 30)", "import time\ntime.sleep(10 ** 6)"]
    messages, out = run_calls(char_tok, codes, "process")
    assert messages[0].startswith("absent") and value not in messages[0]
    assert messages[1].startswith("Error: memory limit exceeded (512 MB)")
    assert messages[2].startswith("Error: timed out after 2 s")
    assert out["metrics"]["tool_errors/total"] == 2.0


def test_process_backend_does_not_contain_files_or_other_processes_environ(char_tok, tmp_path,
                                                                         decoy, listener):
    """What docs/agents.md lists as NOT contained by `process` really is not."""
    value, decoy_pid = decoy
    secret_file, target, codes = hostile_codes(tmp_path, decoy_pid, listener.getsockname()[1])
    names = ["read_outside", "parent_environ", "connect_loopback", "write_outside"]
    messages, _ = run_calls(char_tok, [codes[n] for n in names], "process")
    got = dict(zip(names, messages))
    assert got["read_outside"].startswith("TOPSECRET-FILE")
    assert value in got["parent_environ"]
    assert got["connect_loopback"].startswith("connected") and listener.accept()
    assert target.read_text() == "pwned"


def test_python_tool_failures_count_as_tool_errors(char_tok):
    codes = ["print(1)", "raise SystemExit(3)", "import os\nos.kill(os.getpid(), 9)"]
    messages, out = run_calls(char_tok, codes, "process")
    assert messages[0] == "1\n" and messages[1].startswith("Error: exit code 3")
    assert messages[2].startswith("Error: killed by SIGKILL")
    assert out["metrics"]["tool_errors/total"] == 2.0


def test_auto_falls_back_to_process_with_one_warning_when_bwrap_is_missing(monkeypatch, caplog):
    monkeypatch.setattr(_sandbox.shutil, "which", lambda name: None)
    monkeypatch.setattr(_sandbox, "_warned", [])
    with caplog.at_level(logging.WARNING, logger="jaxrl_llm.sandbox._sandbox"):
        boxes = [make_sandbox("auto"), make_sandbox("auto")]
    assert [b.name for b in boxes] == ["process", "process"] and not boxes[0].contained
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "bwrap is not installed" in warnings[0]
    assert "NOT contained" in warnings[0] and "network" in warnings[0]
    with pytest.raises(SandboxError, match="install bubblewrap"):
        make_sandbox("bwrap")
    mt = load_config(CONFIG, ["rollout.multi_turn.sandbox=bwrap"]).rollout.multi_turn
    with pytest.raises(SandboxError, match=r"^rollout.multi_turn.sandbox='bwrap': .*bwrap is not "
                                           r"installed.*apt-get install bubblewrap"):
        agent.load_agent_resources(mt)


def test_sandbox_config_field_is_checked_and_reaches_the_python_tool(tmp_path):
    with pytest.raises(ConfigError, match="rollout.multi_turn.sandbox='jail'"):
        load_config(CONFIG, ["rollout.multi_turn.sandbox=jail"])
    path = tmp_path / "tools.json"
    path.write_text(json.dumps({"tools": [{"class_name": "python"}]}))
    mt = load_config(CONFIG, [f"rollout.multi_turn.tool_config_path={path}",
                              "rollout.multi_turn.sandbox=process"]).rollout.multi_turn
    tools, _, pools = agent.load_agent_resources(mt)
    assert tools["python"].sandbox.name == "process" and pools == []
    assert load_tools(path, sandbox="process")["python"].sandbox.name == "process"


def test_bwrap_private_tmp_is_capped_at_the_file_size_limit(tmp_path, bwrap_works):
    """/tmp inside is memory of the host: many files under the per-file limit must not fill it."""
    code = ("import os\nfor i in range(8):\n    try:\n"
            "        open(f'/tmp/f{i}', 'wb').write(b'x' * (8 << 20))\n"
            "    except OSError as e:\n        print(i, e.errno)\n        break")
    argv, env = make_sandbox("bwrap").wrap([sys.executable, "-I", "-c", code],
                                          scratch=str(tmp_path), limits=Limits(cpu_s=10, fsize_mb=20))
    done = subprocess.run(argv, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert done.stdout.split() == ["2", "28"], done.stderr  # 28: ENOSPC after 16 of 20 MB


def test_bwrap_kills_a_background_child_that_outlives_the_snippet_in_its_own_session(char_tok,
                                                                                     bwrap_works):
    """Every process of the call dies with it (its PID namespace ends), setsid() or not."""
    marker = "sandboxed_sleeper_" + secrets.token_hex(6)
    code = ("import subprocess, sys\n"
            f"subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)', {marker!r}],"
            " start_new_session=True)\nprint('spawned')")
    messages, _ = run_calls(char_tok, [code], "bwrap")
    assert messages == ["spawned\n"]
    left = []
    for pid in (p for p in os.listdir("/proc") if p.isdigit()):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if marker.encode() in f.read():
                    left.append(int(pid))
        except OSError:
            pass
    assert all(_wait_for_exit(pid) for pid in left)  # within 10 s, not 600
