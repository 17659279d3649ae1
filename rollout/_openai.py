"""An OpenAI-compatible HTTP endpoint over a `RolloutServer` (standard library only).

`OpenAIServer(server, tokenizer, ...)` serves, on its own threads (`http.server`, one thread a
connection):

- `GET /v1/models`: the one model served;
- `POST /v1/chat/completions`: `messages` rendered with the tokenizer's chat template (as the tool
  agent loop renders them; `tools` are passed to the template, and an assistant message's
  `tool_calls` are written back into its text in the configured tool-call format), the reply
  parsed with that format's parser into `message.tool_calls`;
- `POST /v1/completions`: `prompt` a string (the tokenizer's BOS prepended when it has one) or a
  list of token ids.

Fields: `model` (must name the served model), `max_tokens` / `max_completion_tokens` (default:
what the KV cache leaves after the prompt), `temperature` (default 1), `top_p`, `top_k`
(extension), `n` (1..max_n; choice i samples the stream (seed, row i)), `seed` (default: a random
one a request), `stop` (a string or up to 4; see "Stop strings" below), `stream` (+
`stream_options.include_usage`), `logprobs` (chat: bool, `top_logprobs` must be 0; completions:
0 or 1): the sampled tokens' log-probs in OpenAI's shape, plus (extensions, for trainers)
`prompt_token_ids` on the response and `token_ids` / `policy_versions` on each choice. Streaming
(server-sent events) is incremental: the `RolloutServer` (or `ReplicaRouter`) hands each streaming
request its new tokens after every decode loop (`steps_per_sync` decode steps;
`submit(on_tokens=...)`), and each choice's new text goes out as one chunk (`index`: the choice) at
once, then the finish reason (with the text held back, below), the usage chunk
(`stream_options.include_usage`) and `[DONE]`. Held back until more tokens come: the bytes of a
character split across tokens, and with `stop` the last len(longest stop) - 1 characters and
everything from a stop string on, so the streamed text never shows stop text and concatenates to
the non-streamed text. Sent when the generation ends instead (as chunks of the finished response):
requests with `tools` (the parsed `tool_calls` in one chunk before the finish reason; no tool-call
deltas), with `logprobs`, and over a server whose `submit` takes no `on_tokens`. Streaming changes
no token, log-prob or recorded trajectory.

Stop strings end the generation early: over a server whose `submit` takes `on_tokens` (and which
has `abort`), every request with `stop`, streaming or not, gets its choices' new tokens after each
decode loop; the connection's thread (never the scheduler's) decodes them and, once a choice's text
shows a stop string, aborts that choice (`RolloutServer.abort`; over a `ReplicaRouter`, on the
replica it runs on), so it stops within one decode loop instead of running on to the model's stop
token or `max_tokens` (counted in `stats["stopped_early"]`; the other choices of the request run
on). A choice whose tokens show a stop string, aborted or not (the last loop's tokens come only
with the result, and a server may take no `on_tokens`), is then cut as if the generation had ended
there: its tokens up to the one that completed the stop string are kept, its text is what precedes
the stop string, its finish_reason is "stop"; the tokens sampled after it are dropped, so nothing
depends on when the abort landed (each choice samples its own seeded stream: the kept tokens are
those of an uncut run). The kept tokens are what the response returns (`token_ids`, log-probs,
`usage`), what the recorder files (`RecordedTurn`: response ids, log-probs, versions, finish_reason
"stop", and the router-replay experts cut to prompt + kept tokens, the last kept token's -1 as it
was not fed) and what a `session_hook` sees, so a session's next prompt built from the recorded ids
extends them. A session's parked KV holds what was generated before the abort landed; the next
prompt reuses it only when that is exactly the kept tokens (else it is prefilled in full: the same
tokens, more compute).

Errors: a bad request (unknown model, a field of the wrong type or range, a prompt too long for the
KV cache, token ids outside the vocabulary, an unknown route) answers HTTP 400/404 with OpenAI's
`{"error": {"message", "type", "param", "code"}}`, a missing or wrong bearer token (when
`auth_token` is set) 401; the server keeps serving. An `X-Session-Id` header passes the session id
to the `RolloutServer` (the slot's KV is kept for the session's next turn) and, with a `recorder`,
files the request's token ids, log-probs and policy versions (and the experts every token was
routed to, when the server records them for router replay) under that session.
"""
from __future__ import annotations

import collections
import dataclasses
import hmac
import http.server
import inspect
import json
import queue
import random
import threading
import time
import uuid
from typing import Any

from ._sampling import SamplingParams

_MAX_STOP = 4
MAX_BODY_BYTES = 64 << 20
SESSION_HEADER = "X-Session-Id"


class RequestError(Exception):
    """A client error: answered with `status` and OpenAI's error object."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None,
                 status: int = 400, type: str = "invalid_request_error"):
        super().__init__(message)
        self.message, self.param, self.code, self.status, self.type = message, param, code, status, type

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


@dataclasses.dataclass
class RecordedTurn:
    """One choice of one request: what a trainer needs to rebuild the trajectory."""

    request_id: str
    prompt_ids: list[int]
    response_ids: list[int]
    log_probs: list[float]
    policy_versions: list[int]
    finish_reason: str
    num_cached_tokens: int = 0  # prompt tokens whose KV the session's parked slot supplied
    # router replay: the server's `GenerateOutput.routed_experts` ([prompt + response, layers, k],
    # -1 where it fed no token), None when it records none
    routed_experts: Any = None


class SessionRecorder:
    """Collects every request's prompt/response token ids, log-probs, policy versions (and
    experts), by the request's session id (requests without one are filed under None).
    Thread-safe."""

    def __init__(self):
        self._lock = threading.Lock()
        self._turns: dict[str | None, list[RecordedTurn]] = {}

    def record(self, session_id: str | None, turn: RecordedTurn) -> None:
        with self._lock:
            self._turns.setdefault(session_id, []).append(turn)

    def turns(self, session_id: str | None) -> list[RecordedTurn]:
        with self._lock:
            return list(self._turns.get(session_id, ()))

    def pop(self, session_id: str | None) -> list[RecordedTurn]:
        """The session's turns, forgotten here."""
        with self._lock:
            return self._turns.pop(session_id, [])

    def sessions(self) -> list[str | None]:
        with self._lock:
            return list(self._turns)


# ------------------------------------------------------------------ field checks
def _field(body: dict, name: str, kinds, default=None, *, check=None, want: str = ""):
    if name not in body or body[name] is None:
        return default
    v = body[name]
    allowed = kinds if isinstance(kinds, tuple) else (kinds,)
    typed = isinstance(v, allowed) and not (isinstance(v, bool) and bool not in allowed)
    if not typed or (check is not None and not check(v)):
        raise RequestError(f"'{name}' must be {want}, got {json.dumps(v)[:80]}", param=name,
                           code="invalid_value" if typed else "invalid_type")
    return v


def _text_content(content, where: str) -> str:
    """A message's content: a string, or a list of {"type": "text", "text": ...} parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text"
                    and isinstance(part.get("text"), str)):
                raise RequestError(f"{where}: only text content parts are supported "
                                   f"({{'type': 'text', 'text': ...}})", param="messages")
            out.append(part["text"])
        return "".join(out)
    raise RequestError(f"{where}: 'content' must be a string or a list of text parts",
                       param="messages")


class OpenAIServer:
    """The HTTP endpoint (see the module docstring). `server`: a `RolloutServer` (anything with
    its `submit`, `release_session` and `engine.max_target_length`); `tokenizer`: the model's
    (`encode`, `decode`, `apply_chat_template`); `tool_parser`: a format of
    `jaxrl_llm.agent.get_tool_parser`. Use as a context manager or call `close()`."""

    def __init__(self, server, tokenizer, *, model_name: str, host: str = "127.0.0.1",
                 port: int = 0, tool_parser: str = "hermes", auth_token: str | None = None,
                 max_n: int = 16, recorder: SessionRecorder | None = None,
                 max_in_flight: int | None = None, max_target_length: int | None = None,
                 session_hook=None):
        from jaxrl_llm.agent import get_tool_parser

        self.server, self.tokenizer, self.model_name = server, tokenizer, model_name
        self.parser = get_tool_parser(tool_parser)
        self.auth_token, self.max_n, self.recorder = auth_token, int(max_n), recorder
        # max_target_length: for servers without `engine` (a `ReplicaRouter`)
        self.max_target_length = int(max_target_length or server.engine.max_target_length)
        # session_hook (a trainer's, e.g. the openai_agent loop's): `before(session_id, messages,
        # tools, prompt_ids, opts) -> prompt_ids` may replace a session request's prompt ids and
        # its sampling options (opts: sampling, seed, row, max_tokens; max_tokens 0 answers an
        # empty "length" reply without generating); `after(session_id, messages, reply, output)`
        # sees each result; `before` may raise `RequestError` to refuse the request. Called for
        # every request (session_id None without the header); messages is None for
        # /v1/completions, reply the chat message returned (None for completions).
        self.session_hook = session_hook
        # choices (n per request) submitted and not finished; past max_in_flight, HTTP 429
        self.max_in_flight, self._in_flight = max_in_flight, 0
        self._count = threading.Lock()
        self._on_tokens = None  # whether server.submit takes on_tokens (streaming), once known
        # "stream_chunks_while_generating": text chunks sent before their request ended
        self.stats = collections.Counter()
        self.created = int(time.time())
        owner = self

        class Handler(_Handler):
            api = owner

        self._httpd = _HTTPServer((host, port), Handler)
        self._httpd.daemon_threads = True
        self.host, self.port = self._httpd.server_address[:2]
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="OpenAIServer",
                                        daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join()

    def __enter__(self) -> "OpenAIServer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def wait(self) -> None:
        self._thread.join()

    # ------------------------------------------------------------------ routes
    def models(self) -> dict:
        return {"object": "list", "data": [{"id": self.model_name, "object": "model",
                                            "created": self.created, "owned_by": "jaxrl-llm"}]}

    def _common(self, body: dict) -> dict:
        model = body.get("model")
        if model != self.model_name:
            raise RequestError(f"model {json.dumps(model)} is not served here; this server serves "
                               f"{self.model_name!r} (GET /v1/models)", param="model",
                               code="model_not_found")
        temperature = _field(body, "temperature", (int, float), 1.0,
                             check=lambda v: 0 <= v <= 2, want="a number in [0, 2]")
        top_p = _field(body, "top_p", (int, float), 1.0, check=lambda v: 0 < v <= 1,
                       want="a number in (0, 1]")
        top_k = _field(body, "top_k", int, -1, check=lambda v: v >= -1,
                       want="an int >= 1 (or -1/0: all tokens)")
        n = _field(body, "n", int, 1, check=lambda v: 1 <= v <= self.max_n,
                   want=f"an int in [1, {self.max_n}]")
        seed = _field(body, "seed", int, None, want="an int")
        max_tokens = _field(body, "max_tokens", int, None, check=lambda v: v >= 1,
                            want="an int >= 1")
        stop = body.get("stop")
        if stop is None:
            stop = []
        elif isinstance(stop, str):
            stop = [stop]
        if not (isinstance(stop, list) and len(stop) <= _MAX_STOP
                and all(isinstance(s, str) and s for s in stop)):
            raise RequestError(f"'stop' must be a non-empty string or a list of at most "
                               f"{_MAX_STOP} of them", param="stop")
        for name, default in (("presence_penalty", 0), ("frequency_penalty", 0),
                              ("logit_bias", {}), ("response_format", {"type": "text"})):
            if body.get(name) not in (None, default):
                raise RequestError(f"'{name}' is not supported by this server; leave it out",
                                   param=name, code="unsupported")
        stream = _field(body, "stream", bool, False, want="a boolean")
        options = _field(body, "stream_options", dict, {}, want="an object")
        return dict(sampling=SamplingParams(temperature=float(temperature), top_k=top_k,
                                            top_p=float(top_p)),
                    n=n, seed=random.getrandbits(31) if seed is None else seed,
                    max_tokens=max_tokens, stop=stop, stream=stream,
                    include_usage=bool(options.get("include_usage")))

    def render_messages(self, messages, tools) -> list[int]:
        return self.render(self.convert_messages(messages), tools)

    def convert_messages(self, messages) -> list[dict]:
        """The request's messages as the template gets them: {"role", "content"} each, an
        assistant's tool calls written into its content in the parser's format."""
        if not isinstance(messages, list) or not messages:
            raise RequestError("'messages' must be a non-empty list of messages", param="messages")
        out = []
        for i, m in enumerate(messages):
            where = f"messages[{i}]"
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise RequestError(f"{where} must be an object with a 'role'", param="messages")
            content = _text_content(m.get("content"), where)
            calls = m.get("tool_calls") or []
            if calls:
                if m["role"] != "assistant" or not isinstance(calls, list):
                    raise RequestError(f"{where}: 'tool_calls' is a list on assistant messages",
                                       param="messages")
                texts = [content] if content else []
                for call in calls:
                    fn = call.get("function") if isinstance(call, dict) else None
                    args = fn.get("arguments") if isinstance(fn, dict) else None
                    if isinstance(args, str):
                        try:
                            args = json.loads(args)
                        except json.JSONDecodeError:
                            args = None
                    if not (isinstance(fn, dict) and isinstance(fn.get("name"), str)
                            and isinstance(args, dict)):
                        raise RequestError(f"{where}: each tool call needs 'function' with a "
                                           f"'name' and JSON-object 'arguments'", param="messages")
                    texts.append(self.parser.format(fn["name"], args))
                content = "\n".join(texts)
            out.append({"role": m["role"], "content": content})
        return out

    def render(self, out: list[dict], tools) -> list[int]:
        kwargs = {"tools": tools} if tools else {}
        try:
            text = self.tokenizer.apply_chat_template(out, add_generation_prompt=True, **kwargs)
            return list(self.tokenizer.encode(text))
        except Exception as e:  # the template's raise_exception, a missing key, encode's refusal
            raise RequestError(f"the chat template cannot render these messages: {e}",
                               param="messages") from None

    def _tools(self, body: dict):
        tools = body.get("tools")
        if tools is None:
            return None, None  # no tools: the text is the content as generated
        if not isinstance(tools, list) or not all(
                isinstance(t, dict) and t.get("type") == "function"
                and isinstance(t.get("function"), dict)
                and isinstance(t["function"].get("name"), str) for t in tools):
            raise RequestError("'tools' must be a list of {'type': 'function', 'function': "
                               "{'name', 'description', 'parameters'}}", param="tools")
        choice = body.get("tool_choice", "auto")
        if choice not in ("auto", "none"):
            raise RequestError("'tool_choice' supports 'auto' and 'none' only", param="tool_choice")
        schemas = {t["function"]["name"]: t["function"].get("parameters") or {} for t in tools}
        return tools, (schemas if choice == "auto" else None)

    def _generate(self, prompt_ids, opts, session_id, streamer=None):
        if opts["max_tokens"] is None:
            opts["max_tokens"] = max(1, self.max_target_length - len(prompt_ids))
        n = opts["n"]
        if opts["max_tokens"] == 0:  # a session hook's "no budget left": nothing is generated
            rid = uuid.uuid4().hex
            return rid, [_EmptyOutput(f"{rid}-{i}") for i in range(n)], [None] * n
        with self._count:
            if self.max_in_flight is not None and self._in_flight + n > self.max_in_flight:
                raise RequestError(f"the server is at its limit of {self.max_in_flight} requests "
                                   f"in flight (slots + queue); retry later", status=429,
                                   code="rate_limit_exceeded", type="rate_limit_error")
            self._in_flight += n
        try:
            return self._submit_all(prompt_ids, opts, session_id, streamer)
        finally:
            with self._count:
                self._in_flight -= n

    def _submit_all(self, prompt_ids, opts, session_id, streamer=None):
        rid = uuid.uuid4().hex
        futures = []
        stops = opts["stop"]
        # with stop strings, a choice whose text shows one is aborted at once (early stop)
        early = bool(stops) and self._takes_on_tokens() and hasattr(self.server, "abort")
        watch = streamer if streamer is not None else (
            _Streamer(self, None, opts, "") if early else None)
        # the scheduler thread queues (choice, new token ids) after each decode loop and
        # (choice, None) when a choice ends; this (the connection's) thread decodes them, writes
        # the stream's chunks and aborts the choices that reached a stop string
        events = queue.SimpleQueue() if watch is not None else None
        try:
            for i in range(opts["n"]):
                kwargs = {} if events is None else {"on_tokens": lambda ids, i=i: events.put((i, ids))}
                futures.append(self.server.submit(
                    f"{rid}-{i}", prompt_ids, sampling=opts["sampling"],
                    max_new_tokens=opts["max_tokens"], seed=opts["seed"],
                    row=opts.get("row", 0) + i,
                    session_id=session_id if opts["n"] == 1 else None, **kwargs))
        except (ValueError, TypeError) as e:
            for f in futures:
                f.cancel()
            code = "context_length_exceeded" if "max_target_length" in str(e) else None
            raise RequestError(str(e), param="messages" if code else None, code=code) from None
        if events is not None:
            for i, f in enumerate(futures):
                f.add_done_callback(lambda _, i=i: events.put((i, None)))
            try:
                if streamer is not None:
                    streamer.start(rid)
                left, stopped = len(futures), set()
                while left:
                    i, ids = events.get()
                    if ids is None:
                        left -= 1
                        continue
                    if i in stopped:  # aborted: what comes after the stop string is dropped
                        continue
                    text = watch.tokens(i, ids)
                    if early and self._reached_stop(text, watch.ids[i], stops):
                        stopped.add(i)
                        self.server.abort(f"{rid}-{i}")
                        self.stats["stopped_early"] += 1
            except BaseException:  # e.g. the tokenizer failing: the requests are aborted
                for f in futures:
                    f.cancel()
                raise
        kept = [self._kept(f.result(), len(prompt_ids), stops) for f in futures]
        outs, texts = [o for o, _ in kept], [t for _, t in kept]
        if self.recorder is not None:
            for o in outs:
                self.recorder.record(session_id, RecordedTurn(
                    o.request_id, list(prompt_ids), list(o.token_ids), list(o.log_probs),
                    list(o.policy_versions), o.finish_reason, int(o.num_cached_tokens),
                    getattr(o, "routed_experts", None)))
        return rid, outs, texts

    def _reached_stop(self, text: str, ids: list[int], stops: list[str]) -> bool:
        """Whether a choice's tokens so far show a stop string: found in the incrementally
        decoded `text`, confirmed on `decode(ids)` (what `_stop_cut` reads)."""
        if not any(s in text for s in stops):
            return False
        whole = self.tokenizer.decode(ids)
        return any(s in whole for s in stops)

    def _stop_cut(self, ids, stops: list[str]):
        """(k, text) of tokens `ids` cut at the first stop string: k tokens (up to the one that
        completed it) are kept and `text` is the decoded text before it; None without one."""
        text = self.tokenizer.decode(ids)
        cut = min((text.find(s) for s in stops if s in text), default=-1)
        if cut < 0:
            return None

        def shows(k: int) -> bool:
            prefix = self.tokenizer.decode(ids[:k])
            return any(s in prefix for s in stops)

        lo, hi = 0, len(ids)  # shows(hi); a prefix's text only grows, so bisect (log n decodes)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if shows(mid) else (mid, hi)
        return hi, text[:cut]

    def _kept(self, out, num_prompt: int, stops: list[str]):
        """(output, text) as the request keeps it (returned, recorded, passed to the session
        hook): cut at a stop string to its first k tokens with finish_reason "stop", whether the
        generation ended there (aborted, early stop) or ran on, so nothing depends on when the
        abort landed; the router-replay experts cut to prompt + k, the k-th token's -1 (not fed,
        as a response's last token). `text` is the decoded text before the stop string, or None
        when no stop string showed (the output is then returned as it is)."""
        found = self._stop_cut(list(out.token_ids), stops) if stops and len(out.token_ids) else None
        if found is None:
            return out, None
        k, text = found
        experts = getattr(out, "routed_experts", None)
        if experts is not None:
            experts = experts[:num_prompt + k].copy()
            experts[num_prompt + k - 1] = -1
        cut = dict(token_ids=list(out.token_ids)[:k], log_probs=list(out.log_probs)[:k],
                   policy_versions=list(out.policy_versions)[:k], finish_reason="stop")
        if experts is not None:
            cut["routed_experts"] = experts
        return dataclasses.replace(out, **cut), text

    def _finish(self, out, cut_text: str | None):
        """(text, token ids, log-probs, versions, finish_reason) of one kept output (`_kept`):
        `cut_text` is its text before the stop string that cut it (None: not cut, the whole
        decoded text)."""
        ids, lps, vers = list(out.token_ids), list(out.log_probs), list(out.policy_versions)
        if cut_text is not None:
            return cut_text, ids, lps, vers, "stop"
        reason = "stop" if out.finish_reason == "stop" else "length"
        return self.tokenizer.decode(ids), ids, lps, vers, reason

    def _token_texts(self, ids) -> list[str]:
        """Each token's share of the decoded text (a token that ends inside a multi-byte
        character gets "" and the next one the whole character)."""
        out, prev = [], ""
        for k in range(1, len(ids) + 1):
            cur = self.tokenizer.decode(ids[:k])
            if cur.endswith("\ufffd") and k < len(ids):
                out.append("")
                continue
            out.append(cur[len(prev):] if cur.startswith(prev) else cur)
            prev = cur
        return out

    def _streamer(self, writer, opts, kind: str):
        """A `_Streamer` when this request's text can go out as it is generated: a streaming
        request to a server whose `submit` takes `on_tokens`; else None (sent when it ends)."""
        if writer is None or not opts["stream"] or not self._takes_on_tokens():
            return None
        return _Streamer(self, writer, opts, kind)

    def _takes_on_tokens(self) -> bool:
        """Whether the server's `submit` takes `on_tokens` (a `RolloutServer` and a
        `ReplicaRouter` do)."""
        if self._on_tokens is None:
            try:
                self._on_tokens = "on_tokens" in inspect.signature(self.server.submit).parameters
            except (TypeError, ValueError):
                self._on_tokens = False
        return self._on_tokens

    def chat(self, body: dict, session_id: str | None, writer=None):
        opts = self._common(body)
        if body.get("max_completion_tokens") is not None:
            opts["max_tokens"] = _field(body, "max_completion_tokens", int, check=lambda v: v >= 1,
                                        want="an int >= 1")
        logprobs = _field(body, "logprobs", bool, False, want="a boolean")
        _field(body, "top_logprobs", int, 0, check=lambda v: v == 0,
               want="0 (only the sampled token's log-prob is returned)")
        tools, schemas = self._tools(body)
        messages = self.convert_messages(body.get("messages"))
        prompt_ids = self.render(messages, tools)
        hook = self.session_hook
        if hook is not None:
            prompt_ids = hook.before(session_id, messages, tools, prompt_ids, opts)
        # tool calls and log-probs: the stream is sent when the generation ends
        streamer = self._streamer(writer if schemas is None and not logprobs else None, opts,
                                  "chat")
        rid, outs, cut_texts = self._generate(prompt_ids, opts, session_id, streamer)
        choices = []
        for i, out in enumerate(outs):
            text, ids, lps, vers, reason = self._finish(out, cut_texts[i])
            content, calls = text, []
            if schemas is not None:
                content, parsed = self.parser.parse(text, schemas)
                calls = [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                          "function": {"name": c.name, "arguments": json.dumps(c.arguments)}}
                         for c in parsed if c.error is None]
                if calls and reason == "stop":
                    reason = "tool_calls"
            message = {"role": "assistant", "content": content if content or not calls else None}
            if calls:
                message["tool_calls"] = calls
            choice = {"index": i, "message": message, "finish_reason": reason, "logprobs": None}
            if streamer is not None and streamer.started:
                choice["_streamed"] = streamer.sent[i]
            elif opts["stream"]:
                choice["_pieces"] = self._token_texts(ids)
            if logprobs:
                choice["logprobs"] = {"content": [
                    {"token": t, "logprob": float(lp), "bytes": list(t.encode()), "top_logprobs": []}
                    for t, lp in zip(self._token_texts(ids), lps)]}
                choice["token_ids"], choice["policy_versions"] = ids, vers
            choices.append(choice)
        if hook is not None:
            hook.after(session_id, messages, choices[0]["message"], outs[0])
        return self._response(f"chatcmpl-{rid}", "chat.completion", prompt_ids, outs, choices,
                              logprobs)

    def completions(self, body: dict, session_id: str | None, writer=None):
        opts = self._common(body)
        logprobs = _field(body, "logprobs", int, None, check=lambda v: v in (0, 1),
                          want="0 or 1 (only the sampled token's log-prob is returned)")
        for name in ("echo", "suffix", "best_of"):
            if body.get(name) not in (None, False, 1) or (name == "suffix" and body.get(name)):
                raise RequestError(f"'{name}' is not supported", param=name, code="unsupported")
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str) and prompt:
            prompt_ids = list(self.tokenizer.encode(prompt))
            bos = getattr(self.tokenizer, "bos_token_id", None)
            if bos is not None and prompt_ids[:1] != [bos]:
                prompt_ids = [bos] + prompt_ids
        elif isinstance(prompt, list) and prompt and all(
                isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            prompt_ids = list(prompt)
        else:
            raise RequestError("'prompt' must be a non-empty string or a non-empty list of token "
                               "ids (one prompt a request)", param="prompt")
        hook = self.session_hook
        if hook is not None:
            prompt_ids = hook.before(session_id, None, None, prompt_ids, opts)
        streamer = self._streamer(writer if logprobs is None else None, opts, "completion")
        rid, outs, cut_texts = self._generate(prompt_ids, opts, session_id, streamer)
        if hook is not None:
            hook.after(session_id, None, None, outs[0])
        choices = []
        for i, out in enumerate(outs):
            text, ids, lps, vers, reason = self._finish(out, cut_texts[i])
            choice = {"index": i, "text": text, "finish_reason": reason, "logprobs": None}
            if streamer is not None and streamer.started:
                choice["_streamed"] = streamer.sent[i]
            elif opts["stream"] and logprobs is None:
                choice["_pieces"] = self._token_texts(ids)
            if logprobs is not None:
                toks = self._token_texts(ids)
                offsets = [sum(len(t) for t in toks[:j]) for j in range(len(toks))]
                choice["logprobs"] = {"tokens": toks, "token_logprobs": [float(x) for x in lps],
                                      "top_logprobs": None, "text_offset": offsets}
                choice["token_ids"], choice["policy_versions"] = ids, vers
            choices.append(choice)
        return self._response(f"cmpl-{rid}", "text_completion", prompt_ids, outs, choices,
                              logprobs is not None)

    def _response(self, rid, obj, prompt_ids, outs, choices, with_ids) -> dict:
        completion = sum(len(c.get("token_ids", o.token_ids)) for c, o in zip(choices, outs))
        resp = {"id": rid, "object": obj, "created": int(time.time()), "model": self.model_name,
                "choices": choices, "usage": {
                    "prompt_tokens": len(prompt_ids), "completion_tokens": completion,
                    "total_tokens": len(prompt_ids) + completion}}
        if with_ids:
            resp["prompt_token_ids"] = list(prompt_ids)
        return resp

    def chat_chunks(self, resp: dict, include_usage: bool):
        """The server-sent events of a finished chat completion (each a dict); for a choice whose
        text was streamed while it was generated (`_streamed`: the text sent), what is left."""
        base = {"id": resp["id"], "object": "chat.completion.chunk", "created": resp["created"],
                "model": resp["model"]}
        for c in resp["choices"]:
            i, msg = c["index"], c["message"]
            content = msg["content"] or ""
            if "_streamed" in c:
                sent = c.pop("_streamed")
                content = content[len(sent):] if content.startswith(sent) else ""
            else:
                yield {**base, "choices": [{"index": i, "delta": {"role": "assistant",
                                                                  "content": ""},
                                            "logprobs": None, "finish_reason": None}]}
            entries = (c["logprobs"] or {}).get("content")
            pieces = c.pop("_pieces", None) or [content]
            for j, p in _split(content, pieces):
                lp = {"content": [entries[j]]} if entries is not None and j >= 0 else None
                yield {**base, "choices": [{"index": i, "delta": {"content": p},
                                            "logprobs": lp, "finish_reason": None}]}
            if msg.get("tool_calls"):
                yield {**base, "choices": [{"index": i, "delta": {"tool_calls": [
                    {"index": k, **call} for k, call in enumerate(msg["tool_calls"])]},
                    "logprobs": None, "finish_reason": None}]}
            last = {"index": i, "delta": {}, "logprobs": None, "finish_reason": c["finish_reason"]}
            if "token_ids" in c:
                last["token_ids"], last["policy_versions"] = c["token_ids"], c["policy_versions"]
            yield {**base, "choices": [last]}
        if include_usage:
            yield {**base, "choices": [], "usage": resp["usage"]}

    def completion_chunks(self, resp: dict, include_usage: bool):
        base = {"id": resp["id"], "object": "text_completion", "created": resp["created"],
                "model": resp["model"]}
        for c in resp["choices"]:
            text = c["text"]
            if "_streamed" in c:
                sent = c.pop("_streamed")
                text = text[len(sent):] if text.startswith(sent) else ""
            pieces = c["logprobs"]["tokens"] if c["logprobs"] else c.pop("_pieces", [text])
            for j, p in _split(text, pieces):
                lp = None if not c["logprobs"] or j < 0 else {
                    "tokens": [p], "token_logprobs": [c["logprobs"]["token_logprobs"][j]],
                    "top_logprobs": None, "text_offset": [c["logprobs"]["text_offset"][j]]}
                yield {**base, "choices": [{"index": c["index"], "text": p, "logprobs": lp,
                                            "finish_reason": None}]}
            yield {**base, "choices": [{"index": c["index"], "text": "", "logprobs": None,
                                        "finish_reason": c["finish_reason"]}]}
        if include_usage:
            yield {**base, "choices": [], "usage": resp["usage"]}


@dataclasses.dataclass
class _EmptyOutput:
    """The reply to a session request with no budget left (see `session_hook`)."""

    request_id: str
    token_ids: tuple = ()
    log_probs: tuple = ()
    policy_versions: tuple = ()
    finish_reason: str = "length"
    num_cached_tokens: int = 0


def _split(content: str, pieces: list[str]):
    """(token index, piece) while `content` goes on with each token's text, then (-1, the rest):
    the pieces run past the content where a stop string cut it or tool calls took part of it."""
    sent = 0
    for j, p in enumerate(pieces):
        if not p:
            continue
        if not content.startswith(p, sent):
            break
        sent += len(p)
        yield j, p
    if sent < len(content):
        yield -1, content[sent:]


def stream_safe(text: str, stops: list[str]) -> str:
    """The part of `text` (the decoded tokens so far) that can be streamed now: without trailing
    U+FFFD (the bytes of a character the next tokens complete), before the first stop string,
    and without the last len(longest stop) - 1 characters (the start of a stop string that the
    next tokens may complete). Whatever follows, the final text starts with it."""
    end = len(text)
    while end and text[end - 1] == "\ufffd":
        end -= 1
    text = text[:end]
    if stops:
        end = max(0, end - (max(len(s) for s in stops) - 1))
        cut = min((text.find(s) for s in stops if s in text), default=-1)
        if cut >= 0:
            end = min(end, cut)
    return text[:end]


class _Streamer:
    """One streaming request's text as its tokens arrive (see `RolloutServer.submit`'s
    on_tokens): each choice's new `stream_safe` text goes out as a chunk at once.

    Decoding is incremental, as detokenizers do it: each arrival decodes only the tokens since
    the last settled point with the previous arrival's tokens as context (`decode(ids[prefix:])`
    minus `decode(ids[prefix:read])`), and settles them once that text extends the context's and
    ends in no partial character; unsettled text waits for the next arrival (or the end).
    Without a writer it only decodes (the early stop of a request that does not stream)."""

    def __init__(self, api: OpenAIServer, writer, opts, kind: str):
        self.api, self.writer, self.kind, self.stops = api, writer, kind, opts["stop"]
        n = opts["n"]
        self.ids = [[] for _ in range(n)]
        self.text, self.sent = ["" for _ in range(n)], ["" for _ in range(n)]
        self.prefix, self.read = [0] * n, [0] * n
        self.started = False

    def start(self, rid: str) -> None:
        self.started = True
        prefix, obj = ("chatcmpl", "chat.completion.chunk") if self.kind == "chat" else \
            ("cmpl", "text_completion")
        self.base = {"id": f"{prefix}-{rid}", "object": obj, "created": int(time.time()),
                     "model": self.api.model_name}
        if self.kind == "chat":
            for i in range(len(self.ids)):
                self._send(i, {"delta": {"role": "assistant", "content": ""}})

    def tokens(self, i: int, ids: list[int]) -> str:
        """Takes choice i's new tokens, sends its new safe text (with a writer); returns the
        choice's text decoded so far (a partial character left out)."""
        self.ids[i] += ids
        decode, every = self.api.tokenizer.decode, self.ids[i]
        start, read = self.prefix[i], self.read[i]
        context, text = decode(every[start:read]), decode(every[start:])
        current = self.text[i]
        if text.startswith(context):
            current += text[len(context):]  # stream_safe drops a partial character's U+FFFD
            if not text.endswith("\ufffd"):
                self.text[i], self.prefix[i], self.read[i] = current, read, len(every)
        if self.writer is None:  # early stop on a request that does not stream
            return current
        safe = stream_safe(current, self.stops)
        sent = self.sent[i]
        if len(safe) > len(sent) and safe.startswith(sent):
            self.sent[i] = safe
            delta = safe[len(sent):]
            self._send(i, {"delta": {"content": delta}} if self.kind == "chat" else {"text": delta})
            self.api.stats["stream_chunks_while_generating"] += 1
        return current

    def _send(self, i: int, fields: dict) -> None:
        self.writer({**self.base, "choices": [{"index": i, **fields, "logprobs": None,
                                               "finish_reason": None}]})


class _HTTPServer(http.server.ThreadingHTTPServer):
    # the listen backlog: socketserver's default of 5 resets connections when a trainer's many
    # agents (a batch of trajectories) connect at once
    request_queue_size = 1024


class _Handler(http.server.BaseHTTPRequestHandler):
    api: OpenAIServer
    protocol_version = "HTTP/1.1"
    server_version = "jaxrl-llm-openai"

    def log_message(self, format, *args):  # no access log on stderr
        pass

    def _send_json(self, status: int, obj: dict) -> None:
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    _events_started = False

    def _send_event(self, event: dict) -> None:
        """One server-sent event (the response's headers before the first); a client that has
        gone away gets no more (its request still runs to the end and is recorded)."""
        self._write(b"data: " + json.dumps(event).encode() + b"\n\n")

    def _write(self, data: bytes) -> None:
        try:
            if not self._events_started:
                self._events_started = True
                self.close_connection = True
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Cache-Control", "no-cache")
                self.send_header("Connection", "close")
                self.end_headers()
            self.wfile.write(data)
            self.wfile.flush()
        except OSError:
            pass

    def _send_events(self, events) -> None:
        for e in events:
            self._send_event(e)
        self._write(b"data: [DONE]\n\n")

    def _authorized(self) -> bool:
        token = self.api.auth_token
        if token is None:
            return True
        got = self.headers.get("Authorization", "")
        return hmac.compare_digest(got.encode(), f"Bearer {token}".encode())

    def _route(self, method: str) -> None:
        try:
            if not self._authorized():
                raise RequestError("missing or wrong 'Authorization: Bearer <token>' header",
                                   code="invalid_api_key", status=401,
                                   type="authentication_error")
            path = self.path.split("?", 1)[0].rstrip("/")
            if method == "GET" and path == "/v1/models":
                return self._send_json(200, self.api.models())
            routes = {"/v1/chat/completions": (self.api.chat, self.api.chat_chunks),
                      "/v1/completions": (self.api.completions, self.api.completion_chunks)}
            if method != "POST" or path not in routes:
                raise RequestError(f"no route {method} {path}; this server has GET /v1/models, "
                                   f"POST /v1/chat/completions and POST /v1/completions",
                                   status=404, code="not_found")
            try:
                length = int(self.headers.get("Content-Length") or 0)
            except ValueError:
                length = -1
            if not 0 <= length <= MAX_BODY_BYTES:
                self.close_connection = True  # the body is left unread
                raise RequestError(f"Content-Length must be an int in [0, {MAX_BODY_BYTES}], "
                                   f"got {self.headers.get('Content-Length')!r}",
                                   status=413 if length > MAX_BODY_BYTES else 400)
            raw = self.rfile.read(length) if length else b""
            try:
                body = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise RequestError(f"the request body is not valid JSON: {e}") from None
            if not isinstance(body, dict):
                raise RequestError("the request body must be a JSON object")
            session = self.headers.get(SESSION_HEADER) or None
            run, chunks = routes[path]
            resp = run(body, session, self._send_event if body.get("stream") is True else None)
            if body.get("stream"):
                include = bool((body.get("stream_options") or {}).get("include_usage"))
                return self._send_events(chunks(resp, include))
            return self._send_json(200, resp)
        except RequestError as e:
            if self._events_started:  # mid-stream: an error event ends it
                return self._send_events([e.body()])
            return self._send_json(e.status, e.body())
        except Exception as e:  # the server's fault: answered, and the server keeps serving
            error = {"error": {"message": f"{type(e).__name__}: {e}", "type": "server_error",
                               "param": None, "code": None}}
            if self._events_started:
                return self._send_events([error])
            return self._send_json(500, error)

    def do_GET(self):
        self._route("GET")

    def do_POST(self):
        self._route("POST")
