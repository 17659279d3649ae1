"""The OpenAI-compatible endpoint (rollout/_openai.py) over a RolloutServer on the session's tiny
engine, driven over loopback HTTP by http.client (and by the official `openai` client when it is
installed): results equal `RolloutServer.generate`, streaming, tool calls, errors, sessions."""
import collections
import concurrent.futures
import http.client
import json
import threading

import pytest

import rollout
from rollout._openai import OpenAIServer, SessionRecorder
from conftest import _tiny_engine, hook_decode  # at collection (see tests/test_conftest_imports.py)
from jaxrl_llm.models._tokenizer import CharTokenizer

MODEL = "tiny"
HELLO = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def tok():
    return CharTokenizer()  # ids < 96 for letters and most punctuation: fits the tiny vocab


@pytest.fixture(scope="module")
def served(tiny_engine, tok):
    recorder = SessionRecorder()
    with rollout.RolloutServer(tiny_engine, steps_per_sync=4) as srv, \
            OpenAIServer(srv, tok, model_name=MODEL, max_n=4, recorder=recorder) as api:
        yield api


def call(api, method, path, body=None, headers=None, raw=None):
    conn = http.client.HTTPConnection(api.host, api.port, timeout=120)
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    conn.request(method, path, body=data, headers={"Content-Type": "application/json",
                                                   **(headers or {})})
    resp = conn.getresponse()
    text = resp.read().decode()
    conn.close()
    if resp.getheader("Content-Type") == "text/event-stream":
        events = [line[len("data: "):] for line in text.split("\n\n") if line]
        assert events[-1] == "[DONE]"
        return resp.status, [json.loads(e) for e in events[:-1]]
    return resp.status, json.loads(text)


def chat(api, headers=None, **body):
    return call(api, "POST", "/v1/chat/completions", {"model": MODEL, **body}, headers=headers)


def test_models_lists_the_served_model(served):
    status, body = call(served, "GET", "/v1/models")
    assert status == 200 and body["object"] == "list"
    assert [m["id"] for m in body["data"]] == [MODEL]


def test_chat_completion_equals_the_rollout_servers_generate(served, tok):
    status, body = chat(served, messages=HELLO, max_tokens=8, temperature=1.0, seed=7, n=2,
                        logprobs=True)
    assert status == 200 and body["object"] == "chat.completion"
    prompt = tok.encode(tok.apply_chat_template(HELLO, add_generation_prompt=True))
    assert body["prompt_token_ids"] == prompt
    for row, choice in enumerate(body["choices"]):
        ref = served.server.generate(f"ref-{row}", prompt, sampling=rollout.SamplingParams(1.0),
                                     max_new_tokens=8, seed=7, row=row)
        assert choice["index"] == row and choice["token_ids"] == ref.token_ids
        assert choice["message"]["role"] == "assistant"
        assert choice["message"]["content"] == tok.decode(ref.token_ids)
        assert [e["logprob"] for e in choice["logprobs"]["content"]] == pytest.approx(ref.log_probs)
        assert choice["policy_versions"] == [0] * len(ref.token_ids)
        assert choice["finish_reason"] == ("stop" if ref.finish_reason == "stop" else "length")
    n = sum(len(c["token_ids"]) for c in body["choices"])
    assert body["usage"] == {"prompt_tokens": len(prompt), "completion_tokens": n,
                             "total_tokens": len(prompt) + n}


def test_stream_chunks_concatenate_to_the_non_stream_text(served):
    for kwargs in ({}, {"logprobs": True}):
        _, whole = chat(served, messages=HELLO, max_tokens=8, temperature=1.0, seed=3, **kwargs)
        status, events = chat(served, messages=HELLO, max_tokens=8, temperature=1.0, seed=3,
                              stream=True, stream_options={"include_usage": True}, **kwargs)
        assert status == 200
        assert all(e["object"] == "chat.completion.chunk" for e in events)
        text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events
                       if e["choices"])
        assert text == whole["choices"][0]["message"]["content"]
        assert len([e for e in events if e["choices"] and e["choices"][0]["delta"].get("content")]) > 1
        finals = [e["choices"][0]["finish_reason"] for e in events if e["choices"]]
        assert finals[-1] == whole["choices"][0]["finish_reason"] and set(finals[:-1]) == {None}
        assert events[-1]["usage"] == whole["usage"]


def test_completions_from_token_ids_and_text_and_stop_strings(served, tok):
    ids = tok.encode("abc")
    status, body = call(served, "POST", "/v1/completions",
                        {"model": MODEL, "prompt": ids, "max_tokens": 8, "temperature": 1.0,
                         "seed": 11, "logprobs": 1})
    assert status == 200 and body["object"] == "text_completion"
    ref = served.server.generate("ref-c", ids, sampling=rollout.SamplingParams(1.0),
                                 max_new_tokens=8, seed=11)
    choice = body["choices"][0]
    assert choice["token_ids"] == ref.token_ids and choice["text"] == tok.decode(ref.token_ids)
    assert choice["logprobs"]["token_logprobs"] == pytest.approx(ref.log_probs)
    assert "".join(choice["logprobs"]["tokens"]) == choice["text"]
    # the same prompt as text (CharTokenizer has no BOS) gives the same completion
    _, same = call(served, "POST", "/v1/completions",
                   {"model": MODEL, "prompt": "abc", "max_tokens": 8, "temperature": 1.0, "seed": 11})
    assert same["choices"][0]["text"] == choice["text"]
    # a stop string cuts the text before it; the tokens end with the one that completed it
    text = choice["text"]
    stop = text[len(text) // 2:len(text) // 2 + 1]
    assert stop, "the tiny model's completion is empty"
    status, cut = call(served, "POST", "/v1/completions",
                       {"model": MODEL, "prompt": ids, "max_tokens": 8, "temperature": 1.0,
                        "seed": 11, "stop": [stop], "logprobs": 0})
    c = cut["choices"][0]
    assert c["text"] == text[:text.index(stop)] and c["finish_reason"] == "stop"
    assert c["token_ids"] == ref.token_ids[:len(c["token_ids"])]
    assert stop in tok.decode(c["token_ids"]) and stop not in tok.decode(c["token_ids"][:-1])
    _, events = call(served, "POST", "/v1/completions",
                     {"model": MODEL, "prompt": ids, "max_tokens": 8, "temperature": 1.0,
                      "seed": 11, "stop": stop, "stream": True})
    assert "".join(e["choices"][0]["text"] for e in events) == c["text"]


class _Scripted:
    """A stand-in RolloutServer that answers every request with `reply` (+ EOS)."""

    def __init__(self, tok, reply):
        self.tok, self.reply, self.prompts = tok, reply, []
        self.engine = type("E", (), {"max_target_length": 512})()

    def submit(self, request_id, prompt_ids, *, sampling, max_new_tokens, seed, row, session_id):
        self.prompts.append(list(prompt_ids))
        ids = self.tok.encode(self.reply) + [self.tok.eos_token_id]
        f = concurrent.futures.Future()
        f.set_result(rollout.GenerateOutput(request_id, ids, [-0.5] * len(ids), "stop",
                                            len(prompt_ids), 0, len(prompt_ids), 0, [0] * len(ids)))
        return f


TOOLS = [{"type": "function", "function": {
    "name": "calc", "description": "Evaluates.",
    "parameters": {"type": "object", "properties": {"expr": {"type": "string"}}}}}]


def test_tool_calls_are_parsed_and_rendered_back(tok):
    reply = 'ok<tool_call>{"name": "calc", "arguments": {"expr": "6*7"}}</tool_call>'
    fake = _Scripted(tok, reply)
    with OpenAIServer(fake, tok, model_name=MODEL, tool_parser="hermes") as api:
        status, body = chat(api, messages=[{"role": "user", "content": "6*7?"}], tools=TOOLS)
        assert status == 200
        choice = body["choices"][0]
        assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "ok"
        (tc,) = choice["message"]["tool_calls"]
        assert tc["type"] == "function" and tc["id"].startswith("call_")
        assert tc["function"]["name"] == "calc"
        assert json.loads(tc["function"]["arguments"]) == {"expr": "6*7"}
        _, events = chat(api, messages=[{"role": "user", "content": "6*7?"}], tools=TOOLS,
                         stream=True)
        deltas = [e["choices"][0]["delta"] for e in events]
        assert "".join(d.get("content") or "" for d in deltas) == "ok"
        assert [d["tool_calls"][0]["function"]["name"] for d in deltas if "tool_calls" in d] == ["calc"]
        assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"
        # the call and its result go back into the next prompt in the parser's format
        history = [{"role": "user", "content": "6*7?"}, choice["message"],
                   {"role": "tool", "tool_call_id": tc["id"], "content": "42"}]
        status, _ = chat(api, messages=history, tools=TOOLS)
        assert status == 200
        sent = tok.decode(fake.prompts[-1], skip_special_tokens=False)
        assert sent.endswith('<assistant>ok\n<tool_call>\n{"name": "calc", "arguments": '
                             '{"expr": "6*7"}}\n</tool_call><eos><tool>42<assistant>')
        # tool_choice "none": the text is left as the model wrote it
        _, plain = chat(api, messages=[{"role": "user", "content": "6*7?"}], tools=TOOLS,
                        tool_choice="none")
        assert plain["choices"][0]["message"]["content"] == reply
        assert "tool_calls" not in plain["choices"][0]["message"]


@pytest.mark.parametrize("body, param, code", [
    ({"model": "gpt-4", "messages": HELLO}, "model", "model_not_found"),
    ({"model": MODEL, "messages": HELLO, "temperature": "hot"}, "temperature", "invalid_type"),
    ({"model": MODEL, "messages": HELLO, "n": 0}, "n", "invalid_value"),
    ({"model": MODEL, "messages": HELLO, "n": 5}, "n", "invalid_value"),
    ({"model": MODEL, "messages": HELLO, "max_tokens": True}, "max_tokens", "invalid_type"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi " * 20}], "max_tokens": 8},
     "messages", "context_length_exceeded"),
    ({"model": MODEL, "messages": "hello"}, "messages", None),
    ({"model": MODEL, "messages": HELLO, "stop": ["a", "b", "c", "d", "e"]}, "stop", None),
    ({"model": MODEL, "messages": HELLO, "top_logprobs": 3}, "top_logprobs", "invalid_value"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "}"}]}, None, None),  # id 97 >= vocab
    ({"model": MODEL, "messages": [{"role": "robot", "content": "hi"}]}, "messages", None),
    ({"model": MODEL, "messages": HELLO, "presence_penalty": 0.5}, "presence_penalty", "unsupported"),
    ({"model": MODEL, "messages": HELLO, "response_format": {"type": "json_object"}},
     "response_format", "unsupported"),
])
def test_bad_requests_get_400_with_openais_error_shape_and_the_server_keeps_serving(
        served, body, param, code):
    status, err = call(served, "POST", "/v1/chat/completions", body)
    assert status == 400
    assert set(err["error"]) == {"message", "type", "param", "code"}
    assert err["error"]["type"] == "invalid_request_error" and err["error"]["message"]
    assert err["error"]["param"] == param and err["error"]["code"] == code
    status, ok = chat(served, messages=HELLO, max_tokens=2, seed=0)
    assert status == 200 and ok["choices"][0]["message"]["role"] == "assistant"


def test_malformed_bodies_routes_and_completion_prompts(served):
    status, err = call(served, "POST", "/v1/chat/completions", raw=b"{not json")
    assert status == 400 and "not valid JSON" in err["error"]["message"]
    status, err = call(served, "POST", "/v1/completions", raw=b"{}",
                       headers={"Content-Length": str(1 << 40)})
    assert status == 413 and err["error"]["type"] == "invalid_request_error"
    status, err = call(served, "GET", "/v1/nothing")
    assert status == 404 and err["error"]["code"] == "not_found"
    for prompt in ("", [], [1, "a"], [[1], [2]]):
        status, err = call(served, "POST", "/v1/completions", {"model": MODEL, "prompt": prompt})
        assert status == 400 and err["error"]["param"] == "prompt"


def test_requests_past_max_in_flight_get_429_and_are_served_after(tok):
    import threading

    class Held(_Scripted):
        """Holds each request's result until `release` is set; `submitted` tells it arrived."""

        def __init__(self, *a):
            super().__init__(*a)
            self.submitted, self.release = threading.Event(), threading.Event()

        def submit(self, *a, **k):
            done = super().submit(*a, **k)
            held = concurrent.futures.Future()
            threading.Thread(target=lambda: (self.release.wait(), held.set_result(done.result())),
                             daemon=True).start()
            self.submitted.set()
            return held

    fake = Held(tok, "x")
    with OpenAIServer(fake, tok, model_name=MODEL, max_in_flight=2) as api:
        first = concurrent.futures.ThreadPoolExecutor(1).submit(chat, api, messages=HELLO, n=2)
        assert fake.submitted.wait(60)
        status, err = chat(api, messages=HELLO)
        assert status == 429 and err["error"]["code"] == "rate_limit_exceeded"
        fake.release.set()
        assert first.result(60)[0] == 200
        assert chat(api, messages=HELLO)[0] == 200  # the count went back down


def test_auth_token_is_required_when_set(tiny_engine, tok):
    fake = _Scripted(tok, "x")
    with OpenAIServer(fake, tok, model_name=MODEL, auth_token="s3cret") as api:
        status, err = call(api, "GET", "/v1/models")
        assert status == 401 and err["error"]["code"] == "invalid_api_key"
        status, _ = call(api, "GET", "/v1/models", headers={"Authorization": "Bearer wrong"})
        assert status == 401
        status, body = call(api, "GET", "/v1/models", headers={"Authorization": "Bearer s3cret"})
        assert status == 200 and body["data"][0]["id"] == MODEL


def test_session_header_reuses_the_kv_and_the_recorder_files_each_turn(served, tok):
    rec = served.recorder
    session = {"X-Session-Id": "s-1"}
    _, first = chat(served, messages=HELLO, max_tokens=3, seed=1, logprobs=True, headers=session)
    # no special token in the reply, so its text renders back to the same ids
    assert not set(first["choices"][0]["token_ids"]) & tok.special_ids
    reply = first["choices"][0]["message"]["content"]
    convo = HELLO + [{"role": "assistant", "content": reply}, {"role": "user", "content": "more"}]
    _, second = chat(served, messages=convo, max_tokens=4, seed=1, headers=session)
    turns = rec.turns("s-1")
    assert [t.response_ids for t in turns] == [first["choices"][0]["token_ids"],
                                               turns[1].response_ids]
    assert turns[0].prompt_ids == first["prompt_token_ids"]
    assert turns[0].log_probs == pytest.approx(
        [e["logprob"] for e in first["choices"][0]["logprobs"]["content"]])
    assert turns[1].prompt_ids == tok.encode(tok.apply_chat_template(convo))
    assert all(t.policy_versions == [0] * len(t.response_ids) for t in turns)
    assert tok.decode(turns[1].response_ids) == second["choices"][0]["message"]["content"]
    # the second turn extends the first's tokens: the parked slot's KV served that prefix
    assert turns[0].num_cached_tokens == 0 and turns[1].num_cached_tokens > 0
    assert rec.pop("s-1") == turns and rec.turns("s-1") == []
    assert None not in rec.sessions() or all(t.request_id for t in rec.turns(None))


SMOLLM = __import__("os").path.join(__import__("os").path.dirname(__file__), "..", "fixtures",
                                    "models", "smollm2_tiny")


def test_serve_cli_flags():
    from rollout import serve

    args = serve.parse_args(["--checkpoint", SMOLLM])
    assert args.api == "jetstream"  # the default stays JetStream's gRPC
    args = serve.parse_args(["--api", "openai", "--checkpoint", SMOLLM])
    assert args.served_model_name == "smollm2_tiny" and args.tool_parser == "hermes"
    with pytest.raises(SystemExit):
        serve.parse_args(["--api", "openai", "--checkpoint", SMOLLM, "--tool-parser", "nope"])
    with pytest.raises(SystemExit):
        serve.parse_args(["--api", "openai", "--checkpoint", SMOLLM, "--max-n", "0"])


def test_serve_api_openai_answers_the_official_openai_client():
    """`python -m rollout.serve --api openai` as `main` builds it (a real HF tokenizer and chat
    template), driven by the `openai` package (the `test` extra)."""
    openai = pytest.importorskip("openai")
    from rollout import serve

    api = serve.start(serve.parse_args(["--api", "openai", "--checkpoint", SMOLLM, "--port", "0",
                                        "--slots", "2", "--max-target-length", "64",
                                        "--served-model-name", "smol"]))
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{api.port}/v1", api_key="unused",
                               max_retries=0, timeout=120)
        assert [m.id for m in client.models.list().data] == ["smol"]
        messages = [{"role": "user", "content": "Hi"}]
        got = client.chat.completions.create(model="smol", messages=messages, max_tokens=5,
                                             temperature=0.0, logprobs=True)
        ids = api.tokenizer.encode(api.tokenizer.apply_chat_template(messages))
        ref = api.server.generate("ref", ids, sampling=rollout.SamplingParams(0.0),
                                  max_new_tokens=5)
        assert got.choices[0].message.content == api.tokenizer.decode(ref.token_ids)
        assert [c.logprob for c in got.choices[0].logprobs.content] == pytest.approx(ref.log_probs)
        assert got.usage.prompt_tokens == len(ids) and got.usage.completion_tokens == len(ref.token_ids)
        streamed = client.chat.completions.create(model="smol", messages=messages, max_tokens=5,
                                                  temperature=0.0, stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == \
            got.choices[0].message.content
        text = client.completions.create(model="smol", prompt="Hello", max_tokens=3, temperature=0)
        assert text.object == "text_completion" and text.choices[0].finish_reason in ("stop", "length")
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="gpt-4o", messages=messages)
        assert e.value.code == "model_not_found"
    finally:
        api.close()
        api.server.close()


def test_tools_render_through_a_real_chat_template_as_the_tool_agent_loop_does():
    """tokenizer_chatml's Qwen-style template: the request's tools land in the system prompt as
    the tool agent loop's `render` puts them (same template call), the call comes back parsed."""
    import os

    from jaxrl_llm.models import load_tokenizer

    bpe = load_tokenizer(os.path.join(os.path.dirname(SMOLLM), "tokenizer_chatml"))
    call_text = '<tool_call>\n{"name": "calc", "arguments": {"expr": "6*7"}}\n</tool_call>'
    fake = _Scripted(bpe, call_text)
    with OpenAIServer(fake, bpe, model_name=MODEL) as api:
        ask = [{"role": "user", "content": "What is 6*7?"}]
        status, body = chat(api, messages=ask, tools=TOOLS)
        assert status == 200 and body["choices"][0]["finish_reason"] == "tool_calls"
        msg = body["choices"][0]["message"]
        assert msg["content"] is None and msg["tool_calls"][0]["function"]["name"] == "calc"
        assert fake.prompts[0] == bpe.encode(bpe.apply_chat_template(ask, add_generation_prompt=True,
                                                                     tools=TOOLS))
        assert "<tools>" in bpe.decode(fake.prompts[0], skip_special_tokens=False)
        # this template has no tool role: its refusal is a 400 naming it
        history = ask + [msg, {"role": "tool", "tool_call_id": msg["tool_calls"][0]["id"],
                               "content": "42"}]
        status, err = chat(api, messages=history, tools=TOOLS)
        assert status == 400 and "Unsupported role: tool" in err["error"]["message"]
        history[-1] = {"role": "user", "content": "42"}
        assert chat(api, messages=history, tools=TOOLS)[0] == 200
        as_written = ask + [{"role": "assistant", "content": call_text}, history[-1]]
        assert fake.prompts[1] == bpe.encode(bpe.apply_chat_template(
            as_written, add_generation_prompt=True, tools=TOOLS))


# ------------------------------------------------------------------ incremental streaming
def test_rollout_server_on_tokens_gives_the_tokens_while_the_request_runs(served, tok):
    """`submit(on_tokens=...)`: the tokens before the loop a request ends in, in order, and the
    output equals the same request's without it."""
    srv = served.server
    prompt = tok.encode("abc")
    calls = []
    fut = srv.submit("otk", prompt, sampling=rollout.SamplingParams(1.0), max_new_tokens=16,
                     seed=4, on_tokens=lambda ids: calls.append((fut.done(), list(ids))))
    out = fut.result()
    ref = srv.generate("otk-ref", prompt, sampling=rollout.SamplingParams(1.0), max_new_tokens=16,
                       seed=4)
    assert out.token_ids == ref.token_ids and out.log_probs == ref.log_probs
    assert len(out.token_ids) > 2 * srv.steps_per_sync, "a request of several decode loops"
    assert len(calls) >= 2 and not any(done for done, _ in calls)
    got = [t for _, ids in calls for t in ids]
    assert got == out.token_ids[:len(got)] and all(ids for _, ids in calls)
    # a callback that raises is dropped; the request and the server go on
    bad = srv.submit("otk-bad", prompt, sampling=rollout.SamplingParams(1.0), max_new_tokens=16,
                     seed=4, on_tokens=lambda ids: 1 / 0)
    assert bad.result().token_ids == ref.token_ids


def _openai_client(api):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=f"http://{api.host}:{api.port}/v1", api_key="unused",
                         max_retries=0, timeout=120)


def test_official_client_stream_is_incremental_and_equals_the_non_stream_reply(served):
    """A 16-token reply (4 decode loops of 4 steps) with the official client: text chunks go out
    while the request decodes, each choice's deltas (n=2, by index) concatenate to the
    non-streamed text of the same seed, and the recorded trajectory is the same."""
    client = _openai_client(served)
    kwargs = dict(model=MODEL, messages=HELLO, max_tokens=16, temperature=1.0, seed=4, n=2)
    whole = client.chat.completions.create(**kwargs)
    assert all(c.finish_reason == "length" for c in whole.choices)  # 16 tokens each, no EOS
    recorded = served.recorder.turns(None)[-2:]
    before = served.stats["stream_chunks_while_generating"]
    chunks = list(client.chat.completions.create(**kwargs, stream=True,
                                                 stream_options={"include_usage": True}))
    early = served.stats["stream_chunks_while_generating"] - before
    assert early >= 2 * 2  # each choice: chunks after the loops 1..3 that did not end it
    for i in range(2):
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == i]
        content = [d for d in mine if d.delta.content]
        assert len(content) > 1 and mine[-1].finish_reason == "length"
        assert all(d.finish_reason is None for d in mine[:-1])
        assert "".join(d.delta.content or "" for d in mine) == whole.choices[i].message.content
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens == 32
    assert [(t.response_ids, t.log_probs, t.policy_versions)
            for t in served.recorder.turns(None)[-2:]] == \
        [(t.response_ids, t.log_probs, t.policy_versions) for t in recorded]
    # /v1/completions the same way
    before = served.stats["stream_chunks_while_generating"]
    ckw = dict(model=MODEL, prompt="abc", max_tokens=16, temperature=1.0, seed=4)
    text = client.completions.create(**ckw).choices[0].text
    parts = list(client.completions.create(**ckw, stream=True))
    assert served.stats["stream_chunks_while_generating"] - before >= 2
    assert "".join(p.choices[0].text for p in parts) == text


def test_streamed_text_never_shows_a_stop_string(served):
    client = _openai_client(served)
    kwargs = dict(model=MODEL, messages=HELLO, max_tokens=16, temperature=1.0, seed=5)
    full = client.chat.completions.create(**kwargs).choices[0].message.content
    assert len(full) >= 12
    for stop in (full[9:11], [full[6:9], full[8]], full[3]):
        cut = client.chat.completions.create(**kwargs, stop=stop).choices[0].message.content
        deltas = [c.choices[0].delta.content or "" for c in
                  client.chat.completions.create(**kwargs, stop=stop, stream=True) if c.choices]
        text = "".join(deltas)
        assert text == cut and len(cut) < len(full)
        for s in [stop] if isinstance(stop, str) else stop:
            assert s not in text


def test_stream_safe_holds_back_split_characters_and_stop_prefixes():
    from rollout._openai import stream_safe

    euro = "€".encode()
    assert stream_safe((b"ab" + euro[:2]).decode(errors="replace"), []) == "ab"
    assert stream_safe((b"ab" + euro).decode(errors="replace"), []) == "ab€"
    assert stream_safe("hello wor", ["world"]) == "hello"  # "wor" may become "world"
    assert stream_safe("hello world and", ["world"]) == "hello "
    assert stream_safe("abcd", ["abcdef", "d"]) == ""  # "abcdef" may start at 0
    assert stream_safe("xyzabcd", ["abcdef", "d"]) == "xy"
    assert stream_safe("", ["x"]) == ""


class _ByteTokenizer:
    """Bytes as token ids: a character of several bytes spans several tokens."""

    eos_token_id = 256

    def encode(self, text):
        return list(text.encode())

    def decode(self, ids):
        return bytes(i for i in ids if i < 256).decode(errors="replace")

    def apply_chat_template(self, messages, add_generation_prompt=True, **kwargs):
        return "".join(m["content"] for m in messages) + ">"


class _Stepped:
    """A stand-in RolloutServer that hands `steps` (lists of token ids) to on_tokens one at a time
    from its own thread; before the last one it waits for `seen` (set by the client on its first
    content chunk), so a stream that is only sent at the end never sees it set."""

    def __init__(self, steps):
        self.steps, self.seen, self.released = steps, threading.Event(), None
        self.engine = type("E", (), {"max_target_length": 512})()

    def submit(self, request_id, prompt_ids, *, sampling, max_new_tokens, seed, row, session_id,
               on_tokens=None):
        f = concurrent.futures.Future()

        def run():
            for ids in self.steps[:-1]:
                if on_tokens is not None:
                    on_tokens(ids)
            self.released = self.seen.wait(30)  # the old, end-only stream fails here after 30 s
            ids = [t for s in self.steps for t in s]
            f.set_result(rollout.GenerateOutput(request_id, ids, [-0.5] * len(ids), "stop",
                                                len(prompt_ids), 0, len(prompt_ids), 0,
                                                [0] * len(ids)))

        threading.Thread(target=run, daemon=True).start()
        return f


def test_a_character_split_across_tokens_is_streamed_whole_before_the_request_ends():
    euro = list("€".encode())
    steps = [[ord("a"), euro[0]], euro[1:], [ord("b")], [ord("c"), 256]]
    fake = _Stepped(steps)
    with OpenAIServer(fake, _ByteTokenizer(), model_name=MODEL) as api:
        client = _openai_client(api)
        deltas = []
        for c in client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=8,
                                                stream=True):
            if c.choices and c.choices[0].delta.content:
                deltas.append(c.choices[0].delta.content)
                fake.seen.set()
    assert fake.released, "no text chunk reached the client before the request ended"
    assert "".join(deltas) == "a€bc" and all("\ufffd" not in d for d in deltas)
    assert deltas[0] == "a" and "€" in deltas[1]


@pytest.mark.parametrize("group", [1, 2, 3])
def test_incremental_decoding_with_a_byte_level_bpe_equals_the_whole_decode(group):
    """smollm2's byte-level BPE splits 日, 語 and 😀 over several tokens: arrivals of `group`
    tokens stream deltas with no U+FFFD that concatenate to decode(all), with and without a stop
    string (the rest, as the endpoint sends it at the end, from the whole text)."""
    from jaxrl_llm.models import load_tokenizer
    from rollout._openai import _Streamer

    bpe = load_tokenizer(SMOLLM)
    text = "Grüße, naïve café — 日本語 😀 ok"
    ids = bpe.encode(text)
    assert bpe.decode(ids) == text and any("\ufffd" in bpe.decode([t]) for t in ids)
    api = type("A", (), {"tokenizer": bpe, "model_name": MODEL, "stats": collections.Counter()})()
    for stop in ([], ["語 😀"]):
        events = []
        s = _Streamer(api, events.append, {"stop": stop, "n": 1}, "completion")
        s.start("x")
        for k in range(0, len(ids), group):
            s.tokens(0, ids[k:k + group])
        deltas = [e["choices"][0]["text"] for e in events]
        final = text[:text.index(stop[0])] if stop else text
        assert all("\ufffd" not in d for d in deltas) and len(deltas) > 3
        assert "".join(deltas) == s.sent[0] == final


# ------------------------------------------------------------------ stop strings end generation
# seed 5 on HELLO: choice 0 writes "S24v=[cc?..." and choice 1 "?LFY'uX..." (both run the whole
# budget, 25 tokens, without a stop string); "24" is in choice 0's first tokens, not in choice 1's
STOP_SEED, STOP = 5, "24"


def _abort_waits_for(monkeypatch, api):
    """Makes the early stop land at a known point: the scheduler's 2nd decode loop from now waits
    until the endpoint has asked for an abort (after the 1st loop's tokens showed the stop
    string), so the aborted choice ends after at most 2 loops (8 tokens at steps_per_sync=4).
    Over a ReplicaRouter: each replica's 2nd loop (only the replicas the request runs on loop)."""
    asked, real = threading.Event(), api.server.abort

    def abort(request_id):
        ok = real(request_id)
        asked.set()
        return ok

    monkeypatch.setattr(api.server, "abort", abort)
    replicas = getattr(api.server, "replicas", None)
    for engine in [api.server.engine] if replicas is None else [r.server.engine for r in replicas]:
        hook_decode(monkeypatch, engine, {2: lambda: asked.wait(30)})


def _cut(tok, ids, stop):
    """What the endpoint keeps of a choice that ran on: its tokens up to the one completing the
    first stop string."""
    return next(k for k in range(1, len(ids) + 1) if stop in tok.decode(ids[:k]))


def _generated(api):
    return api.server.stats.get("generated_tokens", 0)


def test_a_stop_string_ends_the_generation_early_with_the_same_result(served, tok, monkeypatch):
    kwargs = dict(messages=HELLO, temperature=1.0, seed=STOP_SEED, logprobs=True)  # no max_tokens
    g0 = _generated(served)
    _, whole = chat(served, **kwargs)
    full = whole["choices"][0]
    g1 = _generated(served)
    assert g1 - g0 == len(full["token_ids"]) == 25 and full["finish_reason"] == "length"
    k = _cut(tok, full["token_ids"], STOP)
    assert k <= 4, "the stop string must show in the first decode loop's tokens"
    early = served.stats["stopped_early"]
    _abort_waits_for(monkeypatch, served)
    cuts = []
    real_cut = served._stop_cut
    monkeypatch.setattr(served, "_stop_cut", lambda *a: cuts.append(1) or real_cut(*a))
    _, body = chat(served, **kwargs, stop=STOP)
    assert len(cuts) == 1  # the cut is found once per choice and reused for the response text
    c = full["message"]["content"]
    got = body["choices"][0]
    # what the endpoint returned before (the text cut, the tokens up to the stop string's) ...
    assert got["message"]["content"] == c[:c.index(STOP)] and got["finish_reason"] == "stop"
    assert got["token_ids"] == full["token_ids"][:k]
    assert got["logprobs"]["content"] == full["logprobs"]["content"][:k]
    assert got["policy_versions"] == full["policy_versions"][:k]
    assert body["usage"]["completion_tokens"] == k
    # ... from far fewer generated tokens: the abort ended it after two decode loops, not 25 tokens
    assert _generated(served) - g1 <= 8 and served.stats["stopped_early"] == early + 1
    # the recorder files the kept tokens, as returned
    turn = served.recorder.turns(None)[-1]
    assert (turn.response_ids, turn.log_probs, turn.finish_reason) == (
        got["token_ids"], [e["logprob"] for e in got["logprobs"]["content"]], "stop")


def test_a_streamed_stop_string_ends_early_and_is_never_sent(served, tok, monkeypatch):
    kwargs = dict(messages=HELLO, temperature=1.0, seed=STOP_SEED, stop=[STOP])
    _, whole = chat(served, **kwargs)
    text = whole["choices"][0]["message"]["content"]
    g0 = _generated(served)
    _abort_waits_for(monkeypatch, served)
    _, events = chat(served, **kwargs, stream=True, stream_options={"include_usage": True})
    deltas = [e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"]]
    assert "".join(deltas) == text and all(STOP not in d for d in deltas)
    assert [e["choices"][0]["finish_reason"] for e in events if e["choices"]][-1] == "stop"
    assert events[-1]["usage"] == whole["usage"]
    assert _generated(served) - g0 <= 8


def test_n2_only_the_choice_that_reaches_the_stop_string_is_aborted(served, tok, monkeypatch):
    kwargs = dict(messages=HELLO, temperature=1.0, seed=STOP_SEED, n=2, logprobs=True)
    _, whole = chat(served, **kwargs)
    first, second = whole["choices"]
    assert STOP not in second["message"]["content"] and len(second["token_ids"]) == 25
    k = _cut(tok, first["token_ids"], STOP)
    g0, early = _generated(served), served.stats["stopped_early"]
    _abort_waits_for(monkeypatch, served)
    _, body = chat(served, **kwargs, stop=STOP)
    a, b = body["choices"]
    assert a["token_ids"] == first["token_ids"][:k] and a["finish_reason"] == "stop"
    assert b == second  # the other choice ran to its end, unchanged
    assert served.stats["stopped_early"] == early + 1
    assert _generated(served) - g0 <= 8 + 25


@pytest.fixture(scope="module")
def routed(tiny_engine, tiny_model, stop_id, tok):
    """The endpoint over a ReplicaRouter of 2 in-process replicas (tiny_engine's, and a twin on
    the same device: it reuses the compiled programs), as multi-replica runs serve it."""
    twin = _tiny_engine(tiny_model, stop_id, "per_layer")
    router = rollout.ReplicaRouter([rollout.RolloutServer(e, steps_per_sync=4) for e in (tiny_engine, twin)])
    with router, OpenAIServer(router, tok, model_name=MODEL, max_n=4, max_target_length=32) as api:
        yield api


def test_a_stop_string_ends_the_generation_early_over_a_replica_router(served, routed, tok, monkeypatch):
    """Over a 2-replica router (its submit takes on_tokens) a stop string ends the generation
    early as over one server, with the same reply; with n=2 the choices run on both replicas and
    only the one that reaches the stop string is aborted; the streamed text is the reply's."""
    assert routed._takes_on_tokens()
    kwargs = dict(messages=HELLO, temperature=1.0, seed=STOP_SEED, logprobs=True)
    _, whole = chat(routed, **kwargs)
    assert len(whole["choices"][0]["token_ids"]) == 25  # without stop: the whole budget
    _, one = chat(served, **kwargs, stop=STOP)  # one server's reply
    g0, early = _generated(routed), routed.stats["stopped_early"]
    _abort_waits_for(monkeypatch, routed)
    _, body = chat(routed, **kwargs, stop=STOP)
    assert body["choices"] == one["choices"] and body["usage"] == one["usage"]
    assert _generated(routed) - g0 <= 8 and routed.stats["stopped_early"] == early + 1
    monkeypatch.undo()
    _, one2 = chat(served, **kwargs, n=2, stop=STOP)
    placed = routed.server.stats["routed_requests"]
    g0 = _generated(routed)
    _abort_waits_for(monkeypatch, routed)
    _, body2 = chat(routed, **kwargs, n=2, stop=STOP)
    assert body2["choices"] == one2["choices"] and routed.server.stats["routed_requests"] == placed + 2
    assert _generated(routed) - g0 <= 8 + 25  # choice 0 cut after 2 loops, choice 1 ran its 25
    assert routed.server.metrics()["rollout/replica/1/requests"] >= 1  # a choice ran on replica 1
    monkeypatch.undo()
    text = one["choices"][0]["message"]["content"]
    _, events = chat(routed, messages=HELLO, temperature=1.0, seed=STOP_SEED, stop=STOP, stream=True)
    deltas = [e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"]]
    assert "".join(deltas) == text and all(STOP not in d for d in deltas)


def test_a_session_extends_a_stop_cut_reply_into_one_trajectory(served, tok, monkeypatch):
    """The recorded turn holds the kept tokens, so a next request built from the recorded ids
    (as the openai_agent hook builds it) extends it, and the trajectory is the two replies with
    the new tokens between them masked 0. The aborted slot's parked KV holds tokens past the cut:
    the next prompt does not extend them, so it is prefilled in full, and generates as a fresh
    request does."""
    from types import SimpleNamespace

    from jaxrl_llm.agent._openai_agent import OpenAIAgentLoop

    session = {"X-Session-Id": "s-stop"}
    _abort_waits_for(monkeypatch, served)
    _, first = chat(served, messages=HELLO, temperature=1.0, seed=STOP_SEED, stop=STOP,
                    logprobs=True, headers=session)
    (t1,) = served.recorder.turns("s-stop")
    assert t1.response_ids == first["choices"][0]["token_ids"] and t1.finish_reason == "stop"
    assert t1.log_probs == [e["logprob"] for e in first["choices"][0]["logprobs"]["content"]]
    glue = tok.encode("<user>more<assistant>")
    prompt = t1.prompt_ids + t1.response_ids + glue
    _, second = call(served, "POST", "/v1/completions",
                     {"model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 1.0,
                      "seed": 2, "logprobs": 1}, headers=session)
    t1, t2 = served.recorder.pop("s-stop")
    assert t2.prompt_ids == prompt and t2.num_cached_tokens == 0
    ref = served.server.generate("ref-stop", prompt, sampling=rollout.SamplingParams(1.0),
                                 max_new_tokens=4, seed=2)
    assert second["choices"][0]["token_ids"] == t2.response_ids == ref.token_ids
    traj = OpenAIAgentLoop._trajectory(SimpleNamespace(tokenizer=tok), "s-stop", [t1, t2])
    assert traj.prompt_ids == t1.prompt_ids
    assert traj.ids == t1.response_ids + glue + t2.response_ids
    assert traj.mask == [1] * len(t1.response_ids) + [0] * len(glue) + [1] * len(t2.response_ids)


def test_a_stop_cut_keeps_the_router_replay_experts_of_prompt_and_kept_tokens(tok):
    """`_kept` (applied to every output, aborted or not) cuts the experts [prompt + response,
    layers, k] to prompt + kept tokens, the last kept token's -1 (it was fed only when the
    generation ran on), so they do not depend on when the abort landed."""
    import numpy as np

    prompt, ids = tok.encode("<user>hi<assistant>"), tok.encode("ab\nObs: x")
    experts = np.arange((len(prompt) + len(ids)) * 2 * 2, dtype=np.int16).reshape(-1, 2, 2)
    experts[-1] = -1
    out = rollout.GenerateOutput("r", ids, [-0.5] * len(ids), "abort", len(prompt), 0,
                                 len(prompt), 0, [0] * len(ids), routed_experts=experts)
    with OpenAIServer(_Scripted(tok, ""), tok, model_name=MODEL) as api:
        kept, text = api._kept(out, len(prompt), ["\nObs"])
    k = len("ab\nObs")
    assert text == "ab" and kept.token_ids == ids[:k] and kept.finish_reason == "stop"
    assert kept.routed_experts.shape == (len(prompt) + k, 2, 2)
    assert (kept.routed_experts[:-1] == experts[:len(prompt) + k - 1]).all()
    assert (kept.routed_experts[-1] == -1).all() and (experts[len(prompt) + k - 1] != -1).all()


def test_the_stop_cut_finds_the_token_that_completes_the_stop_string_in_few_decodes(tok):
    """`_stop_cut` bisects over prefixes (a prefix's text only grows): the same token as a scan
    from the start, for stops at the start, middle and end and across a multi-token stop, with
    O(log n) decodes instead of one per token."""
    text = "x" * 300 + "STOP" + "y" * 200
    ids = tok.encode(text)
    with OpenAIServer(_Scripted(tok, ""), tok, model_name=MODEL) as api:
        decodes = []
        real = api.tokenizer.decode
        api.tokenizer.decode = lambda t, *a, **k: decodes.append(len(t)) or real(t, *a, **k)
        try:
            for stops in (["STOP"], ["x"], ["y"], ["TO", "yy"], ["xS"]):
                decodes.clear()
                k, before = api._stop_cut(ids, stops)
                scan = next(j for j in range(1, len(ids) + 1) if any(s in real(ids[:j]) for s in stops))
                assert k == scan and before == text[:min(text.find(s) for s in stops if s in text)]
                assert len(decodes) <= 12, (stops, len(decodes))
            assert api._stop_cut(ids, ["zz"]) is None
        finally:
            api.tokenizer.decode = real
