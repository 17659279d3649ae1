"""Supervised fine-tuning examples: chat conversations -> input_ids + assistant-only loss mask.

The chat template is rendered incrementally (first k messages, then k+1, ...) so each
assistant turn's tokens are found exactly, for any number of turns. The loss mask is aligned
with `input_ids` (1 on tokens the assistant wrote, including the template's end-of-turn text);
a loss predicting token t from tokens < t uses `input_ids[:, 1:]` and `loss_mask[:, 1:]`.
"""
from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence

import numpy as np

from jaxrl_llm.data._schema import DataError, PathLike, read_raw_rows, validate_messages
from jaxrl_llm.data._tokenizer import Tokenizer

SFT_TRUNCATIONS = ("error", "right")


@dataclasses.dataclass(frozen=True)
class SFTExample:
    """One tokenized conversation; `loss_mask[t] == 1` iff token t was written by the assistant."""

    input_ids: list[int]
    loss_mask: list[int]


def _segments(messages: list[dict], tokenizer: Tokenizer) -> list[tuple[str, bool]]:
    """Splits the rendered conversation into (text, is_assistant) pieces."""
    pieces, done = [], ""
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = (tokenizer.apply_chat_template(messages[:i], add_generation_prompt=True)
                  if i else "")
        after = tokenizer.apply_chat_template(messages[: i + 1], add_generation_prompt=False)
        if not before.startswith(done) or not after.startswith(before):
            raise ValueError("the chat template is not incremental: rendering fewer messages "
                             "does not give a prefix of rendering more")
        pieces += [(before[len(done):], False), (after[len(before):], True)]
        done = after
    full = tokenizer.apply_chat_template(messages, add_generation_prompt=False)
    if not full.startswith(done):
        raise ValueError("the chat template is not incremental at the last message")
    pieces.append((full[len(done):], False))
    return [(text, is_assistant) for text, is_assistant in pieces if text]


def _tokenize(pieces: list[tuple[str, bool]], tokenizer: Tokenizer) -> tuple[list, list]:
    """Token ids and mask; encodes growing prefixes so tokens match encoding the whole text."""
    ids, mask, text = [], [], ""
    for piece, is_assistant in pieces:
        text += piece
        new = list(tokenizer.encode(text))
        if new[: len(ids)] != ids:  # a merge across the boundary: encode pieces separately
            ids, mask = [], []
            for p, a in pieces:
                p_ids = list(tokenizer.encode(p))
                ids += p_ids
                mask += [int(a)] * len(p_ids)
            return ids, mask
        mask += [int(is_assistant)] * (len(new) - len(ids))
        ids = new
    return ids, mask


def _add_eos(ids: list[int], mask: list[int], eos: int) -> tuple[list, list]:
    """Makes every assistant span that lacks EOS end with one, so the model learns to stop."""
    out_ids, out_mask = [], []
    for t, (tok, m) in enumerate(zip(ids, mask)):
        out_ids.append(tok)
        out_mask.append(m)
        span_ends = m == 1 and (t + 1 == len(ids) or mask[t + 1] == 0)
        if span_ends:
            start = t
            while start > 0 and mask[start - 1] == 1:
                start -= 1
            if eos not in ids[start: t + 1]:
                out_ids.append(eos)
                out_mask.append(1)
    return out_ids, out_mask


class SFTDataset(Sequence):
    """Conversations from a parquet/jsonl file (or a list of row dicts) as `SFTExample`s.

    Each row holds `messages_key`: a list of {"role", "content"} with at least one assistant
    turn. If an assistant span's tokens contain no `eos_token_id`, EOS is appended to it (and
    trained on) when `add_eos` is true. Examples longer than `max_length` raise a `DataError`
    naming the row (truncation="error") or are cut on the right (truncation="right").
    """

    def __init__(self, path_or_rows: PathLike | Sequence[Mapping], tokenizer: Tokenizer, *,
                 max_length: int, messages_key: str = "messages", truncation: str = "error",
                 add_eos: bool = True):
        if truncation not in SFT_TRUNCATIONS:
            raise ValueError(f"truncation must be one of {SFT_TRUNCATIONS}, got {truncation!r}")
        if isinstance(path_or_rows, (str, os.PathLike)):
            path, rows = path_or_rows, read_raw_rows(path_or_rows)
        else:
            path, rows = None, list(path_or_rows)
        self.max_length = max_length
        self.examples: list[SFTExample] = []
        where = os.fspath(path) if path is not None else "<rows>"
        for index, row in enumerate(rows):
            if not isinstance(row, Mapping) or messages_key not in row:
                raise DataError(f"{where} row {index}: required field {messages_key!r} is missing")
            messages = row[messages_key]
            validate_messages(messages, field=messages_key, path=path, index=index)
            messages = [{"role": m["role"], "content": m["content"]} for m in messages]
            if not any(m["role"] == "assistant" for m in messages):
                raise DataError(f"{where} row {index}: field {messages_key!r} has no assistant "
                                "message to learn from")
            try:
                ids, mask = _tokenize(_segments(messages, tokenizer), tokenizer)
            except ValueError as e:
                raise DataError(f"{where} row {index}: {e}") from e
            if add_eos:
                ids, mask = _add_eos(ids, mask, tokenizer.eos_token_id)
            if len(ids) > max_length:
                if truncation == "error":
                    raise DataError(f"{where} row {index}: conversation has {len(ids)} tokens, "
                                    f"more than max_length={max_length}; raise max_length or "
                                    "set truncation='right'")
                ids, mask = ids[:max_length], mask[:max_length]
            self.examples.append(SFTExample(input_ids=ids, loss_mask=mask))

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, i):
        return self.examples[i]


def collate_sft(examples: Sequence[SFTExample], pad_token_id: int,
                max_length: int) -> dict[str, np.ndarray]:
    """Right-pads to int32[b, max_length]: input_ids, attention_mask, position_ids, loss_mask."""
    b = len(examples)
    input_ids = np.full((b, max_length), pad_token_id, dtype=np.int32)
    attention_mask = np.zeros((b, max_length), dtype=np.int32)
    loss_mask = np.zeros((b, max_length), dtype=np.int32)
    for i, example in enumerate(examples):
        n = len(example.input_ids)
        if n > max_length:
            raise ValueError(f"example {i} has {n} tokens, more than max_length={max_length}")
        input_ids[i, :n] = example.input_ids
        attention_mask[i, :n] = 1
        loss_mask[i, :n] = example.loss_mask
    position_ids = np.clip(np.cumsum(attention_mask, axis=1) - 1, 0, None).astype(np.int32)
    return {"input_ids": input_ids, "attention_mask": attention_mask,
            "position_ids": position_ids, "loss_mask": loss_mask}
