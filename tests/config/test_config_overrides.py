"""Overrides: a repeated field's last value replaces the earlier ones, list-valued fields too."""
import os

from jaxrl_llm._cli import last_override_wins
from jaxrl_llm.config import load_config

QUICKSTART = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "quickstart.py")


def test_repeated_list_override_replaces_instead_of_appending():
    run = load_config(QUICKSTART, ["data.val_files=A.parquet", "data.val_files="])
    assert run.data.val_files == ()
    run = load_config(QUICKSTART, ["data.val_files=A.parquet", "data.val_files=B.parquet"])
    assert run.data.val_files == ("B.parquet",)
    run = load_config(QUICKSTART, ["data.val_files=A.parquet,B.parquet"])  # one flag, two files
    assert run.data.val_files == ("A.parquet", "B.parquet")


def test_command_line_keeps_the_last_copy_of_each_override():
    argv = ["train", "--config=c.py", "--config.a.b=1", "--config.c=2", "--config.a.b=", "--other=1"]
    assert last_override_wins(argv) == ["train", "--config=c.py", "--config.c=2", "--config.a.b=", "--other=1"]
