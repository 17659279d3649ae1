"""Run folders and generated data: a quickstart variant never reuses another's folder or files."""
import os

import pyarrow.parquet as pq

from jaxrl_llm.config import load_config
from jaxrl_llm.trainer._rl import prepare_builtin_data
from trainer_helpers import ROOT


def _cfg(name, variant=None, overrides=()):
    path = os.path.join(ROOT, "configs", name)
    return load_config(f"{path}:{variant}" if variant else path, list(overrides))


def test_each_quickstart_variant_size_has_its_own_run_folder_and_data():
    for name in ("quickstart.py", "quickstart_tools.py"):
        main, tiny = _cfg(name), _cfg(name, "tiny")
        assert tiny.trainer.default_local_dir != main.trainer.default_local_dir
        for run in (main, tiny):
            for f in run.data.train_files + run.data.val_files:
                assert f.startswith(run.trainer.default_local_dir + "/"), (name, f)
        # `local` changes only where the workers run: the same run
        assert _cfg(name, "local").trainer.default_local_dir == main.trainer.default_local_dir


def test_builtin_data_is_made_again_when_generator_settings_change(tmp_path):
    files = [f"data.train_files={tmp_path}/train.parquet", f"data.val_files={tmp_path}/val.parquet"]
    small = _cfg("quickstart.py", "tiny", files)
    prepare_builtin_data(small)
    assert pq.read_table(tmp_path / "train.parquet").num_rows == small.data.builtin_train_size
    mtime = os.path.getmtime(tmp_path / "train.parquet")
    prepare_builtin_data(small)  # same settings: kept
    assert os.path.getmtime(tmp_path / "train.parquet") == mtime
    bigger = _cfg("quickstart.py", "tiny", files + ["data.builtin_train_size=96"])
    prepare_builtin_data(bigger)
    assert pq.read_table(tmp_path / "train.parquet").num_rows == 96
