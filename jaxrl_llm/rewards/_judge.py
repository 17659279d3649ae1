"""A generative judge (LLM-as-judge, verl's GenRM) and the rule by which rewards combine.

`Judge.judge(question, response, ground_truth)` renders `reward.judge.prompt_template` with the
three fields, wraps it as one user message in the judge tokenizer's chat template (raw text when
the tokenizer has none), sends the token ids to a rollout server (`rollout.RolloutServer` or a
`ReplicaRouter`: the judge's own engine, or the policy's), decodes the reply and parses a score
from it with the configured parser. What the server does (batching, slots) is the server's job;
this module only builds requests and reads replies.

The combination rule (`combine_scores`): every source that is on adds its weighted score,
    score = rule_weight * rule + model.weight * reward_model + judge.weight * judge
where a source that is off contributes nothing and a weight of 0 turns a source off (the rule
scorers are then not even called).
"""
from __future__ import annotations

import dataclasses
import importlib
import itertools
import json
import os
import re
import string
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from jaxrl_llm.rewards._custom import _load

TEMPLATE_FIELDS = ("question", "response", "ground_truth")
_NUMBER = re.compile(r"[-+]?(?:\d+\.\d*|\.\d+|\d+)(?:[eE][-+]?\d+)?")


def check_template(template: str, field: str = "reward.judge.prompt_template") -> None:
    """Raises ValueError naming `field` unless `template` is a `str.format` template whose
    fields are among {question}, {response}, {ground_truth} and that has {response}."""
    try:
        names = [name for _, name, spec, conv in string.Formatter().parse(template) if name is not None]
    except ValueError as e:
        raise ValueError(f"{field}: not a valid format template ({e}); write a literal brace as "
                         "{{ or }}") from None
    unknown = sorted({n for n in names if n not in TEMPLATE_FIELDS})
    if unknown:
        raise ValueError(f"{field} uses {{{unknown[0]}}}, which is not a judge field: use "
                         f"{{question}}, {{response}} and {{ground_truth}} (a literal brace is {{{{ or }}}})")
    if "response" not in names:
        raise ValueError(f"{field} has no {{response}}: the judge would not see what it judges")


def render_template(template: str, question: str, response: str, ground_truth: Any) -> str:
    return template.format(question=question, response=response,
                           ground_truth="" if ground_truth is None else str(ground_truth))


def make_score_parser(spec: str, field: str = "reward.judge.score_parser") -> Callable[[str], float | None]:
    """The parser named by `spec`: `last_number` (the last number in the text), `regex:PATTERN`
    (the last match: its first group, or the whole match without groups) or a Python function
    `path/to/file.py:name` / `package.module:name` taking the text and returning a float or None.
    None (or a non-number) is a parse failure. Raises ValueError naming `field` for a bad spec."""
    if spec == "last_number":
        return _last_number
    if spec.startswith("regex:"):
        try:
            pattern = re.compile(spec[len("regex:"):])
        except re.error as e:
            raise ValueError(f"{field}={spec!r}: the pattern does not compile ({e})") from None
        return _RegexParser(pattern)
    if ":" in spec:
        where, name = spec.rsplit(":", 1)
        try:
            if where.endswith(".py"):
                return _load(os.path.abspath(where), name)
            fn = getattr(importlib.import_module(where), name)
        except (FileNotFoundError, ImportError, AttributeError, TypeError) as e:
            raise ValueError(f"{field}={spec!r}: cannot load the parser function ({e})") from None
        if not callable(fn):
            raise ValueError(f"{field}={spec!r}: {name!r} is not callable")
        return fn
    raise ValueError(f"{field}={spec!r} is not a parser: use 'last_number', 'regex:PATTERN' or a "
                     "function 'path/to/file.py:name' / 'package.module:name'")


def _last_number(text: str) -> float | None:
    found = _NUMBER.findall(text)
    return float(found[-1]) if found else None


@dataclasses.dataclass(frozen=True)
class _RegexParser:
    pattern: re.Pattern

    def __call__(self, text: str) -> float | None:
        matches = list(self.pattern.finditer(text))
        if not matches:
            return None
        m = matches[-1]
        return _to_float(m.group(1) if m.re.groups else m.group(0))


def _to_float(x) -> float | None:
    try:
        value = float(x)
    except (TypeError, ValueError):
        return None
    return value if value == value and abs(value) != float("inf") else None


@dataclasses.dataclass(frozen=True)
class Judgement:
    """One judgement: the parsed score (`failure_score` when unparsed), whether it parsed, the
    judge's raw reply, whether the prompt was cut to fit, and the server's policy version."""

    score: float
    parsed: bool
    text: str
    truncated: bool
    policy_version: int


class Judge:
    """`await judge.judge(question, response, ground_truth)` -> `Judgement`.

    server: anything with `agenerate(request_id, prompt_ids, *, sampling, max_new_tokens,
    session_id, seed, row)` (a `rollout.RolloutServer` / `ReplicaRouter`); sampling: its
    `SamplingParams`; max_prompt_length: a longer judge prompt keeps its last tokens (counted in
    `Judgement.truncated`); log_path / log_every: every `log_every`-th judgement (from the first)
    appended to a jsonl file (0 or "" = none).
    """

    def __init__(self, server, tokenizer, *, template: str, parser: Callable[[str], float | None],
                 sampling, max_new_tokens: int, max_prompt_length: int, seed: int = 0,
                 failure_score: float = 0.0, log_path: str = "", log_every: int = 0):
        check_template(template)
        self.server, self.tokenizer, self.template, self.parser = server, tokenizer, template, parser
        self.sampling, self.max_new_tokens = sampling, int(max_new_tokens)
        self.max_prompt_length, self.seed, self.failure_score = int(max_prompt_length), int(seed), failure_score
        self.log_path, self.log_every = log_path, int(log_every)
        self._count = itertools.count()
        self._log_lock = threading.Lock()

    def prompt_ids(self, question: str, response: str, ground_truth: Any) -> tuple[list[int], bool]:
        """The judge request's token ids, and whether they were cut to `max_prompt_length`."""
        text = render_template(self.template, question, response, ground_truth)
        if getattr(self.tokenizer, "chat_template", "") is not None:  # HF tokenizers may have none
            text = self.tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                      add_generation_prompt=True)
        ids = list(self.tokenizer.encode(text))
        cut = len(ids) > self.max_prompt_length
        return (ids[-self.max_prompt_length:] if cut else ids), cut

    async def judge(self, question: str, response: str, ground_truth: Any) -> Judgement:
        i = next(self._count)
        ids, cut = self.prompt_ids(question, response, ground_truth)
        out = await self.server.agenerate(f"judge-{id(self):x}-{i}", ids, sampling=self.sampling,
                                          max_new_tokens=self.max_new_tokens, session_id=None,
                                          seed=self.seed, row=i)
        text = self.tokenizer.decode(out.token_ids)
        value = _to_float(self.parser(text))
        result = Judgement(score=self.failure_score if value is None else value, parsed=value is not None,
                           text=text, truncated=cut, policy_version=int(out.policy_version))
        if self.log_path and self.log_every > 0 and i % self.log_every == 0:
            self._log(i, question, response, ground_truth, result)
        return result

    def _log(self, i: int, question, response, ground_truth, j: Judgement) -> None:
        line = json.dumps({"index": i, "policy_version": j.policy_version, "question": question,
                           "response": response, "ground_truth": None if ground_truth is None else str(ground_truth),
                           "judgement": j.text, "score": j.score, "parsed": j.parsed,
                           "truncated": j.truncated})
        with self._log_lock:
            os.makedirs(os.path.dirname(os.path.abspath(self.log_path)), exist_ok=True)
            with open(self.log_path, "a") as f:
                f.write(line + "\n")


def question_of(raw_prompt: list[dict]) -> str:
    """The judge's {question}: the prompt's last user message (all messages joined when none)."""
    users = [m["content"] for m in raw_prompt if m.get("role") == "user"]
    return str(users[-1]) if users else "\n".join(str(m.get("content", "")) for m in raw_prompt)


def judgement_metrics(judged: list[Judgement]) -> dict[str, float]:
    """reward/judge/*: the mean score, the parse failures, the prompts cut to
    reward.judge.max_prompt_length and the judgement's mean length in characters."""
    if not judged:
        return {}
    return {"reward/judge/score/mean": sum(j.score for j in judged) / len(judged),
            "reward/judge/parse_failures": float(sum(not j.parsed for j in judged)),
            "reward/judge/truncated_prompts": float(sum(j.truncated for j in judged)),
            "reward/judge/judgement_chars/mean": sum(len(j.text) for j in judged) / len(judged)}


@dataclasses.dataclass(frozen=True)
class RewardWeights:
    """The weights of `combine_scores` (config: reward.rule_weight, reward.model.weight,
    reward.judge.weight)."""

    rule: float = 1.0
    model: float = 1.0
    judge: float = 1.0


def resolve_rule_weight(rule_weight: float, *, has_model: bool, has_judge: bool) -> float:
    """reward.rule_weight < 0 (auto): 1 when neither a reward model nor a judge is on, else 0 (the
    model / judge replace the rule scorers, as verl's `rm_scores` do)."""
    if rule_weight >= 0:
        return float(rule_weight)
    return 0.0 if (has_model or has_judge) else 1.0


def combine_scores(weights: RewardWeights, *, rule=None, model=None, judge=None):
    """sum of weight x score over the sources that ran (None = that source is off): one row's
    floats -> a float, or f32[b] arrays (the batch rollout's) -> f32[b]."""
    total = 0.0
    for w, s in ((weights.rule, rule), (weights.model, model), (weights.judge, judge)):
        if s is not None:
            total = total + w * (np.asarray(s, np.float64) if np.ndim(s) else float(s))
    return np.asarray(total, np.float32) if np.ndim(total) else float(total)
