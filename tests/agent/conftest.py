"""Agent-loop logic (masks, parsing, tools, turns) is tested against a scripted stand-in for the
rollout server (`agent_helpers.ScriptedServer`), without a model; the real server is tested in
tests/rollout and end to end in tests/trainer."""
import pytest

from jaxrl_llm.models import CharTokenizer


@pytest.fixture
def char_tok():
    return CharTokenizer()
