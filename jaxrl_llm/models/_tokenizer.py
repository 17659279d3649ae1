"""Tokenizers: a Hugging Face `tokenizer.json` + chat template, and a tiny character tokenizer.

Both classes follow one protocol, which the data layer and the rollout engine rely on:
`encode(text) -> list[int]`, `decode(ids, skip_special_tokens=True) -> str`,
`apply_chat_template(messages, add_generation_prompt=True) -> str`, and the attributes
`pad_token_id`, `eos_token_id`, `eos_token_ids` (every stop id), `vocab_size`.

`encode` adds no special tokens by default (verl's convention: a chat template already writes
BOS and role markers; tokenising its output with BOS added would double it). Pass
`add_special_tokens=True` to run the folder's post-processor (e.g. Llama 3's BOS), as
transformers' `tokenizer(text)` does. Special-token strings in the text (`<|im_end|>`) always map
to their single ids.

Chat templates are rendered the way transformers does: a sandboxed jinja2 environment with
`trim_blocks`, `lstrip_blocks`, loop controls, a `tojson` that does not HTML-escape,
`raise_exception` and `strftime_now`, and the variables `messages`, `add_generation_prompt`,
the special tokens (`bos_token`, `eos_token`, `pad_token`, `unk_token`) and any extra keyword
arguments (`tools`, `enable_thinking`, ...).
"""
from __future__ import annotations

import datetime
import functools
import json
import os
import string
from collections.abc import Sequence

import jinja2
import jinja2.ext
import jinja2.sandbox
from jinja2 import nodes

CHAR_TOKENIZER_FILE = "jaxrl_char_tokenizer.json"


# ---------------------------------------------------------------------------------------------
# chat templates
# ---------------------------------------------------------------------------------------------

class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (transformers' assistant-mask marker): renders its body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body, lineno=lineno)


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


@functools.lru_cache(maxsize=16)
def compile_chat_template(source: str) -> jinja2.Template:
    """A jinja2 template compiled in transformers' sandboxed chat-template environment."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env.from_string(source)


# ---------------------------------------------------------------------------------------------
# Hugging Face tokenizer.json
# ---------------------------------------------------------------------------------------------

def _token_content(value) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value


def _read_json(path: str) -> dict:
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f)


def _as_ids(value) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


class HFTokenizer:
    """A `tokenizers.Tokenizer` from `tokenizer.json` with the folder's special tokens and chat template.

    pad_token_id falls back to eos_token_id when the folder names no pad token (as verl does).
    eos_token_ids: the tokenizer's eos, then every `eos_token_id` of generation_config.json and
    config.json (Qwen2.5-Instruct: `<|im_end|>`, `<|endoftext|>`), without repeats.
    vocab_size: tokens the tokenizer knows, added tokens included (transformers' `len(tok)`);
    a model's embedding table may be larger.
    """

    def __init__(self, path: str):
        from tokenizers import Tokenizer

        file = os.path.join(path, "tokenizer.json")
        if not os.path.exists(file):
            raise FileNotFoundError(f"{file} not found: only fast tokenizers (tokenizer.json) are supported")
        self.path = path
        self.tokenizer = Tokenizer.from_file(file)
        self.tokenizer.no_padding()
        self.tokenizer.no_truncation()
        cfg = _read_json(os.path.join(path, "tokenizer_config.json"))
        special = _read_json(os.path.join(path, "special_tokens_map.json"))
        self.special_tokens = {}
        for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
            token = _token_content(cfg.get(name, special.get(name)))
            if token is not None:
                self.special_tokens[name] = token
        self.bos_token = self.special_tokens.get("bos_token")
        self.eos_token = self.special_tokens.get("eos_token")
        self.chat_template = self._find_chat_template(path, cfg)
        gen = _read_json(os.path.join(path, "generation_config.json"))
        model_cfg = _read_json(os.path.join(path, "config.json"))
        eos_ids = [self._id(self.eos_token, "eos_token")] if self.eos_token else []
        eos_ids += _as_ids(gen.get("eos_token_id")) + _as_ids(model_cfg.get("eos_token_id"))
        if not eos_ids:
            raise ValueError(f"{path}: no eos token in tokenizer_config.json, special_tokens_map.json, "
                             f"generation_config.json or config.json")
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(eos_ids))
        self.eos_token_id: int = self.eos_token_ids[0]
        pad = self.special_tokens.get("pad_token")
        self.pad_token_id: int = self._id(pad, "pad_token") if pad else self.eos_token_id
        self.bos_token_id = self._id(self.bos_token, "bos_token") if self.bos_token else None
        self.vocab_size: int = self.tokenizer.get_vocab_size(with_added_tokens=True)

    @staticmethod
    def _find_chat_template(path: str, cfg: dict) -> str | None:
        template = cfg.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            named = {t["name"]: t["template"] for t in template}
            template = named.get("default")
        jinja_file = os.path.join(path, "chat_template.jinja")
        if template is None and os.path.exists(jinja_file):
            with open(jinja_file) as f:
                template = f.read()
        return template

    def _id(self, token: str, what: str) -> int:
        i = self.tokenizer.token_to_id(token)
        if i is None:
            raise ValueError(f"{self.path}: {what} {token!r} is not in the vocabulary")
        return i

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            **kwargs) -> str:
        if self.chat_template is None:
            raise ValueError(f"{self.path}: no chat template (tokenizer_config.json 'chat_template' "
                             f"or chat_template.jinja)")
        return compile_chat_template(self.chat_template).render(
            messages=messages, add_generation_prompt=add_generation_prompt,
            **self.special_tokens, **kwargs)

    def save(self, path: str) -> None:
        """Copy this tokenizer's files into `path`."""
        from ._hf import _save_tokenizer

        os.makedirs(path, exist_ok=True)
        if os.path.abspath(path) != os.path.abspath(self.path):
            _save_tokenizer(self.path, path)

    def __len__(self) -> int:
        return self.vocab_size


# ---------------------------------------------------------------------------------------------
# the built-in character tokenizer
# ---------------------------------------------------------------------------------------------

CHAR_SPECIAL_TOKENS = ("<pad>", "<eos>", "<user>", "<assistant>", "<system>")
CHAR_ALPHABET = string.digits + string.ascii_letters + string.punctuation + " " + "\n"
CHAR_LATE_SPECIAL_TOKENS = ("<tool>",)  # added after the alphabet (ids stay stable)
_CHAR_ROLES = ("system", "user", "assistant", "tool")


class CharTokenizer:
    """A fixed character vocabulary for the embedded default task (no files needed).

    Ids: `<pad>`=0, `<eos>`=1, `<user>`=2, `<assistant>`=3, `<system>`=4, then `0-9` (5-14),
    `a-z` (15-40), `A-Z` (41-66), `string.punctuation` in Python's order (67-98), space (99),
    newline (100), and `<tool>` (101, the tool-response role of agent rollouts; appended last so
    the earlier ids never changed); vocab_size 102. A character outside this set is an error.
    Chat template: each message is its role token followed by its content, an assistant message
    is followed by `<eos>`, and `add_generation_prompt` appends `<assistant>`. `tools=` is
    accepted and not rendered (a tiny model learns its tools from demonstrations).
    """

    def __init__(self):
        self.tokens: tuple[str, ...] = (CHAR_SPECIAL_TOKENS + tuple(CHAR_ALPHABET)
                                         + CHAR_LATE_SPECIAL_TOKENS)
        self._ids = {t: i for i, t in enumerate(self.tokens)}
        self.pad_token_id, self.eos_token_id = 0, 1
        self.eos_token_ids = (1,)
        self.bos_token_id = None
        self.vocab_size = len(self.tokens)
        self._specials = CHAR_SPECIAL_TOKENS + CHAR_LATE_SPECIAL_TOKENS
        self.special_ids = frozenset(self._ids[t] for t in self._specials)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        del add_special_tokens  # nothing is ever added
        ids, i = [], 0
        while i < len(text):
            if text[i] == "<":
                special = next((t for t in self._specials if text.startswith(t, i)), None)
                if special:
                    ids.append(self._ids[special])
                    i += len(special)
                    continue
            if text[i] not in self._ids:
                raise ValueError(f"CharTokenizer: character {text[i]!r} at position {i} is not in its "
                                 f"vocabulary (digits, ASCII letters, punctuation, space, newline)")
            ids.append(self._ids[text[i]])
            i += 1
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        out = []
        for i in ids:
            i = int(i)
            if i >= self.vocab_size and skip_special_tokens:
                continue  # a model's padded vocabulary rows (unused ids), as HF tokenizers skip them
            if not 0 <= i < self.vocab_size:
                raise ValueError(f"CharTokenizer: id {i} is outside the vocabulary (size {self.vocab_size})")
            if skip_special_tokens and i in self.special_ids:
                continue
            out.append(self.tokens[i])
        return "".join(out)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            **kwargs) -> str:
        del kwargs
        parts = []
        for m in messages:
            role = m["role"]
            if role not in _CHAR_ROLES:
                raise ValueError(f"CharTokenizer: unknown chat role {role!r}; it knows {_CHAR_ROLES}")
            parts.append(f"<{role}>{m['content']}" + ("<eos>" if role == "assistant" else ""))
        if add_generation_prompt:
            parts.append("<assistant>")
        return "".join(parts)

    def save(self, path: str) -> None:
        """Write the marker file that `load_tokenizer(path)` recognises."""
        os.makedirs(path, exist_ok=True)
        with open(os.path.join(path, CHAR_TOKENIZER_FILE), "w") as f:
            json.dump({"type": "char", "version": 1, "tokens": list(self.tokens)}, f, indent=1)

    def __len__(self) -> int:
        return self.vocab_size


def load_tokenizer(path: str) -> HFTokenizer | CharTokenizer:
    """The tokenizer of a folder: `jaxrl_char_tokenizer.json` -> CharTokenizer, else `tokenizer.json`
    -> HFTokenizer. The name "char" (when no such folder exists) gives the built-in CharTokenizer."""
    path = os.fspath(path)
    marker = os.path.join(path, CHAR_TOKENIZER_FILE)
    if os.path.exists(marker):
        saved = _read_json(marker)
        tok = CharTokenizer()
        saved_tokens = tuple(saved.get("tokens", ()))
        if not saved_tokens or saved_tokens != tok.tokens[:len(saved_tokens)]:
            raise ValueError(f"{marker}: vocabulary differs from this version's CharTokenizer")
        return tok
    if path == "char" and not os.path.isdir(path):
        return CharTokenizer()
    if not os.path.isdir(path):
        raise FileNotFoundError(f"tokenizer folder {path!r} does not exist")
    return HFTokenizer(path)
