"""Serve a Hugging Face checkpoint with JetStream's gRPC server or an OpenAI-compatible HTTP API.

    python -m rollout.serve --checkpoint DIR [--api jetstream|openai] [--port 9000] [--slots 8]
        [--max-target-length N] [--max-prefill-length N] [--max-queued-requests 64]
        [--dtype checkpoint] [--temperature 0] [--host ADDR (--auth-token T | --insecure)]
        [--served-model-name NAME] [--tool-parser hermes]
        [--quantization none|fp8|int8] [--kv-cache-dtype auto|fp8] [--batch-invariant]

--api openai (see rollout/_openai.py and docs/rollout.md) serves `GET /v1/models`,
`POST /v1/chat/completions` and `POST /v1/completions` over a `RolloutServer` with the
checkpoint's tokenizer and chat template; requests carry their own sampling settings (the
--temperature/--top-k/--top-p/--seed flags are the JetStream server's), tool calls are parsed with
--tool-parser, and with --auth-token every request needs `Authorization: Bearer <token>`. The rest
past --slots + --max-queued-requests choices in flight a request gets HTTP 429. The rest of this
text is about the default, --api jetstream.

DIR is a Hugging Face folder (config.json + safetensors + tokenizer); for a training run that is
`<run>/hf_actor`, which the trainer exports at the end (`trainer.export_hf`), not the orbax
`checkpoints/` folder. The model is served in the checkpoint's dtype (config.json
`torch_dtype`) unless --dtype says otherwise. --max-target-length (prompt + response) defaults
to the smaller of 1024 and the model's `max_position_embeddings`; a larger value is served with
a warning, as positions past the model's range were never trained. --max-prefill-length (the
longest prompt) defaults to the largest padding bucket (16, 32, ..., 512) that is at most half the
target length, or 16. Models without a BOS token get their prompts as sent (nothing prepended).

Requests: malformed ones (no prompt, token ids outside the vocabulary, text the tokenizer cannot
encode, a prompt over --max-prefill-length, max_tokens < 1, a body that does not parse) get
INVALID_ARGUMENT; past --slots + --max-queued-requests requests in flight, RESOURCE_EXHAUSTED.
Binding an address other than loopback needs --auth-token (or the JAXRL_SERVE_TOKEN environment
variable, which keeps it out of `ps`) or --insecure; with a token, every call must carry gRPC
metadata `authorization: Bearer <token>` (else UNAUTHENTICATED). Off loopback the server speaks
plaintext gRPC: on an untrusted network put TLS in front of it (a proxy or an SSH tunnel).

Needs the `jetstream` extra (`pip install 'google-jetstream==0.2.2'`). Clients talk
`jetstream.core.proto.jetstream_pb2_grpc.OrchestratorStub(...).Decode(DecodeRequest(...))`,
with `text_content` (tokenized here by the checkpoint's own tokenizer) or `token_content`.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys

from jaxrl_llm.models import KV_CACHE_DTYPES
from jaxrl_llm.models._quant import QUANTIZATIONS

from ._engine import PREFILL_BUCKETS as _PREFILL_BUCKETS
from .jetstream_adapter import is_loopback  # imports no jetstream

_DEFAULT_TARGET = 1024
_DEFAULT_MAX_PREFILL = 512
TOKEN_ENV = "JAXRL_SERVE_TOKEN"


def parse_args(argv=None):
    """The command line, checked against the checkpoint: lengths resolved (`max_target_length`,
    `max_prefill_length` are ints), inconsistent flags a one-line usage error."""
    p = argparse.ArgumentParser(prog="python -m rollout.serve", description=__doc__.split("\n")[0])
    p.add_argument("--checkpoint", required=True,
                   help="Hugging Face folder (config.json + safetensors), e.g. <run>/hf_actor")
    p.add_argument("--api", choices=("jetstream", "openai"), default="jetstream",
                   help="jetstream: JetStream's gRPC (default); openai: OpenAI-compatible HTTP")
    p.add_argument("--served-model-name", default=None,
                   help="--api openai: the model name clients send (default: the checkpoint "
                        "folder's name)")
    p.add_argument("--tool-parser", default="hermes",
                   help="--api openai: the tool-call format parsed into tool_calls "
                        "(hermes, llama3_json, qwen3_coder)")
    p.add_argument("--max-n", type=int, default=None,
                   help="--api openai: the largest `n` a request may ask (default: --slots)")
    p.add_argument("--port", type=int, default=9000)
    p.add_argument("--host", default="127.0.0.1",
                   help="bind address (default loopback; others need --auth-token or --insecure)")
    p.add_argument("--auth-token", default=os.environ.get(TOKEN_ENV) or None,
                   help=f"require gRPC metadata 'authorization: Bearer <token>' on every call "
                        f"(default: ${TOKEN_ENV})")
    p.add_argument("--insecure", action="store_true",
                   help="allow a non-loopback --host without --auth-token")
    p.add_argument("--slots", type=int, default=8, help="max_concurrent_decodes")
    p.add_argument("--max-queued-requests", type=int, default=64,
                   help="requests waiting for a slot before new ones get RESOURCE_EXHAUSTED")
    p.add_argument("--max-prefill-length", type=int, default=None,
                   help=f"longest prompt, a padding bucket {_PREFILL_BUCKETS[:6]}... (default: "
                        f"the largest one <= min({_DEFAULT_MAX_PREFILL}, max-target-length / 2))")
    p.add_argument("--max-target-length", type=int, default=None,
                   help=f"prompt + response tokens (default: min({_DEFAULT_TARGET}, max_position_embeddings))")
    p.add_argument("--dtype", default="checkpoint",
                   help="float32 | bfloat16 | checkpoint (config.json torch_dtype; the default)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quantization", choices=QUANTIZATIONS, default="none",
                   help="the engine's dense weights: none | fp8 | int8 (docs/rollout.md, 'Low-precision rollout')")
    p.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
                   help="the decode KV cache: auto (the serving dtype) | fp8 (e4m3, half the bytes)")
    p.add_argument("--batch-invariant", action="store_true",
                   help="results independent of which requests share a batch (rollout.batch_invariant)")
    args = p.parse_args(argv)
    _check(p, args)
    return args


def default_prefill_length(max_target_length: int) -> int | None:
    """The largest padding bucket <= min(512, max_target_length // 2), else 16 when it still fits
    below the target; None when the target is too short for any prompt bucket."""
    fits = [b for b in _PREFILL_BUCKETS if b <= min(_DEFAULT_MAX_PREFILL, max_target_length // 2)]
    if fits:
        return fits[-1]
    return _PREFILL_BUCKETS[0] if max_target_length > _PREFILL_BUCKETS[0] else None


def _check(p: argparse.ArgumentParser, args) -> None:
    for flag, value, ok, want in (
            ("--slots", args.slots, args.slots >= 1, ">= 1"),
            ("--port", args.port, 0 <= args.port <= 65535, "in 0..65535"),
            ("--max-queued-requests", args.max_queued_requests, args.max_queued_requests >= 0, ">= 0"),
            ("--temperature", args.temperature,
             math.isfinite(args.temperature) and args.temperature >= 0, ">= 0 (0 = greedy)"),
            ("--top-k", args.top_k, args.top_k >= -1, ">= 1, or -1/0 to keep all tokens"),
            ("--top-p", args.top_p, 0.0 < args.top_p <= 1.0, "in (0, 1]")):
        if not ok:
            p.error(f"{flag} must be {want}, got {value}")
    if args.api == "openai":
        from jaxrl_llm.agent import get_tool_parser
        try:
            get_tool_parser(args.tool_parser)
        except ValueError as e:
            p.error(f"--tool-parser: {e}")
        if args.max_n is not None and args.max_n < 1:
            p.error(f"--max-n must be >= 1, got {args.max_n}")
        if args.served_model_name is None:
            args.served_model_name = os.path.basename(os.path.normpath(args.checkpoint))
    if args.auth_token == "":
        args.auth_token = None
    if not is_loopback(args.host) and args.auth_token is None and not args.insecure:
        p.error(f"--host {args.host} is not a loopback address: set --auth-token (or ${TOKEN_ENV}) "
                f"so that only clients with the token are served, or pass --insecure")
    try:
        target = target_length(args.checkpoint, args.max_target_length)
    except (FileNotFoundError, ValueError) as e:
        p.error(str(e))
    source = "" if args.max_target_length is not None else " (its default, from the checkpoint)"
    prefill = args.max_prefill_length
    if prefill is None:
        prefill = default_prefill_length(target)
        if prefill is None:
            p.error(f"--max-target-length {target}{source} leaves no room for a prompt: it must "
                    f"exceed {_PREFILL_BUCKETS[0]}, the smallest --max-prefill-length")
    elif prefill not in _PREFILL_BUCKETS:
        p.error(f"--max-prefill-length {prefill} must be one of JetStream's padding buckets "
                f"{', '.join(map(str, _PREFILL_BUCKETS))}")
    elif prefill >= target:
        p.error(f"--max-prefill-length {prefill} must be smaller than --max-target-length "
                f"{target}{source}: lower --max-prefill-length or raise --max-target-length")
    args.max_target_length, args.max_prefill_length = target, prefill


def _hf_config(path: str) -> dict:
    file = os.path.join(path, "config.json")
    if not os.path.isfile(file):
        raise FileNotFoundError(
            f"{file} not found: --checkpoint must be a Hugging Face folder (config.json + "
            "safetensors), e.g. a run's hf_actor folder that trainer.export_hf writes at the end")
    with open(file, encoding="utf-8") as f:
        return json.load(f)


def checkpoint_dtype(path: str) -> str:
    """The dtype the checkpoint was saved in (config.json `torch_dtype`, or `dtype`)."""
    cfg = _hf_config(path)
    return str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32")


def target_length(path: str, requested: int | None) -> int:
    """--max-target-length, defaulting to what the model's positions allow; warns past them."""
    positions = _hf_config(path).get("max_position_embeddings")
    if requested is None:
        return _DEFAULT_TARGET if positions is None else min(_DEFAULT_TARGET, int(positions))
    if positions is not None and requested > int(positions):
        print(f"warning: --max-target-length {requested} exceeds the model's "
              f"max_position_embeddings {positions}; tokens past it are outside the trained range",
              file=sys.stderr, flush=True)
    return requested


def build_engine(args):
    """The served `Engine`, from `parse_args`'s result."""
    from ._engine import Engine

    dtype = checkpoint_dtype(args.checkpoint) if args.dtype == "checkpoint" else args.dtype
    return Engine.from_pretrained(
        args.checkpoint, max_concurrent_decodes=args.slots,
        max_prefill_length=args.max_prefill_length, max_target_length=args.max_target_length,
        dtype=dtype, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
        seed=args.seed, quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype,
        batch_invariant=args.batch_invariant)


def start(args):
    """Builds the engine and starts the server; returns the `jetstream_adapter.Server`, or with
    --api openai the `OpenAIServer` (its `.server` the `RolloutServer`)."""
    from .jetstream_adapter import run_server

    engine = build_engine(args)
    if args.api == "openai":
        from jaxrl_llm.models import load_tokenizer

        from ._openai import OpenAIServer
        from ._server import RolloutServer

        tokenizer = engine.tokenizer if getattr(engine, "tokenizer", None) is not None \
            else load_tokenizer(args.checkpoint)
        server = RolloutServer(engine)
        try:
            return OpenAIServer(server, tokenizer, model_name=args.served_model_name,
                                host=args.host, port=args.port, tool_parser=args.tool_parser,
                                auth_token=args.auth_token,
                                max_n=args.max_n if args.max_n is not None else args.slots,
                                max_in_flight=args.slots + args.max_queued_requests)
        except BaseException:
            server.close()
            raise
    return run_server(engine, args.port, host=args.host, auth_token=args.auth_token,
                      insecure=args.insecure, max_queued_requests=args.max_queued_requests)


def main(argv=None):
    from jaxrl_llm._cli import skip_absent_tpu

    skip_absent_tpu()  # before JAX starts: a machine without a TPU does not start libtpu
    args = parse_args(argv)
    try:
        server = start(args)
    except OSError as e:  # e.g. the port is taken
        sys.exit(f"error: {e}")
    auth = "token required" if args.auth_token else "no authentication"
    if args.api == "openai":
        print(f"OpenAI-compatible API on http://{args.host}:{server.port}/v1 serving "
              f"{args.checkpoint} as {args.served_model_name!r} (max prefill "
              f"{args.max_prefill_length}, max target {args.max_target_length} tokens; {auth})",
              flush=True)
        try:
            server.wait()
        except KeyboardInterrupt:
            pass
        finally:
            server.close()
            server.server.close()
        return
    print(f"JetStream gRPC server on {args.host}:{server.port} serving {args.checkpoint} "
          f"(max prefill {args.max_prefill_length}, max target {args.max_target_length} tokens; "
          f"{auth})", flush=True)
    try:
        server.wait_for_termination()  # stops the server when it returns or raises
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
