"""What the trainer does before any worker starts: check the data files the config names, make
the built-in task's files under the run folder, write `<run>/config.json`, and say in one line
which data, reward function, tools and agent loops the run uses.

A file the config names is only ever read: generated data goes to `<run>/data/builtin/`
(`jaxrl_llm.data.prepare_builtin_files`). Reading the prompts is `RLDataset`'s job.
"""
from __future__ import annotations

import ast
import dataclasses
import json
import os
import socket
from typing import NamedTuple

from jaxrl_llm import data
from jaxrl_llm.config import ConfigError, RunConfig


class DataFiles(NamedTuple):
    """The prompt files a run reads, and which splits a built-in task generated."""

    train: tuple[str, ...]
    val: tuple[str, ...]
    generated: tuple[str, ...]  # "train" and/or "val"


def check_data_files(config: RunConfig) -> None:
    """ConfigError naming the field of the first file the config names that does not exist:
    `data.train_files`, `data.val_files`, `sft.train_files` when `sft.steps > 0`, the custom
    reward function's file, and a multi-turn run's tool / interaction config files."""
    fields = {"data.train_files": config.data.train_files, "data.val_files": config.data.val_files}
    if config.sft.steps > 0:
        fields["sft.train_files"] = config.sft.train_files
    for field, paths in fields.items():
        for i, path in enumerate(paths):
            if os.path.isdir(path):
                raise ConfigError(f"{field}[{i}]={path} is a folder; name its .parquet/.jsonl files")
            if not os.path.isfile(path):
                where = "" if os.path.isabs(path) else f" (relative to {os.getcwd()})"
                what = "demonstrations" if field.startswith("sft") else "data"
                raise ConfigError(f"{field}[{i}]={path} does not exist{where}; fix the path, or leave "
                                  f"{field} empty to use the built-in task's {what} (data.builtin_task)")
    mt, where = config.rollout.multi_turn, "rollout.multi_turn"
    files = {"reward.custom_reward_function.path": config.reward.custom_reward_function.path}
    if mt.enable:
        files.update({f"{where}.tool_config_path": mt.tool_config_path,
                      f"{where}.function_tool_path": mt.function_tool_path,
                      f"{where}.interaction_config_path": mt.interaction_config_path})
    for field, path in files.items():
        if path and not os.path.isfile(path):
            raise ConfigError(f"{field}={path} is not a file (relative to {os.getcwd()} unless absolute)")


def prepare_builtin_data(config: RunConfig) -> DataFiles:
    """The run's prompt files: the config's own, read as they are, and for each empty split the
    built-in task's generated file under `<trainer.default_local_dir>/data/builtin/` (see
    `jaxrl_llm.data.prepare_builtin_files`); user files are never written."""
    d = config.data
    made = data.prepare_builtin_files(d, config.trainer.default_local_dir)
    return DataFiles(train=d.train_files or ((made["train"],) if "train" in made else ()),
                     val=d.val_files or ((made["val"],) if "val" in made else ()),
                     generated=tuple(made))


def write_config_json(config: RunConfig, run_dir: str) -> str:
    """`<run_dir>/config.json`: the resolved config, as JSON (replaced whole, atomically)."""
    path = os.path.join(run_dir, "config.json")
    tmp = os.path.join(run_dir, f".tmp-{socket.gethostname()}-{os.getpid()}-config.json")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(dataclasses.asdict(config), f, indent=1, sort_keys=True, default=str)
        f.write("\n")
    os.replace(tmp, path)
    return path


def describe_run(config: RunConfig, files: DataFiles, agent_names: set[str] = frozenset()) -> str:
    """One line: the data (files, row counts, generated or not), the SFT warm start's rows, the
    reward function, the tools and the agent loops. `agent_names`: the data's `agent_name` values."""
    d = config.data

    def split(name, paths):
        if not paths:
            return f"{name}: none"
        tag = f", built-in {d.builtin_task}, generated" if name in files.generated else ""
        return f"{name}: " + ", ".join(f"{p} ({data.count_rows(p)} rows{tag})" for p in paths)

    custom = config.reward.custom_reward_function
    reward = f"{custom.path}:{custom.name}" if custom.path else "built-in scorers by data_source"
    mt = config.rollout.multi_turn
    if mt.enable:
        loops = ", ".join(sorted({n or mt.default_agent_loop for n in agent_names} or {mt.default_agent_loop}))
        tools = ", ".join(tool_names(mt)) or "none"
    else:
        loops, tools = "none (single-turn generation)", "none"
    s = config.sft
    sft = ("none" if s.steps <= 0 else f"{s.steps} steps on " + (
        ", ".join(f"{p} ({data.count_rows(p)} rows)" for p in s.train_files) if s.train_files
        else f"built-in {d.builtin_task} demonstrations"))
    return (f"run data: {split('train', files.train)}; {split('val', files.val)} | sft warm start: {sft} "
            f"| reward: {reward} | tools: {tools} | agent loops: {loops}")


def tool_names(multi_turn) -> list[str]:
    """The tools' names as the model calls them, read from `tool_config_path` and
    `function_tool_path` without importing or running either."""
    from jaxrl_llm.agent.tools._files import config_entries, read_config_file

    names = []
    if multi_turn.tool_config_path:
        path = multi_turn.tool_config_path
        for entry in config_entries(read_config_file(path), "tools", path):
            schema = (entry.get("tool_schema") or {}).get("function") or {}
            names.append(schema.get("name") or str(entry.get("class_name")))
    if multi_turn.function_tool_path:
        names += _function_tool_names(multi_turn.function_tool_path)
    return names


def _function_tool_names(path: str) -> list[str]:
    """Names of the `@function_tool` functions of a .py file (its `name=` argument if given),
    found by parsing the file, not running it."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), filename=path)
    names = []
    for node in tree.body:
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for dec in node.decorator_list:
            target = dec.func if isinstance(dec, ast.Call) else dec
            if (target.attr if isinstance(target, ast.Attribute) else getattr(target, "id", "")) != "function_tool":
                continue
            given = [k.value.value for k in getattr(dec, "keywords", ())
                     if k.arg == "name" and isinstance(k.value, ast.Constant)]
            names.append(given[0] if given else node.name)
    return names
