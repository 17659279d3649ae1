"""Serve a Hugging Face checkpoint with JetStream's gRPC server on loopback.

    python -m rollout.serve --checkpoint DIR [--port 9000] [--slots 8] [--max-prefill-length 512]
        [--max-target-length 1024] [--dtype bfloat16] [--temperature 0]

Needs the `jetstream` extra (`pip install 'google-jetstream==0.2.2'`). Clients talk
`jetstream.core.proto.jetstream_pb2_grpc.OrchestratorStub(...).Decode(DecodeRequest(...))`.
"""
from __future__ import annotations

import argparse


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m rollout.serve", description=__doc__.split("\n")[0])
    p.add_argument("--checkpoint", required=True, help="Hugging Face folder (config.json + safetensors)")
    p.add_argument("--port", type=int, default=9000)
    p.add_argument("--host", default="127.0.0.1", help="bind address (default loopback)")
    p.add_argument("--slots", type=int, default=8, help="max_concurrent_decodes")
    p.add_argument("--max-prefill-length", type=int, default=512)
    p.add_argument("--max-target-length", type=int, default=1024)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def start(args):
    """Builds the engine and starts the server; returns the JetStreamServer."""
    from ._engine import Engine
    from .jetstream_adapter import run_server

    engine = Engine.from_pretrained(
        args.checkpoint, max_concurrent_decodes=args.slots,
        max_prefill_length=args.max_prefill_length, max_target_length=args.max_target_length,
        dtype=args.dtype, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
        seed=args.seed)
    return run_server(engine, args.port, host=args.host)


def main(argv=None):
    args = parse_args(argv)
    server = start(args)
    print(f"JetStream gRPC server on {args.host}:{args.port} serving {args.checkpoint}", flush=True)
    server.wait_for_termination()


if __name__ == "__main__":
    main()
