"""Fixtures for trainer tests."""
import pytest

from jaxrl_llm.config import load_config
from trainer_helpers import QUICKSTART, tiny_overrides


@pytest.fixture
def tiny_run(tmp_path):
    def make(variant="tiny,local", **extra):
        return load_config(f"{QUICKSTART}:{variant}", tiny_overrides(tmp_path / "run", **extra))
    return make
