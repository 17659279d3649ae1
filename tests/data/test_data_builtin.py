"""A built-in task generates only the splits the config leaves empty, in a folder keyed by its
generator settings; `count_rows` reads parquet and jsonl files."""
import os

from jaxrl_llm.config import load_config
from jaxrl_llm.data import builtin_folder, builtin_splits, count_rows, prepare_builtin_files, tasks, write_rows

QUICKSTART = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "quickstart.py")


def _data(*overrides):
    return load_config(QUICKSTART, ["sft.steps=0", *overrides]).data


def test_a_split_is_generated_only_when_its_files_are_empty(tmp_path):
    mine = str(tasks.make_arithmetic_dataset(tmp_path / "mine.parquet", 8, seed=1))
    assert builtin_splits(_data()) == ("train", "val")
    assert builtin_splits(_data(f"data.train_files={mine}")) == ("val",)
    assert builtin_splits(_data(f"data.val_files={mine}")) == ("train",)
    assert builtin_splits(_data(f"data.train_files={mine}", f"data.val_files={mine}")) == ()
    assert builtin_splits(_data("data.builtin_val_size=0")) == ("train",)  # no validation
    assert builtin_splits(_data(f"data.train_files={mine}", "data.builtin_task=")) == ()
    made = prepare_builtin_files(_data(f"data.train_files={mine}", "data.builtin_val_size=5"), str(tmp_path / "run"))
    assert list(made) == ["val"] and count_rows(made["val"]) == 5
    assert sorted(os.listdir(tmp_path)) == ["mine.parquet", "run"]


def test_the_folder_is_keyed_by_every_generator_setting(tmp_path):
    base = builtin_folder(_data(), "r")
    assert base.startswith(os.path.join("r", "data", "builtin", "arithmetic-"))
    for change in ("data.builtin_train_size=7", "data.builtin_val_size=7", "data.seed=7",
                   "data.builtin_max_operand=7", "data.builtin_task=countdown"):
        assert builtin_folder(_data(change), "r") != base, change
    assert builtin_folder(_data("data.max_prompt_length=99"), "r") == base  # not a generator setting


def test_count_rows_reads_parquet_and_jsonl(tmp_path):
    rows = [{"a": i} for i in range(3)]
    write_rows(tmp_path / "x.parquet", rows)
    write_rows(tmp_path / "x.jsonl", rows)
    assert count_rows(tmp_path / "x.parquet") == count_rows(tmp_path / "x.jsonl") == 3
