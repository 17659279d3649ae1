"""Ahead-of-time compilation of a run's programs for a real TPU slice, on a machine without one.

With `libtpu` installed (`pip install -e ".[tpu]"`), `jax.experimental.topologies` describes a
TPU slice on any host; every program of an RL step is then lowered for the config's meshes over
that slice and compiled by the real TPU compiler (nothing is allocated, weights are
`ShapeDtypeStruct`s). For each program this prints per-chip memory from the compiled
executable's `memory_analysis()` and FLOPs / bytes accessed from its `cost_analysis()`:

    python scripts/tpu/aot_compile.py --topology=v5e:2x4 --model=qwen2.5-1.5b \\
        --config=configs/grpo_gsm8k.py --config.mesh.fsdp=-1 --out=runs/aot_1.5b_v5e-8.json

`--model`: a Qwen2.5 preset or `qwen3-30b-a3b` (Qwen3-30B-A3B's config.json: 128 experts, top-8;
the training and rollout rules put the experts on `fsdp`, so `mesh.fsdp` must divide 128).

Programs (those the config uses): `actor_update` (one optimizer step over one mini-batch, with
its micro-batch scan), `log_prob` (the actor's / reference's log-probs of one step's rollouts),
`critic_update` and `values` (GAE), `prefill`, `insert`, `generate` (one decode step of every
slot), `decode_loop` (the RL driver's on-device loop) and `weight_sync` (trainer -> rollout).

Memory: a colocated run keeps every role's state resident while any one program runs (actor
params + AdamW moments, the reference weights, the engine's weights unless shared zero-copy, the
engine's KV cache). `peak_bytes` = the program's arguments + outputs - aliased + temporaries +
those other residents, per chip, against the chip's HBM; `fits` says whether it is under and
`over_by_bytes` by how much it is not.

Time: XLA's cost analysis counts the body of a loop once (the layer scan, the micro-batch scan),
so FLOPs and bytes are measured on the same programs for 1 and 2 unrolled layers and one
micro-batch and extrapolated linearly in layers and micro-batches (exact for programs whose
cost is affine in both, as these are). `roofline_s` = max(FLOPs / peak FLOP/s, bytes / HBM
bandwidth) per chip: a lower bound that leaves out collectives over ICI and kernel overheads.
The decode loop's trip count is dynamic: its figures are per decode step (= `generate`).
`--no-cost` skips that pass; `--add-cost=REPORT.json` runs it later on a saved report (only the
1- and 2-layer copies are compiled, from the report's own command line) and writes it back.

`--extend=REPORT.json --programs=a,b` compiles programs a saved report lacks (from its own
command line) and adds them.

Sleep (colocated modes): the engine frees its decode state (KV cache) and its own weight copy
while the actor trains; the report's `sleep` entry (`sleep_savings`) gives each training
program's peak with the engine resident and asleep, and `--table` a table of it.

`--check`: exit 1 when a program does not fit (the TPU launch script runs this before booking
anything). The compile needs libtpu; without it the script says so and exits 2.
"""
import os

# Before JAX starts: stay on CPU (the TPU is only described), skip the GCE metadata lookups a TPU
# VM would answer, and let several processes open libtpu at once (it holds a lock file).
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import types  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import rollout  # noqa: E402
import sharding  # noqa: E402
from jaxrl_llm import algos, config as C, models  # noqa: E402
from jaxrl_llm.algos import _logprobs  # noqa: E402
from jaxrl_llm.workers import _common, _host, _roles, _step  # noqa: E402

GiB = 1 << 30


@dataclasses.dataclass(frozen=True)
class Chip:
    """Published per-chip figures (cloud.google.com/tpu/docs/v5e, /v5p, /v6e, /v4)."""

    name: str
    hbm_bytes: int
    bf16_flops: float  # peak FLOP/s
    hbm_bandwidth: float  # bytes/s


CHIPS = {
    "TPU v4": Chip("v4", 32 * GiB, 275e12, 1228e9),
    "TPU v5 lite": Chip("v5e", 16 * GiB, 197e12, 819e9),
    "TPU v5": Chip("v5p", 95 * GiB, 459e12, 2765e9),
    "TPU v6 lite": Chip("v6e", 32 * GiB, 918e12, 1638e9),
}

MODEL_PRESETS = {f"qwen2.5-{k}": v for k, v in models.QWEN25_SHAPES.items()}
# presets given as a Hugging Face config.json dict (models.config_from_hf reads them)
HF_PRESETS = {
    # Qwen/Qwen3-30B-A3B's config.json (models.QWEN3_MOE_SHAPES plus the keys config_from_hf reads
    # from a checkpoint): 128 experts, 8 per token, every layer sparse
    "qwen3-30b-a3b": dict(
        models.QWEN3_MOE_SHAPES["30b-a3b"], architectures=["Qwen3MoeForCausalLM"], decoder_sparse_step=1,
        mlp_only_layers=[], hidden_act="silu", attention_bias=False),
}
PROGRAMS = ("actor_update", "log_prob", "critic_update", "values", "prefill", "insert", "generate",
            "decode_loop", "weight_sync")


class LibtpuMissing(RuntimeError):
    pass


def topology_devices(name: str):
    """The devices of TPU slice `name` (e.g. "v5e:2x4", "v5p:2x2x2"), described on this host."""
    try:
        import libtpu  # noqa: F401
    except ImportError:
        raise LibtpuMissing("libtpu is not installed: pip install -e '.[tpu]' (it pins the jax/libtpu "
                            "pair); the TPU compiler comes with it") from None
    from jax.experimental import topologies
    try:
        return list(topologies.get_topology_desc(platform="tpu", topology_name=name).devices)
    except Exception as e:  # noqa: BLE001 - libtpu's errors are runtime errors of several kinds
        raise ValueError(f"--topology={name!r}: libtpu cannot describe it ({e}); use e.g. v5e:2x4, "
                         f"v5p:2x2x2, v6e:4x4") from None


def model_config(run, preset: str) -> models.ModelConfig:
    """The architecture: a preset (Qwen2.5 shapes, or a config.json dict of HF_PRESETS), the
    config's `model.path` config.json, or `model.init`."""
    m = run.model
    kinds = dict(dtype=m.dtype, param_dtype=m.param_dtype, remat=m.remat,
                 train_attention=m.train_attention, decode_attention=m.decode_attention)
    if preset:
        if preset in HF_PRESETS:
            return models.config_from_hf(HF_PRESETS[preset], **kinds)
        if preset not in MODEL_PRESETS:
            raise ValueError(f"--model={preset!r}; choose one of {sorted(MODEL_PRESETS) + sorted(HF_PRESETS)} "
                             f"or leave it empty to use the config's model")
        return models.ModelConfig(model_type="qwen2", attention_bias=True, rope_theta=1e6,
                                  max_position_embeddings=32768, **MODEL_PRESETS[preset], **kinds)
    if m.path:
        hf = json.loads((Path(m.path) / "config.json").read_text())
        return models.config_from_hf(hf, **kinds)
    tok = models.CharTokenizer() if m.tokenizer == "char" else models.load_tokenizer(m.tokenizer)
    return _common.model_config_for(m, tok.vocab_size)


def _with_shardings(tree, shardings):
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


def abstract_params(cfg, mesh, *, value_head=False):
    """(graphdef, abstract Param state with the training shardings)."""
    graphdef, state = nnx.split(models.abstract_model(cfg, value_head=value_head), nnx.Param)
    shardings = nnx.to_pure_dict(sharding.state_shardings(state, mesh, sharding.TRAIN_RULES))
    pure = _with_shardings(nnx.to_pure_dict(state), shardings)
    nnx.replace_by_pure_dict(state, pure)
    return graphdef, state


def abstract_train_state(params, tx, mesh):
    """TrainState of ShapeDtypeStructs placed as `_common.init_train_state` places the real one."""
    replicated = NamedSharding(mesh, PartitionSpec())
    opt_state = _with_shardings(jax.eval_shape(tx.init, params), _common.opt_state_shardings(tx, params, mesh))
    return _common.TrainState(params, opt_state, jax.ShapeDtypeStruct((), jnp.int32, sharding=replicated))


def micro_batch(mesh, rows: int, per_device: int, fields: dict, n_micro=None):
    """(abstract [n_micro, micro, ...] batch as `_step.micro_batches` lays it out, micro-batches
    of the real program, micro). fields: name -> (trailing shape, dtype); n_micro None: all."""
    micro = _step.micro_size_for(rows, per_device, _common.data_parallel_size(mesh))
    n = rows // micro if n_micro is None else n_micro
    return {k: jax.ShapeDtypeStruct((n, micro) + shape, dtype,
                                    sharding=_common.batch_sharding(mesh, 2 + len(shape), batch_axis=1))
            for k, (shape, dtype) in fields.items()}, rows // micro, micro


def _seq_fields(p: int, t: int) -> dict:
    i32, f32 = jnp.int32, jnp.float32
    return {"input_ids": ((p + t,), i32), "attention_mask": ((p + t,), i32), "position_ids": ((p + t,), i32),
            "responses": ((t,), i32), "response_mask": ((t,), i32), "_f32": ((t,), f32)}


def _fields(base: dict, names: tuple[str, ...]) -> dict:
    out = {k: v for k, v in base.items() if k in ("input_ids", "attention_mask", "position_ids", "responses")}
    for name in names:
        out[name] = base[name] if name in ("response_mask", "routed_experts") else base["_f32"]
    return out


@dataclasses.dataclass
class Program:
    lowered: object  # jax.stages.Lowered
    uses: tuple[str, ...]  # resident groups among its arguments (the rest stay resident beside it)
    repeats: int = 1  # micro-batches (the loop whose body XLA counts once)
    optimizer: object = None  # lowered optimizer-only program (its cost is not per micro-batch)
    micro: int = 0  # rows per micro-batch


def build_programs(run, cfg, mesh, rollout_mesh, wanted, *, n_micro=None):
    """{name: Program} and {group: abstract pytree} (the resident state of a colocated run)."""
    p, t = run.data.max_prompt_length, run.data.max_response_length
    n = run.rollout.n
    seq = _seq_fields(p, t)
    programs, groups = {}, {}
    graphdef, params = abstract_params(cfg, mesh)
    tx, schedule = _common.build_optimizer(run.actor.optim, run.trainer.total_training_steps)
    state = abstract_train_state(params, tx, mesh)
    groups["actor_params"], groups["actor_opt"] = params, (state.opt_state, state.step)
    if run.use_reference:
        groups["ref_params"] = params
    # what ActorWorker._loss / _log_prob_fn read of their worker (a MoE model's router terms and
    # actor.router_replay, whose batches carry the engine's experts per token)
    rr = run.actor.router_replay
    actor = types.SimpleNamespace(cfg=run.actor, temperature=run.rollout.temperature,
                                  _router=cfg.is_moe, moe=run.model.moe, _record=rr.record, _replay=rr.replay)
    replayed = ("routed_experts",) if rr.record else ()
    if rr.record:
        seq["routed_experts"] = ((p + t, cfg.num_hidden_layers, cfg.num_experts_per_tok),
                                 models.expert_index_dtype(cfg.num_experts))
    if "actor_update" in wanted:
        names = ("response_mask", "old_log_probs", "advantages") + replayed
        names += ("ref_log_prob",) if run.actor.use_kl_loss else ()
        mb, repeats, micro = micro_batch(mesh, run.actor.ppo_mini_batch_size * n,
                                  run.actor.ppo_micro_batch_size_per_device, _fields(seq, names), n_micro)
        loss = lambda model, m, d: _roles.ActorWorker._loss(actor, model, m, d)  # noqa: E731
        step = _step.make_update_step(graphdef, tx, schedule, loss, mesh, "response_mask", state)
        programs["actor_update"] = Program(step.lower(state, mb), ("actor_params", "actor_opt"), repeats,
                                           _optimizer_program(tx, state), micro)
    if "log_prob" in wanted:
        mb, repeats, micro = micro_batch(mesh, run.data.train_batch_size * n,
                                  run.actor.ppo_micro_batch_size_per_device, _fields(seq, replayed), n_micro)
        fwd = _step.make_forward(graphdef, lambda mdl, m: _roles.ActorWorker._log_prob_fn(actor, mdl, m), mesh)
        programs["log_prob"] = Program(fwd.lower(params, mb), ("actor_params",), repeats, micro=micro)
    if run.use_critic:
        _critic_programs(run, cfg, mesh, seq, wanted, programs, groups, n_micro)
    _engine_programs(run, cfg, graphdef, params, rollout_mesh, wanted, programs, groups)
    return programs, groups


def _optimizer_program(tx, state):
    """The update's part outside the micro-batch loop (AdamW on the summed gradients)."""
    def apply(state, grads):
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        return _common.TrainState(optax.apply_updates(state.params, updates), opt_state, state.step + 1)

    return jax.jit(apply).lower(state, state.params)


def _critic_programs(run, cfg, mesh, seq, wanted, programs, groups, n_micro):
    n = run.rollout.n
    graphdef, params = abstract_params(cfg, mesh, value_head=True)
    tx, schedule = _common.build_optimizer(run.critic.optim, run.trainer.total_training_steps)
    state = abstract_train_state(params, tx, mesh)
    groups["critic_params"], groups["critic_opt"] = params, (state.opt_state, state.step)
    critic = types.SimpleNamespace(cfg=run.critic)
    if "critic_update" in wanted:
        mb, repeats, micro = micro_batch(mesh, run.critic.ppo_mini_batch_size * n,
                                  run.critic.ppo_micro_batch_size_per_device,
                                  _fields(seq, ("response_mask", "values", "returns")), n_micro)
        loss = lambda model, m, d: _roles.CriticWorker._loss(critic, model, m, d)  # noqa: E731
        step = _step.make_update_step(graphdef, tx, schedule, loss, mesh, "response_mask", state)
        programs["critic_update"] = Program(step.lower(state, mb), ("critic_params", "critic_opt"), repeats,
                                            _optimizer_program(tx, state))
    if "values" in wanted:
        mb, repeats, micro = micro_batch(mesh, run.data.train_batch_size * n,
                                  run.critic.ppo_micro_batch_size_per_device, _fields(seq, ()), n_micro)
        fwd = _step.make_forward(graphdef, _roles.response_values, mesh)
        programs["values"] = Program(fwd.lower(params, mb), ("critic_params",), repeats)


def _engine_programs(run, cfg, graphdef, params, rollout_mesh, wanted, programs, groups):
    prefill = rollout.prefill_bucket(run.data.max_prompt_length)
    engine = rollout.Engine.from_model(
        (graphdef, params), mesh=rollout_mesh, max_concurrent_decodes=run.rollout.max_concurrent_decodes,
        max_prefill_length=prefill, max_target_length=prefill + run.data.max_response_length,
        dtype=run.rollout.dtype or run.model.dtype, temperature=run.rollout.temperature,
        record_experts=run.actor.router_replay.record,  # as HostWorker's engines
        quantization=run.rollout.quantization, batch_invariant=run.rollout.batch_invariant,
        kv_cache_dtype=run.rollout.kv_cache_dtype)
    rows = run.data.train_batch_size * run.rollout.n
    prefill_rows = rollout._engine._next_pow2(max(min(64, rows), 4))  # RolloutDriver's prefill batch
    same_devices = set(rollout_mesh.devices.flat) == set(jax.tree.leaves(params)[0].sharding.device_set)
    trainer_params = nnx.to_pure_dict(params)
    lowered = engine.lower(
        prefill_rows=prefill_rows, insert_rows=min(prefill_rows, run.rollout.max_concurrent_decodes),
        out_rows=rollout._engine._next_pow2(max(rows, 16)),
        out_tokens=rollout._engine._next_pow2(max(run.data.max_response_length, 16)),
        sync_from=trainer_params if same_devices else None,
        programs=[p for p in rollout._engine.PROGRAM_NAMES if p in wanted])  # tracing each takes seconds
    shared = same_devices and engine.shares_weights(trainer_params)  # zero-copy: the trainer's buffers
    groups["engine_params"] = None if shared else engine.params
    with sharding.use_rules(rollout_mesh, "rollout"):
        groups["decode_state"] = jax.eval_shape(engine._init_core)
    groups["decode_state"] = _with_shardings(groups["decode_state"], engine._state_shardings)
    weights = ("actor_params",) if shared else ("engine_params",)
    uses = {"prefill": weights, "insert": ("decode_state",), "generate": weights + ("decode_state",),
            "decode_loop": weights + ("decode_state",)}
    for name, use in uses.items():
        if name in lowered:
            programs[name] = Program(lowered[name], use)
    if "weight_sync" in wanted and lowered.get("weight_sync") is not None:
        # the engine drops its old weights before the new ones are made
        programs["weight_sync"] = Program(lowered["weight_sync"], ("actor_params", "engine_params"))
    engine_info = {"layer_layout": engine.layer_layout, "quantization": engine.quantization,
                   "batch_invariant": engine.batch_invariant, "zero_copy_sync": shared,
                   "max_concurrent_decodes": run.rollout.max_concurrent_decodes,
                   "max_prefill_length": prefill, "max_target_length": engine.max_target_length,
                   # a batch_invariant engine's prefill calls run its fixed row count (Engine.lower)
                   "prefill_rows": rollout.BATCH_INVARIANT_ROWS if engine.batch_invariant else prefill_rows,
                   "kv_cache_bytes_global": engine.kv_cache_bytes(),
                   "cross_mesh_sync": not same_devices}
    programs["_engine"] = engine_info


def resident_bytes(tree) -> int:
    """Per-chip bytes of an abstract tree as the TPU lays it out: the argument size of a program
    that takes it and does nothing (keep_unused keeps every argument)."""
    leaves = [x for x in jax.tree.leaves(tree) if x is not None]
    if not leaves:
        return 0
    compiled = jax.jit(lambda xs: 0, keep_unused=True).lower(leaves).compile()
    return int(compiled.memory_analysis().argument_size_in_bytes)


_CUSTOM_CALL = re.compile(r'%([A-Za-z_][\w\-]*?)(?:\.\d+)* = .*custom_call_target="tpu_custom_call"')


def pallas_kernels(text: str) -> list[str]:
    """Names of the Pallas (Mosaic) kernels in a compiled TPU program's HLO text (the custom
    call's instruction name is the kernel's name)."""
    return sorted({m.group(1) for m in _CUSTOM_CALL.finditer(text)})


def _cost(compiled) -> tuple[float, float]:
    c = compiled.cost_analysis()
    c = c[0] if isinstance(c, (list, tuple)) else c
    return float(c.get("flops", 0.0)), float(c.get("bytes accessed", 0.0))


def _head_correction(run, cfg, mesh, micro: int, grad: bool) -> list[float]:
    """What XLA's count misses of the chunked log-prob head (a `lax.map` over response chunks,
    counted once): (flops, bytes) of one micro-batch's head in one chunk minus in the default
    chunks, with its gradient for an update."""
    t, e, v = run.data.max_response_length, cfg.hidden_size, cfg.vocab_size
    layout = "ve" if cfg.tie_word_embeddings else "ev"
    w_shape, w_axes = ((v, e), ("vocab", "embed")) if layout == "ve" else ((e, v), ("embed", "vocab"))
    args = (jax.ShapeDtypeStruct((micro, t, e), cfg.dtype, sharding=_common.batch_sharding(mesh, 3)),
            jax.ShapeDtypeStruct(w_shape, cfg.dtype,
                                 sharding=sharding.logical_sharding(mesh, w_axes, sharding.TRAIN_RULES)),
            jax.ShapeDtypeStruct((micro, t), jnp.int32, sharding=_common.batch_sharding(mesh, 2)))

    def cost(chunk):
        def head(h, w, tok):
            with sharding.use_rules(mesh, sharding.TRAIN_RULES):
                lp, ent = algos.token_log_probs_from_hidden(
                    h, w, tok, temperature=run.rollout.temperature, chunk_size=chunk,
                    return_entropy=True, unembed_layout=layout)
            return lp.sum() + ent.sum()

        fn = jax.grad(head, argnums=(0, 1)) if grad else head
        return _cost(jax.jit(fn).lower(*args).compile())

    return [a - b for a, b in zip(cost(t), cost(_logprobs.DEFAULT_CHUNK_SIZE))]


def measured_costs(run, cfg, meshes, wanted) -> dict:
    """{program: (flops, bytes)} per chip, extrapolated from 1- and 2-layer unrolled models with one
    micro-batch (see the module docstring), plus what the count misses of the chunked log-prob
    head."""
    small = {}
    for layers in (1, 2):
        c = cfg.replace(num_hidden_layers=layers, layer_unroll=0, decode_unroll=0)
        progs, _ = build_programs(run, c, *meshes, wanted, n_micro=1)
        small[layers] = {}
        for k, v in progs.items():
            if isinstance(v, Program):
                print(f"aot_compile: compiling {k} with {layers} layer(s) for its cost", file=sys.stderr, flush=True)
                small[layers][k] = (v, _cost(v.lowered.compile()), v.optimizer and _cost(v.optimizer.compile()))
    out = {}
    for name, (prog, c1, opt1) in small[1].items():
        _, c2, opt2 = small[2][name]
        at_l = [a + (cfg.num_hidden_layers - 1) * (b - a) for a, b in zip(c1, c2)]
        opt_l = [0.0, 0.0]
        if opt1 is not None:  # the optimizer step runs once; the rest once per micro-batch
            opt_l = [a + (cfg.num_hidden_layers - 1) * (b - a) for a, b in zip(opt1, opt2)]
        if name in ("actor_update", "log_prob"):
            head = _head_correction(run, cfg, meshes[0], prog.micro, grad=name == "actor_update")
            at_l = [x + h for x, h in zip(at_l, head)]
        out[name] = tuple(o + prog.repeats * (x - o) for x, o in zip(at_l, opt_l))
    return out


_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_OOM = re.compile(r"required for (.+?) \(([\d.]+)([KMGT])\) exceeds available HBM \(([\d.]+)([KMGT])\)")


def _out_of_memory(error: Exception, others: int, chip) -> dict:
    """The report entry of a program the TPU compiler refused for lack of HBM: its message, and
    by how much it is over (the compiler's own count for the program, plus the other residents;
    at least that much)."""
    text = str(error)
    m = _OOM.search(text)
    entry = {"fits": False, "compile_error": text.strip().splitlines()[0][:400], "other_resident_bytes": int(others),
             "hbm_bytes": chip.hbm_bytes, "pallas_kernels": []}
    if m:
        need, avail = float(m.group(2)) * _UNITS[m.group(3)], float(m.group(4)) * _UNITS[m.group(5)]
        entry.update(compiler_required_bytes=int(need), compiler_available_bytes=int(avail),
                     over_by_bytes=int(need - avail + others), peak_bytes=int(need + others))
    else:
        entry.update(over_by_bytes=None, peak_bytes=None)
    return entry


def analyse(programs, groups, chip, costs) -> dict:
    residents = {k: resident_bytes(v) for k, v in groups.items()}
    report = {}
    for name, prog in programs.items():
        if not isinstance(prog, Program):
            continue
        others = sum(b for g, b in residents.items() if g not in prog.uses)
        print(f"aot_compile: compiling {name}", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        try:
            compiled = prog.lowered.compile()
        except jax.errors.JaxRuntimeError as e:
            if "RESOURCE_EXHAUSTED" not in str(e):
                raise
            report[name] = _out_of_memory(e, others, chip)
            continue
        compile_s = time.perf_counter() - t0
        mem = compiled.memory_analysis()
        program_bytes = (mem.argument_size_in_bytes + mem.output_size_in_bytes - mem.alias_size_in_bytes
                         + mem.temp_size_in_bytes + mem.generated_code_size_in_bytes)
        peak = program_bytes + others
        entry = {
            "argument_bytes": int(mem.argument_size_in_bytes), "output_bytes": int(mem.output_size_in_bytes),
            "alias_bytes": int(mem.alias_size_in_bytes), "temp_bytes": int(mem.temp_size_in_bytes),
            "code_bytes": int(mem.generated_code_size_in_bytes), "program_bytes": int(program_bytes),
            "other_resident_bytes": int(others), "peak_bytes": int(peak), "hbm_bytes": chip.hbm_bytes,
            "fits": peak <= chip.hbm_bytes, "over_by_bytes": int(max(0, peak - chip.hbm_bytes)),
            "pallas_kernels": pallas_kernels(compiled.as_text()), "compile_s": round(compile_s, 2),
        }
        flops, nbytes = _cost(compiled)
        entry.update(compiled_flops=flops, compiled_bytes_accessed=nbytes)
        if name in costs:
            entry.update(_roofline(*costs[name], chip))
        report[name] = entry
    return report, residents


def _roofline(flops: float, nbytes: float, chip) -> dict:
    compute_s, memory_s = flops / chip.bf16_flops, nbytes / chip.hbm_bandwidth
    return dict(flops=flops, bytes_accessed=nbytes, roofline_s=max(compute_s, memory_s),
                bound="compute" if compute_s >= memory_s else "memory")


def step_estimate(run, report, engine) -> dict:
    """Roofline lower bound of one colocated RL step from the programs' figures (seconds)."""
    def t(name):
        return report.get(name, {}).get("roofline_s")

    rows = run.data.train_batch_size * run.rollout.n
    parts = {}
    if t("prefill") is not None:  # once per prompt; its rollout.n samples share the prefix
        parts["prefill"] = math.ceil(run.data.train_batch_size / engine["prefill_rows"]) * t("prefill")
    if t("generate") is not None:
        waves = math.ceil(rows / run.rollout.max_concurrent_decodes)
        parts["decode"] = waves * run.data.max_response_length * t("generate")
    if t("log_prob") is not None:
        parts["log_probs"] = t("log_prob") * (2 if run.use_reference else 1)
    if t("values") is not None:
        parts["values"] = t("values")
    updates = run.data.train_batch_size // run.actor.ppo_mini_batch_size * run.actor.ppo_epochs
    if t("actor_update") is not None:
        parts["actor_update"] = updates * t("actor_update")
    if t("critic_update") is not None:
        parts["critic_update"] = (run.data.train_batch_size // run.critic.ppo_mini_batch_size
                                  * run.critic.ppo_epochs * t("critic_update"))
    if t("weight_sync") is not None:
        parts["weight_sync"] = t("weight_sync")
    return {"parts_s": parts, "total_s": sum(parts.values()),
            "note": "per-chip roofline lower bound: no collectives, no host work, every decode step "
                    "runs all slots for the full response length"}


def run_aot(topology: str, config: str, overrides=(), *, model: str = "", programs="all",
            cost: bool = True, hbm_bytes: int = 0) -> dict:
    """Compiles the config's programs for `topology`; returns the report (see the module doc)."""
    run = C.load_config(config, list(overrides))
    wanted = set(PROGRAMS if programs == "all" else programs)
    unknown = wanted - set(PROGRAMS)
    if unknown:
        raise ValueError(f"unknown programs {sorted(unknown)}; choose from {PROGRAMS}")
    devices = topology_devices(topology)
    kind = devices[0].device_kind
    if kind not in CHIPS:
        raise ValueError(f"no published figures for {kind!r} in CHIPS; add them")
    chip = CHIPS[kind]
    if hbm_bytes:
        chip = dataclasses.replace(chip, hbm_bytes=hbm_bytes)
    cfg = model_config(run, model)
    mesh, rollout_mesh = _host._meshes(run, devices)
    t0 = time.perf_counter()
    progs, groups = build_programs(run, cfg, mesh, rollout_mesh, wanted)
    engine = progs.pop("_engine")
    costs = measured_costs(run, cfg, (mesh, rollout_mesh), wanted) if cost else {}
    report, residents = analyse(progs, groups, chip, costs)
    params = sum(math.prod(x.shape) for x in jax.tree.leaves(groups["actor_params"]))
    out = {
        "topology": topology, "chips": len(devices), "device_kind": kind, "chip": dataclasses.asdict(chip),
        "jax": jax.__version__, "libtpu": _libtpu_version(), "config": config, "overrides": list(overrides),
        "model": model or "config", "params": int(params),
        "model_config": _model_config_record(cfg),
        "mesh": dict(mesh.shape), "rollout_mesh": dict(rollout_mesh.shape), "engine": engine,
        "resident_bytes": residents, "programs": report,
        **_totals(report),
        "wall_s": None,
    }
    out["sleep"] = sleep_savings(out)
    if cost:
        out["step_roofline"] = step_estimate(run, report, engine)
    out["wall_s"] = round(time.perf_counter() - t0, 1)
    return out


# the programs that run while a colocated engine sleeps (the actor / critic steps, not generation
# or the weight sync, which writes the engine's weights)
SLEEP_PROGRAMS = ("actor_update", "log_prob", "critic_update", "values")


def sleep_savings(report: dict) -> dict | None:
    """What the engine's sleep (colocated modes; `rollout.free_cache_engine`) saves per chip while
    the training programs run: it frees the decode state (the KV cache, `kv_cache_bytes`, and
    the engine's small per-slot buffers) and, when the engine holds its own weight copy (no
    zero-copy sync), those weights. `released_bytes` = those resident groups as compiled;
    `kv_cache_bytes` = the engine's KV figure over the chips; per training program,
    `peak_bytes` (engine resident), `peak_asleep_bytes` = that minus the released bytes, and
    whether that fits. None for a report whose rollout runs on other devices (separate
    placement: nothing of the engine sits beside the update)."""
    engine, res = report["engine"], report["resident_bytes"]
    if engine.get("cross_mesh_sync", False):
        return None
    weights = 0 if engine["zero_copy_sync"] else res.get("engine_params") or 0
    released = {"decode_state": res["decode_state"], "engine_params": weights}
    freed = sum(released.values())
    hbm = report["chip"]["hbm_bytes"]
    programs = {}
    for name in SLEEP_PROGRAMS:
        e = report["programs"].get(name)
        if e is None or e.get("peak_bytes") is None:
            continue
        asleep = e["peak_bytes"] - freed
        programs[name] = {"peak_bytes": e["peak_bytes"], "peak_asleep_bytes": asleep, "saved_bytes": freed,
                          "fits_asleep": asleep <= hbm}
    return {"released_bytes": released, "kv_cache_bytes": engine["kv_cache_bytes_global"] // report["chips"],
            "programs": programs}


def _totals(programs: dict) -> dict:
    """A report's "fits" (every program) and "peak_bytes" (the largest program's) from its programs."""
    return {"fits": all(p["fits"] for p in programs.values()),
            "peak_bytes": max((p["peak_bytes"] or 0 for p in programs.values()), default=0)}


def _check_rebuilt(report: dict, rebuilt: dict) -> None:
    """Refuses a saved report whose recorded `rebuilt` keys differ from what was built today."""
    for key, value in rebuilt.items():
        if value != report[key]:
            raise ValueError(f"the report's {key} {report[key]} is not what its command line builds "
                             f"today ({value}); re-run the full compile")


def _rebuild(report: dict):
    """(run config, model config, (mesh, rollout mesh)) from a saved report's own command line
    (topology, config, overrides, model), or a clear error when it no longer builds the report's
    chips, model or meshes (cheap: nothing is compiled)."""
    run = C.load_config(report["config"], list(report["overrides"]))
    devices = topology_devices(report["topology"])
    if devices[0].device_kind != report["device_kind"] or len(devices) != report["chips"]:
        raise ValueError(f"{report['topology']}: libtpu describes {len(devices)} x {devices[0].device_kind}, "
                         f"the report has {report['chips']} x {report['device_kind']}")
    cfg = model_config(run, _preset(report))
    mesh, rollout_mesh = _host._meshes(run, devices)
    _check_rebuilt(report, {"model_config": _model_config_record(cfg), "mesh": dict(mesh.shape),
                            "rollout_mesh": dict(rollout_mesh.shape)})
    return run, cfg, (mesh, rollout_mesh)


def _preset(report: dict) -> str:
    return "" if report["model"] == "config" else report["model"]


def add_costs(report: dict) -> dict:
    """Adds the FLOPs / bytes / roofline figures and the step estimate to a saved `--no-cost`
    report: only the 1- and 2-layer copies of the programs it has without them are compiled (the
    full programs' memory figures are kept as they are). The report's own command line rebuilds
    the programs; a report whose model or meshes it no longer rebuilds is refused."""
    run, cfg, meshes = _rebuild(report)
    chip = Chip(**report["chip"])  # the report's figures (an --hbm-gib what-if stays one)
    t0 = time.perf_counter()
    missing = {k for k, v in report["programs"].items() if "roofline_s" not in v and "compile_error" not in v}
    costs = measured_costs(run, cfg, meshes, missing)
    for name, entry in report["programs"].items():
        if name in costs and "compile_error" not in entry:  # as analyse(): compiled programs only
            entry.update(_roofline(*costs[name], chip))
    report["step_roofline"] = step_estimate(run, report["programs"], report["engine"])
    report["cost_wall_s"] = round(time.perf_counter() - t0, 1)
    return report


_SAME_BUILD = ("jax", "libtpu", "device_kind", "chips", "chip", "params", "model_config", "mesh", "rollout_mesh",
               "engine", "resident_bytes")


def extend_report(report: dict, programs, *, cost: bool = True) -> dict:
    """Compiles `programs` that a saved report lacks, from the report's own command line (and its
    chip figures), and adds them: a report made with `--programs=a,b` gets the rest later without
    recompiling what it has. The new compile must build what the report recorded (same jax and
    libtpu, model, meshes, engine and resident state), else it is refused (model and meshes
    before anything is compiled)."""
    have = sorted(set(programs) & set(report["programs"]))
    if have:
        raise ValueError(f"the report already has {have}; extend it with programs it lacks")
    run, _, _ = _rebuild(report)
    new = run_aot(report["topology"], report["config"], report["overrides"], model=_preset(report),
                  programs=programs, cost=cost, hbm_bytes=report["chip"]["hbm_bytes"])
    _check_rebuilt(report, {key: new[key] for key in _SAME_BUILD})
    merged = {**report["programs"], **new["programs"]}
    report["programs"] = {k: merged[k] for k in PROGRAMS if k in merged}
    report.update(_totals(report["programs"]))
    report["sleep"] = sleep_savings(report)
    if any("roofline_s" in p for p in report["programs"].values()):
        report["step_roofline"] = step_estimate(run, report["programs"], report["engine"])
    report.setdefault("extended", []).append({"programs": sorted(new["programs"]), "cost": cost,
                                              "wall_s": new["wall_s"]})
    return report


def _model_config_record(cfg) -> dict:
    return {k: str(v) if not isinstance(v, (int, float, bool, type(None))) else v
            for k, v in dataclasses.asdict(cfg).items() if k != "rope_scaling"}


def _libtpu_version() -> str:
    from importlib import metadata
    try:
        return metadata.version("libtpu")
    except metadata.PackageNotFoundError:
        return ""


def _summary(out) -> str:
    lines = [f"{out['model']} on {out['topology']} ({out['chips']} x {out['chip']['name']}, "
             f"{out['chip']['hbm_bytes'] / GiB:.0f} GiB HBM), mesh {out['mesh']}, rollout mesh "
             f"{out['rollout_mesh']}:"]
    for name, p in out["programs"].items():
        if "compile_error" in p:
            lines.append(f"  {name:14s} DOES NOT FIT: {p['compile_error']}")
            continue
        mark = "ok  " if p["fits"] else f"OVER by {p['over_by_bytes'] / GiB:.2f} GiB"
        rl = f", roofline {p['roofline_s'] * 1e3:.2f} ms ({p['bound']})" if "roofline_s" in p else ""
        kernels = f", kernels {p['pallas_kernels']}" if p["pallas_kernels"] else ""
        lines.append(f"  {name:14s} {mark} peak {p['peak_bytes'] / GiB:6.2f} GiB (program "
                     f"{p['program_bytes'] / GiB:.2f}, temp {p['temp_bytes'] / GiB:.2f}){rl}{kernels}")
    return "\n".join(lines)


_TABLE_PROGRAMS = ("actor_update", "log_prob", "prefill", "generate", "weight_sync")


def _gib(n) -> str:
    return f"{n / GiB:.1f}"


def markdown_tables(reports: list[dict]) -> str:
    """The docs' memory and step-time tables from saved reports (`--table a.json b.json ...`)."""
    def slice_name(r):
        return f"{r['chip']['name']}-{r['chips'] * (2 if r['chip']['name'] in ('v5p', 'v4') else 1)}"

    def mesh(m):  # a context axis other than 1 as a fourth figure, "cN"
        ctx = f"xc{m['context']}" if m.get("context", 1) != 1 else ""
        return "x".join(str(m[k]) for k in ("data", "fsdp", "tensor")) + ctx

    lines = ["| model | slice (HBM/chip) | mesh d x f x t (rollout) | resident per chip: actor + Adam, ref, "
             "engine weights, KV cache | " + " | ".join(f"`{p}` peak" for p in _TABLE_PROGRAMS) + " | fits |",
             "|---" * (5 + len(_TABLE_PROGRAMS)) + "|"]
    for r in reports:
        res = r["resident_bytes"]
        resident = (f"{_gib(res['actor_params'] + res['actor_opt'])}, {_gib(res.get('ref_params', 0))}, "
                    f"{_gib(res.get('engine_params', 0))}, {_gib(res['decode_state'])}")
        peaks = []
        for p in _TABLE_PROGRAMS:
            e = r["programs"].get(p)
            peaks.append("-" if e is None else "?" if e["peak_bytes"] is None
                         else (">" if "compile_error" in e else "") + _gib(e["peak_bytes"])
                         + ("" if e["fits"] else " **over**"))
        over = [f"{k} +{_gib(v['over_by_bytes'] or 0)}" for k, v in r["programs"].items() if not v["fits"]]
        lines.append(f"| {r['model']} | {slice_name(r)} ({_gib(r['chip']['hbm_bytes'])} GiB) | "
                     f"{mesh(r['mesh'])} ({mesh(r['rollout_mesh'])}) | {resident} | " + " | ".join(peaks)
                     + f" | {'yes' if r['fits'] else 'no: ' + ', '.join(over)} |")
    parts = ("prefill", "decode", "log_probs", "actor_update", "weight_sync")
    rows = []
    for r in reports:
        if not any("roofline_s" in p for p in r["programs"].values()):
            continue  # a --no-cost report
        # recomputed from the programs' figures and the report's own config
        step = step_estimate(C.load_config(r["config"], r["overrides"]), r["programs"], r["engine"])
        cells = [f"{step['parts_s'][p]:.2f}" if p in step["parts_s"] else "-" for p in parts]
        bounds = "/".join(r["programs"].get(p, {}).get("bound", "-") for p in ("actor_update", "generate"))
        rows.append(f"| {r['model']} | {slice_name(r)} | " + " | ".join(cells)
                    + f" | {step['total_s']:.2f} | {bounds} |")
    if rows:  # roofline seconds per step
        lines += ["", "| model | slice | " + " | ".join(parts) + " | step (s) | bound of the update / decode |",
                  "|---" * (4 + len(parts)) + "|"] + rows
    return "\n".join(lines + _sleep_table(reports, slice_name))


def _sleep_table(reports: list[dict], slice_name) -> list[str]:
    """Rows of what the engine's sleep saves for the colocated reports (`sleep_savings`)."""
    rows = []
    for r in reports:
        sleep = sleep_savings(r)
        if sleep is None or not sleep["programs"]:
            continue
        rel = sleep["released_bytes"]
        cells = []
        for p in SLEEP_PROGRAMS[:2]:
            e = sleep["programs"].get(p)
            cells.append("-" if e is None else f"{_gib(e['peak_bytes'])} -> {_gib(e['peak_asleep_bytes'])}"
                         + ("" if e["fits_asleep"] else " **over**"))
        rows.append(f"| {r['model']} | {slice_name(r)} | {_gib(sleep['kv_cache_bytes'])} | "
                    f"{_gib(rel['decode_state'])} | {_gib(rel['engine_params'])} | "
                    f"{_gib(sum(rel.values()))} | " + " | ".join(cells) + " |")
    if not rows:
        return []
    return ["", "| model | slice | KV cache (GiB/chip) | decode state freed | engine weights freed | "
            "saved by sleep | `actor_update` peak awake -> asleep | `log_prob` peak awake -> asleep |",
            "|---" * 8 + "|"] + rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--topology", default="", help="TPU slice, e.g. v5e:2x4, v5p:2x2x2, v6e:4x4")
    ap.add_argument("--table", nargs="+", default=(), metavar="JSON",
                    help="print the docs' markdown tables from saved reports and exit")
    ap.add_argument("--config", default="configs/grpo_gsm8k.py", help="config file[:variant]")
    ap.add_argument("--model", default="", help=f"architecture preset ({', '.join([*MODEL_PRESETS, *HF_PRESETS])}); "
                    "empty: the config's model.path or model.init")
    ap.add_argument("--programs", default="all", help=f"comma list of {', '.join(PROGRAMS)}")
    ap.add_argument("--cost", action=argparse.BooleanOptionalAction, default=True,
                    help="also compile 1- and 2-layer variants for FLOPs / bytes (roofline)")
    ap.add_argument("--add-cost", default="", metavar="JSON",
                    help="add the FLOPs / bytes / roofline figures to a saved --no-cost report (compiles "
                    "only its programs' 1- and 2-layer copies; its own command line is used) and write "
                    "it to --out, or back in place")
    ap.add_argument("--extend", default="", metavar="JSON",
                    help="compile the --programs a saved report lacks (from its own command line) and add "
                    "them to it; written to --out, or back in place")
    ap.add_argument("--out", default="", help="write the JSON report here (else to stdout)")
    ap.add_argument("--hbm-gib", type=float, default=0.0,
                    help="pretend each chip has this much HBM (what-ifs, tests); 0 = published")
    ap.add_argument("--check", action="store_true", help="exit 1 when a program does not fit in HBM")
    args, rest = ap.parse_known_args(argv)
    bad = [r for r in rest if not r.startswith("--config.")]
    if bad:
        ap.error(f"unrecognised arguments {bad} (config overrides are --config.a.b=value)")
    if args.table:
        print(markdown_tables([json.loads(Path(f).read_text()) for f in args.table]))
        return 0
    # --add-cost and --extend take the saved report's own command line: these would contradict it
    given = [f"--{k.replace('_', '-')}" for k in ("topology", "model", "hbm_gib") if getattr(args, k)]
    given += (["--config"] if args.config != ap.get_default("config") else []) + rest
    if args.add_cost:
        if given or args.programs != "all" or not args.cost:
            ap.error(f"--add-cost takes the report's own command line; drop {given or '--programs / --no-cost'}")
        args.out = args.out or args.add_cost
    elif args.extend:
        if given or args.programs == "all":
            ap.error(f"--extend takes the report's own command line and the --programs to add; "
                     f"drop {given}" if given else "--extend needs --programs=a,b")
        args.out = args.out or args.extend
    elif not args.topology:
        ap.error("--topology is required (e.g. --topology=v5e:2x4)")
    programs = "all" if args.programs == "all" else tuple(p for p in args.programs.split(",") if p)
    try:
        if args.add_cost:
            out = add_costs(json.loads(Path(args.add_cost).read_text()))
        elif args.extend:
            out = extend_report(json.loads(Path(args.extend).read_text()), programs, cost=args.cost)
        else:
            out = run_aot(args.topology, args.config, rest, model=args.model, programs=programs, cost=args.cost,
                          hbm_bytes=int(args.hbm_gib * GiB))
    except LibtpuMissing as e:
        print(f"aot_compile: {e}", file=sys.stderr)
        return 2
    text = json.dumps(out, indent=1, sort_keys=False)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    else:
        print(text)
    print(_summary(out), file=sys.stderr)
    if args.check and not out["fits"]:
        over = {k: v["over_by_bytes"] or 0 for k, v in out["programs"].items() if not v["fits"]}
        print(f"aot_compile --check: does not fit in {out['chip']['hbm_bytes'] / GiB:.0f} GiB per chip: "
              + ", ".join(f"{k} over by at least {v / GiB:.2f} GiB" for k, v in over.items()), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
