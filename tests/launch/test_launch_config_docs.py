"""docs/configs.md is generated from the typed config and lists every field with its default."""
from __future__ import annotations

import dataclasses
import json
import re
import typing
from pathlib import Path

from jaxrl_llm.config import RunConfig, base_config

ROOT = Path(__file__).resolve().parents[2]


def _field_paths(cls, prefix=""):
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            yield from _field_paths(hints[f.name], f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}"


def _cells(row: str) -> list[str]:
    """The cells of a markdown table row (escaped pipes stay inside their cell)."""
    return [c.strip() for c in re.split(r"(?<!\\)\|", row)[1:-1]]


def test_configs_doc_is_up_to_date_with_the_dataclasses(load_script):
    text = (ROOT / "docs" / "configs.md").read_text()
    assert text == load_script("gen_config_docs").render(), "docs/configs.md is stale: run `python scripts/gen_config_docs.py`"


def test_configs_doc_has_a_described_row_for_every_field():
    rows = {_cells(line)[0].strip("`"): line
            for line in (ROOT / "docs" / "configs.md").read_text().splitlines() if line.startswith("| `")}
    paths = list(_field_paths(RunConfig))
    assert len(paths) > 100
    defaults = base_config()
    for path in paths:
        assert path in rows, f"config field {path} is missing from docs/configs.md"
        cells = _cells(rows[path])
        assert len(cells) == 4 and cells[3], f"{path}: row needs a description: {rows[path]}"
        value = defaults
        for part in path.split("."):
            value = value[part]
        if isinstance(value, (bool, int, float, str)):
            assert cells[2] == f"`{json.dumps(value)}`", (path, cells[2], value)


def test_a_field_without_description_fails_generation(monkeypatch, load_script):
    gen = load_script("gen_config_docs")
    monkeypatch.delitem(gen.DESCRIPTIONS, "DataConfig.seed")
    try:
        gen.render()
    except SystemExit as e:
        assert "DataConfig.seed (data.seed)" in str(e)
    else:
        raise AssertionError("render() accepted a field without a description")
