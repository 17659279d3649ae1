"""JetStream 0.2.2 conformance: our engine under JetStream's orchestrator and gRPC server.

Needs the `jetstream` extra (google-jetstream==0.2.2), which the test set-up installs; these tests
are not skipped when it is missing.
"""
import asyncio
import logging
import os
import sys

import grpc
import numpy as np
import portpicker
import pytest

import rollout
from conftest import greedy_reference
from rollout import jetstream_adapter

FIXTURE = os.path.join(os.path.dirname(__file__), "..", "fixtures", "models", "qwen2")


def test_import_does_not_load_jetstream_or_tensorflow():
    import subprocess
    code = "import rollout, sys; print('jetstream' in sys.modules, 'tensorflow' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert out.stdout.split()[-2:] == ["False", "False"]


def test_adapter_patches_delete_pytree_and_restores_root_logger():
    root = logging.getLogger()
    level = root.level
    handlers = list(root.handlers)
    js = jetstream_adapter.import_jetstream()
    assert root.level == level and root.handlers == handlers
    import jax.numpy as jnp
    x = jnp.ones(3)
    js.orchestrator.delete_pytree({"a": x})  # 0.2.2's own version raises on current JAX
    assert x.is_deleted()


async def _decode_all(orch, js, ids, max_tokens):
    req = js.jetstream_pb2.DecodeRequest(
        token_content=js.jetstream_pb2.DecodeRequest.TokenContent(token_ids=ids),
        max_tokens=max_tokens)
    out = []
    async for resp in orch.Decode(req):
        out.extend(resp.stream_content.samples[0].token_ids)
    return out


def test_jetstream_driver_returns_the_same_tokens_as_our_driver(tiny_engine, tiny_driver, prompts,
                                                               stop_id):
    js = jetstream_adapter.import_jetstream()
    jse = jetstream_adapter.as_jetstream_engine(tiny_engine)
    assert isinstance(jse, js.engine_api.Engine)
    driver = jetstream_adapter.make_driver(tiny_engine)
    orch = js.orchestrator.LLMOrchestrator(driver=driver)
    # the fixture has no BOS token: 0.2.2 would prepend bos_id (the pad id) to every request
    assert not jse.build_tokenizer(jse.get_tokenizer()).adds_bos
    try:
        async def run_all():  # concurrent requests: several slots, inserted at different steps
            return await asyncio.gather(*[_decode_all(orch, js, p, 8) for p in prompts[:5]])
        served = asyncio.run(run_all())
    finally:
        driver.stop()
    ours = tiny_driver.generate(prompts[:5], n=1, max_new_tokens=8,
                                sampling=rollout.SamplingParams(0.0))
    for i in range(5):
        n = ours.response_lengths[i]
        expected = ours.responses[i, :n].tolist()
        if ours.finish_reasons[i] == "stop":  # JetStream does not return the stop token
            expected = expected[:-1]
        assert served[i] == expected, i
        assert len(served[i]) > 0


def test_served_greedy_outputs_equal_the_in_process_engine():
    """Served in the checkpoint's dtype (no --dtype) with nothing prepended to BOS-less prompts:
    the gRPC answers are the trainer-side engine's greedy answers for the same token ids."""
    from rollout import serve
    port = portpicker.pick_unused_port()
    args = serve.parse_args(["--checkpoint", FIXTURE, "--port", str(port), "--slots", "2",
                             "--max-prefill-length", "16", "--max-target-length", "32", "--temperature", "0"])
    prompts = [[5, 17, 42, 8], [9], [30, 31, 32, 33, 34, 35, 36]]
    server = serve.start(args)
    js = jetstream_adapter.import_jetstream()
    try:
        with grpc.secure_channel(f"127.0.0.1:{port}", grpc.local_channel_credentials()) as channel:
            stub = js.jetstream_pb2_grpc.OrchestratorStub(channel)
            assert stub.HealthCheck(js.jetstream_pb2.HealthCheckRequest()).is_live
            got = []
            for ids in prompts:
                req = js.jetstream_pb2.DecodeRequest(
                    token_content=js.jetstream_pb2.DecodeRequest.TokenContent(token_ids=ids), max_tokens=5)
                got.append([t for r in stub.Decode(req, timeout=120) for t in r.stream_content.samples[0].token_ids])
    finally:
        server.stop()
    engine = rollout.Engine.from_pretrained(FIXTURE, max_concurrent_decodes=2, max_prefill_length=16,
                                            max_target_length=32, dtype="float32", temperature=0.0)
    ours = rollout.RolloutDriver(engine).generate(prompts, n=1, max_new_tokens=5,
                                                  sampling=rollout.SamplingParams(0.0))
    from jaxrl_llm.models import from_pretrained
    model = from_pretrained(FIXTURE)
    for i, ids in enumerate(prompts):
        assert got[i] == ours.responses[i, :ours.response_lengths[i]].tolist(), i
        assert got[i] == greedy_reference(model, ids, 5), i


def test_serve_defaults_to_the_checkpoints_dtype_and_positions(tmp_path, capsys):
    from rollout import serve
    assert serve.parse_args(["--checkpoint", FIXTURE]).dtype == "checkpoint"
    assert serve.checkpoint_dtype(FIXTURE) == "float32"
    (tmp_path / "config.json").write_text('{"torch_dtype": "bfloat16", "max_position_embeddings": 256}')
    assert serve.checkpoint_dtype(str(tmp_path)) == "bfloat16"
    assert serve.target_length(str(tmp_path), None) == 256
    assert capsys.readouterr().err == ""
    assert serve.target_length(str(tmp_path), 1024) == 1024
    assert "exceeds the model's max_position_embeddings 256" in capsys.readouterr().err


def test_serve_passes_the_low_precision_and_invariance_flags_to_the_engine():
    """--quantization, --kv-cache-dtype and --batch-invariant reach the served engine (defaults:
    none, the serving dtype, off); a bad value is a usage error."""
    from rollout import serve
    args = serve.parse_args(["--checkpoint", FIXTURE])
    assert (args.quantization, args.kv_cache_dtype, args.batch_invariant) == ("none", "auto", False)
    with pytest.raises(SystemExit):
        serve.parse_args(["--checkpoint", FIXTURE, "--kv-cache-dtype", "fp16"])
    engine = serve.build_engine(serve.parse_args([
        "--checkpoint", FIXTURE, "--slots", "2", "--max-prefill-length", "16", "--max-target-length", "32",
        "--dtype", "bfloat16", "--quantization", "int8", "--kv-cache-dtype", "fp8", "--batch-invariant"]))
    assert engine.quantization == "int8" and engine.batch_invariant
    assert str(engine.kv_cache_dtype) == "float8_e4m3fn"


def test_serve_names_the_hf_folder_when_given_something_else(tmp_path):
    from rollout import serve
    with pytest.raises(FileNotFoundError, match="hf_actor"):
        serve.checkpoint_dtype(str(tmp_path))


_SERVE_MANY = r"""
import json, sys
sys.setswitchinterval(1e-6)  # switch threads as often as possible: widens 0.2.2's race window
import grpc, portpicker
from rollout import serve, jetstream_adapter
fixture, requests = sys.argv[1], int(sys.argv[2])
port = portpicker.pick_unused_port()
server = serve.start(serve.parse_args([
    "--checkpoint", fixture, "--port", str(port), "--slots", "2", "--max-prefill-length", "16",
    "--max-target-length", "32", "--dtype", "float32", "--temperature", "0"]))
js = jetstream_adapter.import_jetstream()
with grpc.secure_channel(f"127.0.0.1:{port}", grpc.local_channel_credentials()) as channel:
    stub = js.jetstream_pb2_grpc.OrchestratorStub(channel)
    for i in range(requests):
        req = js.jetstream_pb2.DecodeRequest(
            token_content=js.jetstream_pb2.DecodeRequest.TokenContent(token_ids=[5, 17, 42, 8]),
            max_tokens=1 + i % 5)
        got = [t for r in stub.Decode(req, timeout=120) for t in r.stream_content.samples[0].token_ids]
        print(json.dumps(got), flush=True)
server.stop()
"""


def test_server_survives_slots_freed_during_a_generate_step():
    # JetStream 0.2.2's generate thread asserts that a slot is in use right after filling slots;
    # when the detokenize thread frees the last slot in between, the assertion kills the process
    # with SIGKILL. With a 1 us switch interval, unpatched 0.2.2 died within 110 requests in each
    # of four runs here. The server runs in a subprocess so that a kill fails this test only.
    import json
    requests = 200
    out = _run_stress(_SERVE_MANY, requests)
    assert out.returncode == 0, (out.returncode, out.stdout[-2000:], out.stderr[-4000:])
    got = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("[")]
    assert len(got) == requests
    from jaxrl_llm.models import from_pretrained
    full = greedy_reference(from_pretrained(FIXTURE), [5, 17, 42, 8], 5)  # no BOS prepended
    for i, tokens in enumerate(got):
        assert tokens == full[:1 + i % 5], i


_DRIVE_IN_PROCESS = r"""
import asyncio, json, sys
sys.setswitchinterval(1e-6)
from rollout import Engine, jetstream_adapter
fixture, repeats = sys.argv[1], int(sys.argv[2])
engine = Engine.from_pretrained(fixture, max_concurrent_decodes=4, max_prefill_length=16,
                                max_target_length=32, dtype="float32", temperature=0.0)
js = jetstream_adapter.import_jetstream()
prompts = [[5, 17, 42, 8], [3, 9], [11, 12, 13], [7], [20, 21, 22, 23, 24]]

async def decode(orch, ids):
    req = js.jetstream_pb2.DecodeRequest(
        token_content=js.jetstream_pb2.DecodeRequest.TokenContent(token_ids=ids), max_tokens=8)
    return [t async for r in orch.Decode(req) for t in r.stream_content.samples[0].token_ids]

async def decode_all(orch):
    return await asyncio.gather(*[decode(orch, p) for p in prompts])

for _ in range(repeats):
    driver = jetstream_adapter.make_driver(engine)
    try:  # asyncio.run closes its loop as soon as the last stream ends
        print(json.dumps(asyncio.run(decode_all(js.orchestrator.LLMOrchestrator(driver=driver)))),
              flush=True)
    finally:
        driver.stop()
"""


def _run_stress(script, *args):
    import subprocess
    return subprocess.run([sys.executable, "-c", script, FIXTURE, *map(str, args)],
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""})


def test_in_process_driver_survives_the_event_loop_closing_after_the_last_stream():
    # 0.2.2's close() posts two callbacks to the receiver's loop; asyncio.run may close the loop
    # after the first, and the second then raised in the detokenize thread (SIGKILL). Unpatched,
    # this died within 3 repeats in each of two runs here.
    import json
    repeats = 30
    out = _run_stress(_DRIVE_IN_PROCESS, repeats)
    assert out.returncode == 0, (out.returncode, out.stdout[-2000:], out.stderr[-4000:])
    runs = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("[")]
    assert len(runs) == repeats and all(r == runs[0] for r in runs)
    assert all(len(tokens) > 0 for tokens in runs[0])
