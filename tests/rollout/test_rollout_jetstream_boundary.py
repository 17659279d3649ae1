"""The served JetStream endpoint's request boundary: malformed requests, overload, authentication
and `python -m rollout.serve`'s flags. The servers run in-process over the session's tiny engine
(no new shapes compiled). A request that reached a driver thread and failed there would SIGKILL
the whole test process (JetStream's `JetThread`): that is how these tests fail on the old code.
"""
import json
import os
import shutil
import threading
from concurrent import futures

import grpc
import portpicker
import pytest

from conftest import greedy_reference
from jaxrl_llm.models import CharTokenizer
from rollout import jetstream_adapter, serve

FIXTURE = os.path.join(os.path.dirname(__file__), "..", "fixtures", "models", "qwen2")
TOKEN = "s3cret-token"


def _pb():
    return jetstream_adapter.import_jetstream().jetstream_pb2


def _tokens(ids, max_tokens=3):
    pb = _pb()
    return pb.DecodeRequest(token_content=pb.DecodeRequest.TokenContent(token_ids=ids),
                            max_tokens=max_tokens)


def _text(text, max_tokens=3):
    pb = _pb()
    return pb.DecodeRequest(text_content=pb.DecodeRequest.TextContent(text=text),
                            max_tokens=max_tokens)


class _Client:
    def __init__(self, port, token=None):
        js = jetstream_adapter.import_jetstream()
        self.channel = grpc.secure_channel(f"127.0.0.1:{port}", grpc.local_channel_credentials())
        self.stub = js.jetstream_pb2_grpc.OrchestratorStub(self.channel)
        self.metadata = None if token is None else [("authorization", f"Bearer {token}")]

    def decode(self, request):
        stream = self.stub.Decode(request, timeout=120, metadata=self.metadata)
        return [t for r in stream for t in r.stream_content.samples[0].token_ids]

    def status_of(self, request) -> grpc.RpcError:
        with pytest.raises(grpc.RpcError) as info:
            self.decode(request)
        return info.value


@pytest.fixture()
def char_engine(tiny_engine, monkeypatch):
    """The tiny engine (vocab 96, max prefill 16, no BOS) with the char tokenizer (vocab 102)."""
    monkeypatch.setattr(tiny_engine, "tokenizer", CharTokenizer())
    return tiny_engine


@pytest.fixture()
def expected(tiny_model, prompts, stop_id):
    """What a good request (prompts[0], 3 tokens) returns: the greedy tokens before any stop."""
    ref = greedy_reference(tiny_model, prompts[0], 3, stop_ids=(stop_id,))
    return [t for t in ref if t != stop_id]


def test_malformed_requests_get_invalid_argument_and_the_server_keeps_serving(
        char_engine, prompts, expected):
    port = portpicker.pick_unused_port()
    server = jetstream_adapter.run_server(char_engine, port)
    pb = _pb()
    cases = {
        "no prompt": (pb.DecodeRequest(max_tokens=3), "no prompt"),
        "empty text": (_text(""), "empty prompt"),
        "empty token ids": (_tokens([]), "empty prompt"),
        "negative id": (_tokens([5, -1, 7]), "token id -1 at position 1"),
        "id == vocab": (_tokens([5, 96]), "token id 96 at position 1 is outside the model's vocabulary [0, 96)"),
        "long token ids": (_tokens(list(range(5, 22))), "prompt of 17 tokens is longer"),
        "long text": (_text("a" * 17), "prompt of 17 tokens is longer"),
        "char not in the tokenizer": (_text("caf\u00e9"), "character '\u00e9' at position 3"),
        "text past the model's vocab": (_text("a~"), "token id 98 at position 1"),
        "max_tokens 0": (_tokens([5, 6], max_tokens=0), "max_tokens must be >= 1"),
        "negative max_tokens": (_tokens([5, 6], max_tokens=-4), "max_tokens must be >= 1"),
        "session_cache": (pb.DecodeRequest(session_cache="x", max_tokens=3,
                                           token_content=pb.DecodeRequest.TokenContent(token_ids=[5])),
                          "session_cache is not supported"),
    }
    try:
        client = _Client(port)
        raw_decode = client.channel.unary_stream("/jetstream_proto.Orchestrator/Decode")
        for name, (request, message) in cases.items():
            err = client.status_of(request)
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, (name, err)
            assert message in err.details(), (name, err.details())
            assert client.decode(_tokens(prompts[0])) == expected, name
        # text_content whose bytes are not UTF-8 (a client can only send it as raw bytes)
        not_utf8 = b"\x2a\x03\x0a\x01\xff" + b"\x20\x03"  # text_content{text: b"\xff"}, max_tokens 3
        with pytest.raises(grpc.RpcError) as info:
            list(raw_decode(not_utf8, timeout=120))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "not a valid DecodeRequest" in info.value.details()
        assert "UTF-8" in info.value.details()
        assert client.decode(_tokens(prompts[0])) == expected
        assert client.decode(_text("hello")) != []  # text the tokenizer takes is served
        client.channel.close()
    finally:
        server.stop()


def test_check_request_accepts_what_the_engine_can_serve():
    limits = jetstream_adapter.RequestLimits(vocab_size=10, max_prefill_length=16, adds_bos=True,
                                             encode=lambda s: [1] * len(s))
    assert jetstream_adapter.check_request(_tokens([0, 9] * 7 + [3]), limits) is None  # 15 + BOS
    assert "prompt of 17 tokens" in jetstream_adapter.check_request(_tokens([1] * 16), limits)
    assert jetstream_adapter.check_request(_text("x" * 15), limits) is None
    no_tokenizer = jetstream_adapter.RequestLimits(10, 16, False, None)
    assert "send token_content" in jetstream_adapter.check_request(_text("abc"), no_tokenizer)


def test_requests_without_the_token_are_unauthenticated(tiny_engine, prompts, expected):
    port = portpicker.pick_unused_port()
    server = jetstream_adapter.run_server(tiny_engine, port, auth_token=TOKEN)
    pb = _pb()
    try:
        for token in (None, "wrong", TOKEN + "x", ""):
            client = _Client(port, token)
            assert client.status_of(_tokens(prompts[0])).code() == grpc.StatusCode.UNAUTHENTICATED
            with pytest.raises(grpc.RpcError) as info:
                client.stub.HealthCheck(pb.HealthCheckRequest(), metadata=client.metadata)
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
            client.channel.close()
        client = _Client(port, TOKEN)
        assert client.stub.HealthCheck(pb.HealthCheckRequest(), metadata=client.metadata).is_live
        assert client.decode(_tokens(prompts[0])) == expected
        client.channel.close()
    finally:
        server.stop()


def test_overload_gets_resource_exhausted_and_the_server_recovers(
        tiny_engine, prompts, expected, monkeypatch):
    """--slots 4 + --max-queued-requests 0: with prefill held, four requests are in flight and the
    fifth is refused; once they finish, requests are served again."""
    prefill = tiny_engine.prefill
    release = threading.Event()

    def held_prefill(**kwargs):
        release.wait(timeout=120)
        return prefill(**kwargs)

    monkeypatch.setattr(tiny_engine, "prefill", held_prefill)
    port = portpicker.pick_unused_port()
    server = jetstream_adapter.run_server(tiny_engine, port, max_queued_requests=0)
    driver = server.driver
    assert driver.max_requests == tiny_engine.max_concurrent_decodes == 4
    client = _Client(port)
    try:
        with futures.ThreadPoolExecutor(4) as pool:
            held = [pool.submit(client.decode, _tokens(prompts[0])) for _ in range(4)]
            with driver.admission:
                assert driver.admission.wait_for(lambda: driver.in_flight == 4, timeout=120)
            err = client.status_of(_tokens(prompts[0]))
            assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "--max-queued-requests" in err.details()
            release.set()
            assert [f.result(timeout=120) for f in held] == [expected] * 4
        assert client.decode(_tokens(prompts[0])) == expected
        with driver.admission:
            assert driver.admission.wait_for(lambda: driver.in_flight == 0, timeout=120)
    finally:
        release.set()
        client.channel.close()
        server.stop()


def _error_line(capsys, argv) -> str:
    with pytest.raises(SystemExit) as info:
        serve.parse_args(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err.strip().splitlines()[-1]


def test_non_loopback_host_needs_a_token_or_insecure(capsys, monkeypatch):
    monkeypatch.delenv(serve.TOKEN_ENV, raising=False)
    line = _error_line(capsys, ["--checkpoint", FIXTURE, "--host", "0.0.0.0"])
    assert "--host 0.0.0.0 is not a loopback address" in line and "--auth-token" in line
    assert "--insecure" in line
    for host in ("127.0.0.1", "localhost", "::1", "[::1]", "127.0.0.2"):
        assert serve.parse_args(["--checkpoint", FIXTURE, "--host", host]).auth_token is None
    args = serve.parse_args(["--checkpoint", FIXTURE, "--host", "0.0.0.0", "--insecure"])
    assert args.insecure and args.auth_token is None
    args = serve.parse_args(["--checkpoint", FIXTURE, "--host", "0.0.0.0", "--auth-token", TOKEN])
    assert args.auth_token == TOKEN
    monkeypatch.setenv(serve.TOKEN_ENV, TOKEN)
    assert serve.parse_args(["--checkpoint", FIXTURE, "--host", "10.1.2.3"]).auth_token == TOKEN
    with pytest.raises(ValueError, match="not a loopback address"):
        jetstream_adapter.run_server(None, 0, host="0.0.0.0")  # refused before the engine is used


@pytest.fixture()
def quickstart_export(tmp_path):
    """Like the quickstart's hf_actor: char tokenizer, max_position_embeddings 64."""
    for name in ("config.json", "model.safetensors"):
        shutil.copy(os.path.join(FIXTURE, name), tmp_path / name)
    config = json.loads((tmp_path / "config.json").read_text())
    config["max_position_embeddings"] = 64
    (tmp_path / "config.json").write_text(json.dumps(config))
    CharTokenizer().save(str(tmp_path))
    return str(tmp_path)


def test_default_lengths_fit_the_quickstart_export(quickstart_export, capsys):
    args = serve.parse_args(["--checkpoint", quickstart_export])
    assert (args.max_target_length, args.max_prefill_length) == (64, 32)
    assert capsys.readouterr().err == ""
    args = serve.parse_args(["--checkpoint", quickstart_export, "--max-target-length", "128"])
    assert (args.max_target_length, args.max_prefill_length) == (128, 64)
    assert [serve.default_prefill_length(t) for t in (16, 17, 32, 64, 100, 1024, 4096)] == [
        None, 16, 16, 32, 32, 512, 512]


def test_inconsistent_length_flags_are_one_line_errors(quickstart_export, capsys):
    line = _error_line(capsys, ["--checkpoint", quickstart_export, "--max-prefill-length", "512"])
    assert "--max-prefill-length 512 must be smaller than --max-target-length 64" in line
    line = _error_line(capsys, ["--checkpoint", quickstart_export, "--max-prefill-length", "64",
                                "--max-target-length", "64"])
    assert "--max-prefill-length 64 must be smaller than --max-target-length 64" in line
    line = _error_line(capsys, ["--checkpoint", quickstart_export, "--max-prefill-length", "24"])
    assert "--max-prefill-length 24 must be one of" in line
    line = _error_line(capsys, ["--checkpoint", quickstart_export, "--max-target-length", "16"])
    assert "--max-target-length 16" in line and "--max-prefill-length" in line
    for flag, value in (("--slots", "0"), ("--max-queued-requests", "-1"), ("--temperature", "-1"),
                        ("--top-p", "0"), ("--top-k", "-2"), ("--port", "70000")):
        line = _error_line(capsys, ["--checkpoint", quickstart_export, flag, value])
        assert f"{flag} must be" in line, line
    line = _error_line(capsys, ["--checkpoint", os.path.dirname(quickstart_export)])
    assert "config.json not found" in line


def test_the_quickstart_export_is_served_with_default_flags(quickstart_export):
    """The README's command on a quickstart-like export (only --port added): it starts, serves
    text through the char tokenizer, and refuses a prompt past the derived max prefill (32)."""
    port = portpicker.pick_unused_port()
    server = serve.start(serve.parse_args(["--checkpoint", quickstart_export, "--port", str(port)]))
    try:
        client = _Client(port)
        assert len(client.decode(_text("1+1=", max_tokens=4))) > 0
        err = client.status_of(_text("x" * 33))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "max prefill length 32" in err.details()
        client.channel.close()
    finally:
        server.stop()


def test_a_port_in_use_is_an_error_not_a_shared_port(tiny_engine, prompts, expected):
    port = portpicker.pick_unused_port()
    server = jetstream_adapter.run_server(tiny_engine, port)
    try:
        with pytest.raises(OSError, match=f"cannot listen on 127.0.0.1:{port}"):
            jetstream_adapter.run_server(tiny_engine, port)
        client = _Client(port)
        assert client.decode(_tokens(prompts[0])) == expected  # the first server still serves
        client.channel.close()
    finally:
        server.stop()
