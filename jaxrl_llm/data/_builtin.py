"""A built-in task's generated prompt files: where they live and how they are made.

They live under the run folder, `<run>/data/builtin/<task>-<hash>/{train,val}.parquet`, where
`<hash>` is a short digest of the generator settings (task, sizes, seeds, options): other
settings give another folder, the same settings reuse the files. A split is generated only when
the config gives no files for it; a file the user gives is read as is and never written here.
Reading the files is `RLDataset`'s job.
"""
from __future__ import annotations

import hashlib
import json
import os
import socket
from typing import Any

from jaxrl_llm.data import tasks
from jaxrl_llm.data.tasks import _reasoning_gym

SPLITS = ("train", "val")


def builtin_settings(d) -> dict[str, Any]:
    """Everything the generator's output depends on (`d`: the run's `DataConfig`)."""
    return {"task": d.builtin_task, "train_size": d.builtin_train_size, "val_size": d.builtin_val_size,
            "seed": d.seed, "max_operand": d.builtin_max_operand, "task_config": d.builtin_task_config}


def builtin_folder(d, run_dir: str) -> str:
    """`<run_dir>/data/builtin/<task>-<8 hex digits of the settings>`."""
    digest = hashlib.sha256(json.dumps(builtin_settings(d), sort_keys=True).encode()).hexdigest()[:8]
    task = d.builtin_task.replace(":", "-").replace("/", "-")
    return os.path.join(run_dir, "data", "builtin", f"{task}-{digest}")


def builtin_splits(d) -> tuple[str, ...]:
    """The splits the built-in task makes: train when `train_files` is empty, val when
    `val_files` is empty and `builtin_val_size > 0`."""
    if not d.builtin_task:
        return ()
    return tuple(s for s, files, n in (("train", d.train_files, d.builtin_train_size),
                                       ("val", d.val_files, d.builtin_val_size)) if not files and n > 0)


def make_builtin_file(d, split: str, path: str) -> None:
    """Writes split `split` ("train" | "val") of the built-in task to `path` (parquet)."""
    train = split == "train"
    n, seed, task_split = ((d.builtin_train_size, d.seed, "train") if train
                           else (d.builtin_val_size, d.seed + 1, "test"))
    gym = _reasoning_gym.dataset_name(d.builtin_task)
    if gym is not None:  # one pool for both splits, seeded by data.seed (disjoint questions)
        tasks.make_reasoning_gym_dataset(path, gym, split=task_split, train_size=d.builtin_train_size,
                                         val_size=d.builtin_val_size, seed=d.seed,
                                         options=d.builtin_task_config)
    elif d.builtin_task == "arithmetic":
        tasks.make_arithmetic_dataset(path, n, seed=seed, split=task_split, max_operand=d.builtin_max_operand)
    elif d.builtin_task == "arithmetic_tools":
        tasks.make_tool_arithmetic_dataset(path, n, seed=seed, split=task_split,
                                           max_operand=d.builtin_max_operand)
    elif d.builtin_task == "countdown":
        tasks.make_countdown_dataset(path, n, seed=seed)
    else:
        raise ValueError(f"unknown data.builtin_task {d.builtin_task!r}")


def prepare_builtin_files(d, run_dir: str) -> dict[str, str]:
    """{split: path} of the generated splits (see `builtin_splits`), made if not there yet.

    Several processes of a multi-host run may share the folder: each file is written under a
    private name (host and process id) and renamed (atomic), so no reader ever sees a
    half-written file."""
    splits = builtin_splits(d)
    if not splits:
        return {}
    folder = builtin_folder(d, run_dir)
    os.makedirs(folder, exist_ok=True)
    out = {}
    for split in splits:
        path = os.path.join(folder, f"{split}.parquet")
        if not os.path.exists(path):
            tmp = os.path.join(folder, f".tmp-{_writer()}-{split}.parquet")
            make_builtin_file(d, split, tmp)
            os.replace(tmp, path)
        out[split] = path
    settings = os.path.join(folder, "settings.json")  # for a reader of the folder
    if not os.path.exists(settings):
        tmp = os.path.join(folder, f".tmp-{_writer()}-settings.json")
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(builtin_settings(d), f, indent=1)
        os.replace(tmp, settings)
    return out


def _writer() -> str:
    """This process's part of a private file name: unique among the hosts sharing a folder."""
    return f"{socket.gethostname()}-{os.getpid()}"
