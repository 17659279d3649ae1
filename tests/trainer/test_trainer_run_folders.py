"""Run folders, data files and the trainer's start-up: a quickstart variant never reuses another's
folder; generated data lives under the run folder and a user's file is only ever read; a missing
file is an error before anything is written; the run writes config.json and says in one line
what it uses. The trainer is built with a stand-in worker group: no model, no learning run."""
import hashlib
import json
import logging
import os

import pyarrow.parquet as pq
import pytest

from jaxrl_llm.config import ConfigError, load_config
from jaxrl_llm.data import tasks
from jaxrl_llm.trainer import _rl
from jaxrl_llm.trainer._rl import prepare_builtin_data
from jaxrl_llm.trainer._startup import tool_names
from trainer_helpers import QUICKSTART, ROOT, tiny_overrides

TOOLS = os.path.join(ROOT, "configs", "quickstart_tools.py")


def _cfg(name, variant=None, overrides=()):
    path = os.path.join(ROOT, "configs", name)
    return load_config(f"{path}:{variant}" if variant else path, list(overrides))


class _NoWorkers:
    """Stands in for the worker group: the trainer's start-up runs, nothing is trained."""

    def call(self, method, *args, **kwargs):
        return [{}]

    def shutdown(self):
        pass


@pytest.fixture
def start(monkeypatch):
    """start(config) -> an RLTrainer whose start-up ran (data, reward, logs) without workers."""
    monkeypatch.setattr(_rl, "make_group", lambda *a, **k: _NoWorkers())
    made = []

    def make(config):
        made.append(_rl.RLTrainer(config))
        return made[-1]
    yield make
    for trainer in made:
        trainer.close()


def _user_parquet(path, n=8):
    tasks.make_arithmetic_dataset(path, n, seed=123, max_operand=20)
    return path


def _digest(path):
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def _files_under(folder):
    return sorted(os.path.relpath(os.path.join(d, f), folder) for d, _, fs in os.walk(folder) for f in fs)


def test_each_quickstart_variant_size_has_its_own_run_folder_and_data():
    for name in ("quickstart.py", "quickstart_tools.py", "quickstart_async.py"):
        main, tiny = _cfg(name), _cfg(name, "tiny")
        assert tiny.trainer.default_local_dir != main.trainer.default_local_dir
        for run in (main, tiny):  # no paths of their own: the built-in task's files go in the run folder
            assert run.data.builtin_task and run.data.train_files == run.data.val_files == (), name
        # `local` changes only where the workers run: the same run
        assert _cfg(name, "local").trainer.default_local_dir == main.trainer.default_local_dir


def test_builtin_data_lives_under_the_run_folder_and_other_settings_get_other_files(tmp_path):
    small = _cfg("quickstart.py", "tiny", [f"trainer.default_local_dir={tmp_path}"])
    files = prepare_builtin_data(small)
    assert files.generated == ("train", "val")
    assert all(p.startswith(f"{tmp_path}/data/builtin/arithmetic-") for p in files.train + files.val)
    assert pq.read_table(files.train[0]).num_rows == small.data.builtin_train_size
    mtime = os.path.getmtime(files.train[0])
    assert prepare_builtin_data(small) == files  # same settings: the same files, kept
    assert os.path.getmtime(files.train[0]) == mtime
    bigger = _cfg("quickstart.py", "tiny", [f"trainer.default_local_dir={tmp_path}", "data.builtin_train_size=96"])
    other = prepare_builtin_data(bigger)
    assert other.train != files.train and pq.read_table(other.train[0]).num_rows == 96
    assert os.path.getmtime(files.train[0]) == mtime  # the first settings' files are left alone


def test_user_train_file_is_read_as_is_and_never_written(tmp_path, start, caplog):
    """builtin_task is set (as in every quickstart config), train_files is the user's: the file
    stays byte-identical, nothing appears beside it, the run reads its 8 rows, and only the
    empty val split is generated (in the run folder)."""
    user = _user_parquet(tmp_path / "mine" / "train.parquet")
    before = _digest(user)
    config = load_config(f"{QUICKSTART}:tiny,local", tiny_overrides(tmp_path / "run", **{"data.train_files": user}))
    with caplog.at_level(logging.INFO, logger=_rl.__name__):
        trainer = start(config)
    assert _digest(user) == before and os.listdir(tmp_path / "mine") == ["train.parquet"]
    assert trainer.train_set.num_rows == 8 and trainer.data_files.train == (str(user),)
    assert trainer.data_files.generated == ("val",)
    assert trainer.data_files.val[0].startswith(f"{tmp_path}/run/data/builtin/")
    line = [r.getMessage() for r in caplog.records if r.getMessage().startswith("run data:")]
    assert len(line) == 1, caplog.text
    assert f"train: {user} (8 rows);" in line[0]
    assert f"val: {trainer.data_files.val[0]} (16 rows, built-in arithmetic, generated)" in line[0]
    assert "reward: " + os.path.join(ROOT, "tests", "fixtures", "rewards", "length_parity.py") in line[0]
    assert "tools: none | agent loops: none" in line[0]
    assert f"| sft warm start: {config.sft.steps} steps on built-in arithmetic demonstrations |" in line[0]


def test_given_val_file_is_used_and_no_split_is_generated(tmp_path, start, caplog):
    train, val = _user_parquet(tmp_path / "t.parquet"), _user_parquet(tmp_path / "v.jsonl", n=5)
    config = load_config(f"{QUICKSTART}:tiny,local", tiny_overrides(
        tmp_path / "run", **{"data.train_files": train, "data.val_files": val, "sft.steps": 0}))
    with caplog.at_level(logging.INFO, logger=_rl.__name__):
        trainer = start(config)
    assert "| sft warm start: none |" in caplog.text
    assert trainer.val_set.num_rows == 5 and trainer.data_files.generated == ()
    assert not (tmp_path / "run" / "data").exists()


@pytest.mark.parametrize("field", ["data.train_files", "data.val_files", "sft.train_files"])
def test_missing_data_file_is_an_error_naming_the_field_before_anything_is_written(tmp_path, start, field):
    user = _user_parquet(tmp_path / "train.parquet")
    over = {"data.train_files": user, "sft.steps": 2, field: repr((str(user), f"{tmp_path}/trian.parquet"))}
    config = load_config(f"{QUICKSTART}:tiny,local", tiny_overrides(tmp_path / "run", **over))
    with pytest.raises(ConfigError, match=rf"^{field}\[1\]={tmp_path}/trian.parquet does not exist"):
        start(config)
    assert not (tmp_path / "run").exists() and not (tmp_path / "trian.parquet").exists()
    assert _files_under(tmp_path) == ["train.parquet"]
    config = load_config(f"{QUICKSTART}:tiny,local", tiny_overrides(tmp_path / "run", **{field: tmp_path, "sft.steps": 2}))
    with pytest.raises(ConfigError, match=rf"^{field}\[0\]={tmp_path} is a folder"):
        start(config)


@pytest.mark.parametrize("field", ["reward.custom_reward_function.path", "rollout.multi_turn.tool_config_path",
                                   "rollout.multi_turn.function_tool_path"])
def test_missing_reward_or_tool_file_is_an_error_naming_the_field(tmp_path, start, field):
    config = load_config(f"{TOOLS}:tiny,local", tiny_overrides(tmp_path / "run", **{field: f"{tmp_path}/nope.py"}))
    with pytest.raises(ConfigError, match=rf"^{field}={tmp_path}/nope.py is not a file"):
        start(config)
    assert not (tmp_path / "run").exists()


def test_start_writes_the_resolved_config_json(tmp_path, start):
    config = load_config(f"{QUICKSTART}:tiny,local", tiny_overrides(tmp_path / "run", **{"actor.optim.lr": 0.0025}))
    start(config)
    saved = json.loads((tmp_path / "run" / "config.json").read_text())
    assert saved["actor"]["optim"]["lr"] == 0.0025 and saved["data"]["builtin_task"] == "arithmetic"
    assert saved["trainer"]["default_local_dir"] == str(tmp_path / "run")
    assert saved["data"]["train_files"] == [] and saved["sft"]["steps"] == config.sft.steps
    start(config)  # a restart replaces it whole, still readable
    assert json.loads((tmp_path / "run" / "config.json").read_text()) == saved
    assert not [f for f in os.listdir(tmp_path / "run") if f.startswith(".tmp")]


def test_start_line_names_the_tools_and_agent_loops(tmp_path, start, caplog):
    config = load_config(f"{TOOLS}:tiny,local", tiny_overrides(tmp_path / "run"))
    with caplog.at_level(logging.INFO, logger=_rl.__name__):
        start(config)
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("run data:"))
    assert "| tools: calculator | agent loops: tool_agent" in line, line
    assert "(64 rows, built-in arithmetic_tools, generated)" in line


def test_tool_names_are_read_without_running_the_files(tmp_path):
    tools = tmp_path / "tools.py"
    tools.write_text("import sys\nsys.exit('must not run')\nfrom jaxrl_llm.agent.tools import function_tool\n"
                     "@function_tool\ndef lookup(q: str) -> str:\n    return q\n"
                     "@function_tool(name='web_search')\ndef search(q: str) -> str:\n    return q\n"
                     "def helper():\n    pass\n")
    cfg = tmp_path / "tools.json"
    cfg.write_text(json.dumps({"tools": [{"class_name": "python"}, {"class_name": "my.Tool", "tool_schema": {
        "type": "function", "function": {"name": "fetch", "description": "", "parameters": {}}}}]}))
    config = load_config(f"{TOOLS}:tiny", [f"rollout.multi_turn.tool_config_path={cfg}",
                                           f"rollout.multi_turn.function_tool_path={tools}"])
    assert tool_names(config.rollout.multi_turn) == ["python", "fetch", "lookup", "web_search"]


@pytest.mark.parametrize("task", ["", "countdown"])
def test_sft_warm_start_without_demonstrations_is_an_error_naming_sft_train_files(tmp_path, task):
    user = _user_parquet(tmp_path / "train.parquet")
    with pytest.raises(ConfigError, match=r"sft.steps=3 but sft.train_files is empty .*"
                                          rf"data.builtin_task='{task}' has no demonstrations"):
        load_config(QUICKSTART, [f"data.train_files={user}", f"data.builtin_task={task}", "sft.steps=3"])
    # with demonstration files, or no warm start, the same config loads
    load_config(QUICKSTART, [f"data.train_files={user}", f"data.builtin_task={task}", "sft.steps=0"])
    load_config(QUICKSTART, [f"data.train_files={user}", f"data.builtin_task={task}", "sft.steps=3",
                             f"sft.train_files={user}"])


def test_sft_rows_come_from_every_sft_train_file(tmp_path):
    """Several sft.train_files: the rows of all of them (they used to be taken for rows themselves)."""
    from jaxrl_llm.data import write_rows
    from jaxrl_llm.trainer import load_tokenizer
    from jaxrl_llm.trainer._sft_data import sft_dataset

    def rows(n):
        return [{"messages": [{"role": "user", "content": f"{i}+1="},
                              {"role": "assistant", "content": str(i + 1)}]} for i in range(n)]
    write_rows(tmp_path / "a.jsonl", rows(3))
    write_rows(tmp_path / "b.parquet", rows(4))
    config = load_config(QUICKSTART, [f"sft.train_files={(str(tmp_path / 'a.jsonl'), str(tmp_path / 'b.parquet'))!r}"])
    assert len(sft_dataset(config, load_tokenizer(config))) == 7


@pytest.mark.parametrize("module", ["jaxrl_llm.train", "jaxrl_llm.sft"])
def test_missing_data_file_on_the_command_line_is_one_line_exit_2(tmp_path, module):
    import subprocess
    import sys

    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT}
    args = [f"--config={QUICKSTART}:tiny", f"--config.trainer.default_local_dir={tmp_path}/run",
            f"--config.{'sft' if module.endswith('sft') else 'data'}.train_files={tmp_path}/nope.parquet"]
    out = subprocess.run([sys.executable, "-m", module, *args], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)
    field = "sft.train_files" if module.endswith("sft") else "data.train_files"
    assert out.returncode == 2, out.stderr[-2000:]
    assert out.stderr.strip().splitlines() == [f"error: {field}[0]={tmp_path}/nope.parquet does not exist; fix "
                                               f"the path, or leave {field} empty to use the built-in "
                                               f"task's {'demonstrations' if module.endswith('sft') else 'data'} "
                                               "(data.builtin_task)"], out.stderr[-2000:]
    assert os.listdir(tmp_path) == []
