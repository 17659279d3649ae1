"""Compile one Qwen3-30B-A3B sparse MLP (router + dispatch), forward and backward, for a TPU slice
on a CPU machine, and print its per-chip memory and collectives (docs/scaling.md, "Mixture-of-
experts: experts on the `fsdp` axis").

    python scripts/tpu/aot_moe_layer.py v5p:2x4x4 32 4096 ep          # experts on fsdp (the rules)
    python scripts/tpu/aot_moe_layer.py v5p:2x4x4 32 4096 replicated  # the layout before EP

Arguments: topology, fsdp size, tokens per chip, `ep` (the training rules) or `replicated` (the
`expert` axis on no mesh axis). bf16 activations and weights as `ShapeDtypeStruct`s, so nothing is
allocated; one layer takes 2-5 minutes to compile on a 2-core machine. The whole model's
programs: `aot_compile.py --model=qwen3-30b-a3b` (docs/aot/).
"""
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.experimental import topologies  # noqa: E402

import sharding  # noqa: E402
from jaxrl_llm.models import _decoder  # noqa: E402

EXPERTS, HIDDEN, EXPERT_WIDTH, TOP_K = 128, 2048, 768, 8  # Qwen3-30B-A3B


def main(argv) -> None:
    if len(argv) != 4 or argv[3] not in ("ep", "replicated"):
        raise SystemExit(__doc__)
    topo, fsdp, tokens_per_chip, layout = argv[0], int(argv[1]), int(argv[2]), argv[3]
    rules = "train" if layout == "ep" else tuple(
        (name, None) if name == "expert" else (name, axes) for name, axes in sharding.TRAIN_RULES)
    devices = list(topologies.get_topology_desc(platform="tpu", topology_name=topo).devices)
    n = len(devices)
    mesh = sharding.make_mesh((n // fsdp, fsdp, 1), devices=devices)

    def sds(shape, axes):
        return jax.ShapeDtypeStruct(shape, jnp.bfloat16,
                                    sharding=sharding.logical_sharding(mesh, axes, rules, shape))

    x = sds((n, tokens_per_chip, HIDDEN), ("batch", "length", "embed"))
    gate = sds((HIDDEN, EXPERTS), ("embed", "expert"))
    kernels = (sds((EXPERTS, HIDDEN, EXPERT_WIDTH), ("expert", "embed", "mlp")),
               sds((EXPERTS, HIDDEN, EXPERT_WIDTH), ("expert", "embed", "mlp")),
               sds((EXPERTS, EXPERT_WIDTH, HIDDEN), ("expert", "mlp", "embed")))
    print("expert kernel spec", kernels[0].sharding.spec, "x", x.sharding.spec, flush=True)

    def layer(x, gate, kernels):
        flat = x.reshape(-1, HIDDEN)
        logits = jnp.einsum("te,eE->tE", flat, gate, preferred_element_type=jnp.float32)
        weights, ids = _decoder.route(logits, TOP_K, True)
        return jnp.sum(_decoder.expert_mix(flat, ids, weights, kernels).astype(jnp.float32) ** 2)

    t0 = time.time()
    with sharding.use_rules(mesh, rules):
        compiled = jax.jit(jax.grad(layer, argnums=(0, 1, 2))).lower(x, gate, kernels).compile()
    m = compiled.memory_analysis()
    print(f"{layout} {topo} fsdp={fsdp} tokens/chip={tokens_per_chip}: compile {time.time() - t0:.1f}s; "
          f"per chip: args {m.argument_size_in_bytes / 2**20:.1f} MiB, temp {m.temp_size_in_bytes / 2**30:.2f} GiB, "
          f"out {m.output_size_in_bytes / 2**20:.1f} MiB", flush=True)
    hlo = compiled.as_text()
    print("collectives:", {c: hlo.count(c) for c in ("all-gather", "reduce-scatter", "all-reduce", "all-to-all")})


if __name__ == "__main__":
    main(sys.argv[1:])
