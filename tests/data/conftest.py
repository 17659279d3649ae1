"""A byte-level test tokenizer with a trivial, incremental chat template."""
import pytest


class ByteTokenizer:
    """ids 0..255 are UTF-8 bytes; 256 is pad, 257 is EOS.

    Template: "<role>content\n" per message, then "<assistant>" for the generation prompt.
    """

    pad_token_id = 256
    eos_token_id = 257

    def encode(self, text):
        return list(text.encode("utf-8"))

    def decode(self, ids):
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def apply_chat_template(self, messages, add_generation_prompt=True):
        text = "".join(f"<{m['role']}>{m['content']}\n" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")


@pytest.fixture
def tokenizer():
    return ByteTokenizer()
