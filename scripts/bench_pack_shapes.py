"""Forward + backward time of the decoder on one batch of short rows, padded vs packed at several
pack lengths: where a packed micro-batch's time goes when its rows are short.

    python scripts/bench_pack_shapes.py                       # SmolLM2-135M shape, 256 rows
    python scripts/bench_pack_shapes.py --rows 256 --row-len 68 --padded-len 192 \
        --pack-lens 32768 8192 2048 --out pack_shapes.json

The workload is the SmolLM2 gym run's (docs/benchmarks.md §10): 256 rows of `--row-len` real
tokens (prompt + response), which the padded layout holds as [rows, padded_len] and the packed
layout as [packs, L] with rows laid end to end (segment ids, positions restarting per row,
`packed=` rows per pack). Timed: `jax.grad` of the sum of squared final hidden states at real
tokens (the decoder's forward and backward; no lm head, no optimizer), bf16 compute, fp32
params, random init, `--repeats` runs after one compile-and-run. Prints one JSON line per layout
and writes them to `--out`.
"""
from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrl_llm.models import ModelConfig, init_model

SMOLLM2 = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
               num_attention_heads=9, num_key_value_heads=3, head_dim=64, model_type="llama",
               tie_word_embeddings=True, rope_theta=100000.0)


def layout(rows: int, row_len: int, length: int, per: int | None = None):
    """(input_ids, segment ids, positions, rows per sequence) for `rows` rows of `row_len` tokens
    laid end to end in sequences of `length` tokens, `per` rows each (default: as many as fit)."""
    per = per or max(length // row_len, 1)
    n = -(-rows // per)
    seg = np.zeros((n, length), np.int32)
    pos = np.zeros((n, length), np.int32)
    for r in range(rows):
        s, j = divmod(r, per)
        seg[s, j * row_len:(j + 1) * row_len] = j + 1
        pos[s, j * row_len:(j + 1) * row_len] = np.arange(row_len)
    ids = (np.arange(n * length).reshape(n, length) * 7919 % 30000).astype(np.int32)
    return jnp.asarray(ids), jnp.asarray(seg), jnp.asarray(pos), per


def time_layout(model, ids, seg, pos, packed, repeats: int) -> tuple[float, float]:
    graph, params = nnx.split(model)

    @jax.jit
    def step(p):
        def loss(p):
            h = nnx.merge(graph, p).hidden_states(ids, attention_mask=seg, positions=pos, packed=packed)
            return jnp.sum(jnp.where(seg[..., None] != 0, h.astype(jnp.float32) ** 2, 0.0))
        return jax.grad(loss)(p)

    t0 = time.perf_counter()
    jax.block_until_ready(step(params))
    first = time.perf_counter() - t0
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(step(params))
        times.append(time.perf_counter() - t0)
    return first, float(np.median(times))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=256)
    p.add_argument("--row-len", type=int, default=68, help="real tokens per row (prompt + response)")
    p.add_argument("--padded-len", type=int, default=192, help="the padded layout's row length")
    p.add_argument("--pack-lens", type=int, nargs="+", default=[32768, 8192, 2048])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--tiny", action="store_true", help="a 2-layer 64-wide model (CPU check)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    shape = dict(SMOLLM2, num_hidden_layers=2, hidden_size=64, intermediate_size=128, vocab_size=512,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16) if args.tiny else SMOLLM2
    model = init_model(ModelConfig(**shape, dtype=jnp.bfloat16, param_dtype=jnp.float32))
    records = []
    cases = [("padded", args.padded_len)] + [("packed", L) for L in args.pack_lens]
    for mode, length in cases:
        if mode == "padded":
            ids, seg, pos, _ = layout(args.rows, args.row_len, args.padded_len, per=1)
            seg = jnp.where(seg != 0, 1, 0)  # one sequence per row, right padding
            packed = False
        else:
            ids, seg, pos, per = layout(args.rows, args.row_len, length)
            packed = per
        if args.tiny:
            ids = ids % shape["vocab_size"]
        first, median = time_layout(model, ids, seg, pos, packed, args.repeats)
        rec = {"mode": mode, "seq_len": length, "sequences": int(ids.shape[0]),
               "rows_per_sequence": 1 if mode == "padded" else int(packed),
               "tokens_computed": int(ids.size), "real_tokens": args.rows * args.row_len,
               "first_s": first, "median_s": median, "device": jax.devices()[0].device_kind,
               "model": "tiny" if args.tiny else "smollm2-135m-shape"}
        records.append(rec)
        print(json.dumps(rec), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(records, f, indent=1)


if __name__ == "__main__":
    main()
