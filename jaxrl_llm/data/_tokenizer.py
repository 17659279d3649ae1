"""The tokenizer interface the data layer needs; implementations live in `jaxrl_llm.models`."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable


@runtime_checkable
class Tokenizer(Protocol):
    """Anything that turns chat messages into token ids and back.

    `apply_chat_template` renders messages to text (it does not tokenize); `encode` must not
    add special tokens the template already wrote.
    """

    pad_token_id: int
    eos_token_id: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def apply_chat_template(self, messages: list[dict],
                            add_generation_prompt: bool = True) -> str: ...
