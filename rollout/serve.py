"""Serve a Hugging Face checkpoint with JetStream's gRPC server on loopback.

    python -m rollout.serve --checkpoint DIR [--port 9000] [--slots 8] [--max-prefill-length 512]
        [--max-target-length N] [--dtype checkpoint] [--temperature 0]

DIR is a Hugging Face folder (config.json + safetensors + tokenizer); for a training run that is
`<run>/hf_actor`, which the trainer exports at the end (`trainer.export_hf`), not the orbax
`checkpoints/` folder. The model is served in the checkpoint's dtype (config.json
`torch_dtype`) unless --dtype says otherwise. --max-target-length (prompt + response) defaults
to the smaller of 1024 and the model's `max_position_embeddings`; a larger value is served with
a warning, as positions past the model's range were never trained. Models without a BOS token
get their prompts as sent (nothing prepended).

Needs the `jetstream` extra (`pip install 'google-jetstream==0.2.2'`). Clients talk
`jetstream.core.proto.jetstream_pb2_grpc.OrchestratorStub(...).Decode(DecodeRequest(...))`,
with `text_content` (tokenized here by the checkpoint's own tokenizer) or `token_content`.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

_DEFAULT_TARGET = 1024


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m rollout.serve", description=__doc__.split("\n")[0])
    p.add_argument("--checkpoint", required=True,
                   help="Hugging Face folder (config.json + safetensors), e.g. <run>/hf_actor")
    p.add_argument("--port", type=int, default=9000)
    p.add_argument("--host", default="127.0.0.1", help="bind address (default loopback)")
    p.add_argument("--slots", type=int, default=8, help="max_concurrent_decodes")
    p.add_argument("--max-prefill-length", type=int, default=512)
    p.add_argument("--max-target-length", type=int, default=None,
                   help=f"prompt + response tokens (default: min({_DEFAULT_TARGET}, max_position_embeddings))")
    p.add_argument("--dtype", default="checkpoint",
                   help="float32 | bfloat16 | checkpoint (config.json torch_dtype; the default)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


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


def start(args):
    """Builds the engine and starts the server; returns the JetStreamServer."""
    from ._engine import Engine
    from .jetstream_adapter import run_server

    dtype = checkpoint_dtype(args.checkpoint) if args.dtype == "checkpoint" else args.dtype
    engine = Engine.from_pretrained(
        args.checkpoint, max_concurrent_decodes=args.slots,
        max_prefill_length=args.max_prefill_length,
        max_target_length=target_length(args.checkpoint, args.max_target_length),
        dtype=dtype, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
        seed=args.seed)
    return run_server(engine, args.port, host=args.host)


def main(argv=None):
    from jaxrl_llm._cli import skip_absent_tpu

    skip_absent_tpu()  # before JAX starts: a machine without a TPU does not start libtpu
    args = parse_args(argv)
    server = start(args)
    print(f"JetStream gRPC server on {args.host}:{args.port} serving {args.checkpoint}", flush=True)
    server.wait_for_termination()


if __name__ == "__main__":
    main()
