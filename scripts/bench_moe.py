"""MoE benchmark on one accelerator: a random-init Qwen3-MoE against its dense twin of equal
active parameters (decode, actor update), and the engine/trainer routing mismatch in bf16.

    python scripts/bench_moe.py                                   # Qwen3-30B-A3B layers, 4 of them
    python scripts/bench_moe.py --shape qwen3-30b-a3b-L8 --batches 64 256 --out moe.json
    python scripts/bench_moe.py --skip update,mismatch            # decode only
    python scripts/bench_moe.py --tiny                            # CPU smoke run of all three parts

Shapes (`--shape`): `qwen3-30b-a3b` is Qwen3-30B-A3B's per-layer shapes
(`models.QWEN3_MOE_SHAPES["30b-a3b"]`: hidden 2048, 32 heads / 4 kv heads of 128, 128 experts of
width 768, top-8, vocab 151936, untied) with `--layers` layers (`-L<n>` in the name sets it);
`tiny` a CPU-sized stand-in. The dense twin has the same attention, embedding and head and a
dense SwiGLU MLP of width top_k * moe_intermediate_size (6144), so its parameters equal the MoE's
active parameters per token (all but the router's, hidden * experts per layer).
`active_params` = all parameters but the unchosen experts' (experts * (1 - top_k / experts)).

First (`moe_dispatch_check`): how the experts' grouped matmul (`jax.lax.ragged_dot`) compiles
here, forward and weight gradient, at the update's micro-batch shape (`ragged_dot_check`: is a
ragged-dot op or a Pallas kernel left in the optimized program?). XLA's GPU fallback expands a
ragged dot into a dense dot over all experts (x experts FLOPs and memory);
`--ragged-dot auto` (default) adds XLA's cuDNN ragged-dot fusion flag (after checking in a child
process that this XLA knows it) and, if the dot is still expanded, tries JAX's Pallas Triton
lowering. Where it stays expanded on a GPU the model itself runs every expert on every token
instead (`models` `dense_experts`: num_experts / top_k times a grouped matmul's expert FLOPs, top_k
times less than the expansion); every MoE record then says `experts_dispatch: dense`.

Parts, run in the order update, mismatch, decode (`--skip decode,update,mismatch` drops any; each
record is printed, and written to `--out`, as soon as it is measured):
- decode: `scripts/bench_rollout.py`'s engine timing (`bench_ours`) for both models at each
  `--batches`, bf16: `ms_per_step` is decode only (the difference of two whole calls that differ
  only in decode steps), `decode_tokens_per_s` = batch / step; a `moe_decode_vs_dense` record
  per batch gives `moe_over_dense` = the MoE's ms_per_step (and total_s) over the twin's. The
  MoE's roofline counts active-parameter FLOPs and the weight bytes a step is expected to read
  under uniform routing: all non-expert weights plus each layer's experts times P(an expert is
  chosen by at least one of the batch's rows) = 1 - (1 - top_k / experts) ** batch
  (`expected_expert_fraction`).
- update: `scripts/bench_train.py`'s actor update (`_run_config`: one `ActorWorker.update` of
  `--update-rows` rows of `--update-len` tokens, micro-batches of `--micro` rows, fp32 params and
  Adam, bf16 compute, remat `--remat`), the MoE with the load-balancing loss on
  (`model.moe.aux_loss_coef` = `--aux-loss-coef`; `moe_metrics` has actor/moe_aux_loss and the
  expert load). `mfu` = (6 * active_params without the embedding lookup + 12 * layers * heads *
  head_dim * seq) * tokens / (step time * `--peak-tflops`): attention FLOPs counted, remat
  recomputation not (bench_train's count with the active parameters); then a
  `moe_update_vs_dense` record (step times, MFUs, their ratio).
- mismatch: the MoE engine (bf16 weights, the trainer's cast) generates `--mismatch-rows`
  samples of `--gen-len` tokens from `--prompt-len`-token random prompts at temperature 1,
  recording every token's experts (router replay R3); then the trainer's old-log-prob pass (fp32
  params, bf16 compute, `actor.router_replay.mode=replay`) scores them. One pass gives both
  sides: `router_mismatch_frac` = share of (token, layer) routings whose trainer top-k set
  differs from the engine's, `logprob_abs_diff_without_replay` (the trainer routing by its own
  top-k; the same numbers as mode=record) and `logprob_abs_diff_with_replay` (routing by the
  engine's experts, gate weights recomputed): mean and max over response tokens of
  |engine log-prob - trainer log-prob|. Random-init routers route near-uniformly (small router
  logits, close top-k margins), unlike a trained checkpoint: the `note` field says so.

Prints one JSON object per line; `--out FILE` also writes them as a list.
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import gc
import importlib.util
import os
import re
import subprocess
import sys
import time

import numpy as np

TINY = dict(model_type="qwen3_moe", vocab_size=256, hidden_size=64, intermediate_size=128,
            moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, tie_word_embeddings=False,
            rope_theta=1e6, max_position_embeddings=4096, rms_norm_eps=1e-6)
Example = collections.namedtuple("Example", "prompt_ids index")  # what rollout_batch reads of a prompt
PARTS = ("decode", "update", "mismatch")
ROUTING_NOTE = ("random-init weights: the routers are random, so routing is near-uniform over experts and "
                "top-k margins are those of random logits, unlike a trained checkpoint's")


def _script(name: str):
    """A sibling script as a module (scripts/ is no package)."""
    if name in sys.modules:
        return sys.modules[name]
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), f"{name}.py")
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def shape_kwargs(shape: str, layers: int) -> tuple[str, dict]:
    """(model name, ModelConfig keyword arguments of the MoE) of a `--shape` preset."""
    from jaxrl_llm.models import QWEN3_MOE_SHAPES

    if shape == "tiny":
        return "qwen3-moe-tiny", dict(TINY)
    m = re.fullmatch(r"qwen3-30b-a3b(?:-L(\d+))?", shape)
    if not m:
        raise SystemExit(f"--shape={shape!r}: choose tiny, qwen3-30b-a3b or qwen3-30b-a3b-L<layers>")
    layers = int(m.group(1) or layers)
    if layers < 1:
        raise SystemExit(f"--layers={layers} must be >= 1")
    return f"qwen3-30b-a3b-L{layers}", dict(QWEN3_MOE_SHAPES["30b-a3b"], num_hidden_layers=layers)


def model_configs(moe_kwargs: dict, **common):
    """(the MoE's ModelConfig, its dense twin's): same attention, embedding, head and norms; the
    twin's MLP is dense SwiGLU of width top_k * moe_intermediate_size (qk_norm: Qwen3's)."""
    from jaxrl_llm.models import ModelConfig

    moe = ModelConfig(**moe_kwargs, qk_norm=True, **common)
    dense_kwargs = {k: v for k, v in moe_kwargs.items()
                    if k not in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob")}
    dense_kwargs.update(model_type="qwen3",
                        intermediate_size=moe_kwargs["num_experts_per_tok"] * moe_kwargs["moe_intermediate_size"])
    return moe, ModelConfig(**dense_kwargs, qk_norm=True, **common)


def param_counts(cfg) -> dict:
    """total, expert (the sparse experts' weights) and active (per token: total minus the
    unchosen experts') parameter counts, from the model's abstract shapes."""
    import math

    import jax
    from flax import nnx

    from jaxrl_llm.models import abstract_model

    pure = nnx.to_pure_dict(nnx.state(abstract_model(cfg), nnx.Param))
    total = expert = 0
    for path, x in jax.tree_util.tree_leaves_with_path(pure):
        n = math.prod(x.shape)
        total += n
        if any(getattr(p, "key", None) == "experts" for p in path):
            expert += n
    active = total - (expert - expert * cfg.num_experts_per_tok // cfg.num_experts if cfg.is_moe else 0)
    return {"total_params": int(total), "expert_params": int(expert), "active_params": int(active)}


RAGGED_FUSION_FLAG = "--xla_gpu_experimental_use_ragged_dot_fusion=true"




def ragged_dot_check(cfg, tokens: int) -> dict:
    """How this backend compiles the experts' grouped matmul (`jax.lax.ragged_dot`) at this
    shape: `tokens` * top_k rows of [hidden] x [experts, hidden, moe_intermediate], forward and
    weight gradient (ragged contracting dims). `<part>_expanded`: the optimized program has no
    grouped matmul left (no `ragged-dot` op, e.g. in a cuDNN fusion, and no Pallas kernel): XLA's
    GPU fallback replaced it by a dense dot over all experts (x experts FLOPs and a
    [rows, experts, hidden] operand). `<part>_flops_ratio`: XLA's FLOP count over the grouped
    matmul's 2 * rows * hidden * width, for information (XLA counts a kept weight-gradient
    ragged dot as dense too, and a custom call as 0)."""
    from jaxrl_llm.models._decoder import program_expanded, ragged_dot_programs

    rows = tokens * cfg.num_experts_per_tok
    e, f, n = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts
    ideal = 2.0 * rows * e * f
    out = {"rows": rows, "ideal_flops": ideal}
    for name, compiled in ragged_dot_programs(n, e, f, rows=rows).items():
        out[f"{name}_expanded"] = program_expanded(compiled)
        try:
            cost = compiled.cost_analysis()
            cost = cost[0] if isinstance(cost, (list, tuple)) else cost
            flops = (cost or {}).get("flops")
        except Exception:  # noqa: BLE001 - information only
            flops = None
        out[f"{name}_flops_ratio"] = None if flops is None else float(flops) / ideal
    out["expanded"] = out["fwd_expanded"] or out["wgrad_expanded"]
    return out


def _triton_lowering(on: bool | None = None) -> bool:
    """JAX's `jax_ragged_dot_use_gpu_pallas_triton_lowering` (set it when `on` is given); False
    where this JAX has no such option."""
    import jax

    try:
        if on is not None:
            jax.config.update("jax_ragged_dot_use_gpu_pallas_triton_lowering", bool(on))
        return bool(jax.config.jax_ragged_dot_use_gpu_pallas_triton_lowering)
    except (AttributeError, KeyError, ValueError):
        return False


def probe_xla_flag(flag: str) -> dict:
    """Start JAX in a child process with `flag` added to XLA_FLAGS (XLA aborts a process on a
    flag it does not know, so this one is set only when the child starts cleanly)."""
    env = dict(os.environ, XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " " + flag).strip())
    try:
        r = subprocess.run([sys.executable, "-c", "import jax; print(jax.default_backend())"], env=env,
                           capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired:
        return {"ok": False, "error": "timed out"}
    if r.returncode != 0:
        return {"ok": False, "error": r.stderr[-500:]}
    return {"ok": True, "backend": (r.stdout.strip().splitlines() or ["?"])[-1]}


def _cudnn_versions() -> dict:
    """cuDNN as jaxlib reports it and as pip installed it (best effort: XLA's cuDNN ragged-dot
    fusion needs cuDNN >= 9.22; its weight gradient a newer one)."""
    from importlib import metadata

    out = {}
    try:
        from jax._src.lib import cuda_versions
        out["jaxlib_cudnn"] = cuda_versions.cudnn_get_version() if cuda_versions else None
    except Exception:  # noqa: BLE001 - information only
        out["jaxlib_cudnn"] = None
    for pkg in ("nvidia-cudnn-cu13", "nvidia-cudnn-cu12"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            pass
    return out


def check_dispatch(moe, args) -> dict:
    """`ragged_dot_check` at the update's micro-batch tokens under the chosen `--ragged-dot`;
    in auto mode on a GPU, when XLA expands it, retry with JAX's Pallas Triton lowering."""
    import jax

    tokens = args.micro * args.update_len
    rec = {"bench": "moe_dispatch_check", "backend": jax.default_backend(), "ragged_dot": args.ragged_dot,
           "xla_flags": os.environ.get("XLA_FLAGS", ""), "fusion_flag_probe": getattr(args, "flag_probe", None),
           "cudnn": _cudnn_versions(), "jax": jax.__version__}
    if args.ragged_dot == "triton" and not _triton_lowering(True):
        rec["triton_error"] = "this JAX has no jax_ragged_dot_use_gpu_pallas_triton_lowering option"
    try:
        rec.update(ragged_dot_check(moe, tokens))
    except Exception as e:  # noqa: BLE001
        rec.update(error=repr(e)[-1000:], expanded=True, fwd_expanded=True)
    if args.ragged_dot == "auto" and rec["backend"] == "gpu" and rec["expanded"]:
        if _triton_lowering(True):
            try:
                tri = ragged_dot_check(moe, tokens)
            except Exception as e:  # noqa: BLE001
                tri = {"error": repr(e)[-1000:], "expanded": True, "fwd_expanded": True}
        else:
            tri = {"error": "this JAX has no jax_ragged_dot_use_gpu_pallas_triton_lowering option",
                   "expanded": True, "fwd_expanded": True}
        rec["triton"] = tri
        better = not tri.get("error") and (tri["expanded"] < rec["expanded"]
                                           or tri["fwd_expanded"] < rec["fwd_expanded"])
        if better:
            rec.update(ragged_dot="triton", expanded=tri["expanded"], fwd_expanded=tri["fwd_expanded"])
        else:
            _triton_lowering(False)  # no better
    rec["triton_lowering"] = _triton_lowering()
    return rec


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="qwen3-30b-a3b", help="tiny | qwen3-30b-a3b | qwen3-30b-a3b-L<layers>")
    p.add_argument("--layers", type=int, default=4, help="layers of the qwen3-30b-a3b shape (no -L<n>)")
    p.add_argument("--skip", default="", help=f"comma-separated parts to skip: {','.join(PARTS)}")
    p.add_argument("--batches", nargs="+", type=int, default=[64, 256], help="decode batch sizes")
    p.add_argument("--prompt-len", type=int, default=512, help="decode and mismatch prompt tokens")
    p.add_argument("--gen-len", type=int, default=256, help="decode and mismatch generated tokens")
    p.add_argument("--steps-per-sync", type=int, default=32)
    p.add_argument("--layout", default="per_layer", choices=["per_layer", "per_layer_fused", "stacked", "auto"],
                   help="the engine's layer_layout")
    p.add_argument("--update-rows", type=int, default=16, help="rows of the timed update's mini-batch")
    p.add_argument("--update-len", type=int, default=1024, help="tokens per row (half prompt, half response)")
    p.add_argument("--micro", type=int, default=8, help="micro-batch rows of the update")
    p.add_argument("--remat", default="dots", choices=["none", "full", "dots", "dots_no_batch"])
    p.add_argument("--steps", type=int, default=2, help="timed update steps after one warm-up step")
    p.add_argument("--aux-loss-coef", type=float, default=0.001, help="model.moe.aux_loss_coef of the MoE update")
    p.add_argument("--mismatch-rows", type=int, default=16, help="samples the mismatch part generates and scores")
    p.add_argument("--hbm-gbs", type=float, default=4800.0, help="HBM bandwidth, GB/s (H200: 4800)")
    p.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak, TFLOP/s (H200: 989)")
    p.add_argument("--ragged-dot", default="auto", choices=["auto", "xla", "cudnn", "triton"],
                   help="the experts' grouped matmul on GPU: cudnn (XLA's cuDNN ragged-dot fusion flag), "
                   "xla (no flag), triton (JAX's Pallas Triton lowering), auto (cudnn, then triton if XLA "
                   "still expands it to a dense dot over all experts)")
    p.add_argument("--out", default="", help="also write the results (a JSON list) here")
    p.add_argument("--tiny", "--dry-run", dest="tiny", action="store_true",
                   help="tiny shape, batch 4, 16+8 tokens, 8-row updates of 16 tokens: a CPU smoke run")
    args = p.parse_args(argv)
    skip = {s for s in args.skip.split(",") if s}
    if skip - set(PARTS):
        p.error(f"--skip={args.skip!r}: parts are {','.join(PARTS)}")
    args.parts = [part for part in PARTS if part not in skip]
    if args.tiny:
        args.shape, args.batches, args.prompt_len, args.gen_len, args.steps_per_sync = "tiny", [4], 16, 8, 4
        args.update_rows, args.update_len, args.micro, args.steps, args.mismatch_rows = 8, 16, 4, 1, 4
    if args.update_len < 2 or args.update_len % 2:
        p.error(f"--update-len={args.update_len} must be even (half prompt, half response)")
    if args.update_rows % args.micro:
        p.error(f"--update-rows={args.update_rows} must be a multiple of --micro={args.micro}")
    return args


def _failed(part, name, args, e) -> dict:
    if args.tiny:
        raise e
    return {"bench": f"moe_{part}", "model": name, "error": repr(e)[-2000:]}


def bench_decode(name, moe, dense, counts, args, emit) -> None:
    """Each engine's record to `emit` as it is measured, then the batch's MoE/dense ratios."""
    import jax.numpy as jnp

    br = _script("bench_rollout")
    ns = br.parse_args(["--batches", "1", "--prompt-len", str(args.prompt_len), "--gen-len", str(args.gen_len),
                        "--steps-per-sync", str(args.steps_per_sync), "--hbm-gbs", str(args.hbm_gbs),
                        "--tflops", str(args.peak_tflops), "--no-peer", "--sync-repeats", "1"])
    for batch in args.batches:
        recs = {}
        for kind, cfg in (("moe", moe), ("dense", dense)):
            if cfg is None:
                continue
            label = name if kind == "moe" else f"{name}-dense-twin"
            gc.collect()  # the previous engine (a reference cycle through its jits) and its cache
            try:
                rec = br.bench_ours(label, batch, ns, layout=args.layout, cfg=cfg)
            except Exception as e:  # noqa: BLE001 - one failed engine must not hide the others
                emit(_failed("decode", label, args, e))
                continue
            c = counts[kind]
            itemsize = jnp.dtype(cfg.param_dtype).itemsize
            frac = 1.0 - (1.0 - cfg.num_experts_per_tok / cfg.num_experts) ** batch if cfg.is_moe else 1.0
            weight_bytes = int((c["total_params"] - c["expert_params"] * (1.0 - frac)) * itemsize)
            step_ms = rec["ms_per_step"]
            cost = br.step_cost(cfg, c["active_params"], batch, rec["decode_context"], hbm_gbs=args.hbm_gbs,
                                tflops=args.peak_tflops, weight_bytes=weight_bytes)
            rec.update({"bench": "moe_decode", "model": label, "kind": kind, **c, **cost,
                        "expected_expert_fraction": frac,
                        "roofline_fraction": cost["roofline_ms"] / step_ms,
                        "hbm_fraction": cost["bytes_per_step"] / (step_ms / 1e3) / (args.hbm_gbs * 1e9)})
            recs[kind] = rec
            emit(rec)
        if "moe" in recs and "dense" in recs:
            ratio = recs["moe"]["ms_per_step"] / recs["dense"]["ms_per_step"]
            emit({"bench": "moe_decode_vs_dense", "model": name, "batch": batch,
                  "moe_ms_per_step": recs["moe"]["ms_per_step"], "dense_ms_per_step": recs["dense"]["ms_per_step"],
                  "moe_over_dense": {"ms_per_step": ratio, "decode_tokens_per_s": 1.0 / ratio,
                                     "total_s": recs["moe"]["total_s"] / recs["dense"]["total_s"]}})


def bench_update(name, moe, dense, counts, args, emit) -> None:
    """Each model's record to `emit` as it is measured, then the MoE/dense step-time ratio."""
    from jaxrl_llm.config import MoeConfig

    bt = _script("bench_train")
    half = args.update_len // 2
    ns = bt.parse_args(["--rows", str(args.update_rows), "--prompt-len", str(half), "--response-len", str(half),
                        "--steps", str(args.steps), "--peak-tflops", str(args.peak_tflops), "--devices", "1",
                        "--mesh", "1", "1", "1"])
    done = {}
    for kind, cfg in (("moe", moe), ("dense", dense)):
        if cfg is None:
            continue
        label = name if kind == "moe" else f"{name}-dense-twin"
        gc.collect()
        cfg = cfg.replace(param_dtype="float32", remat=args.remat)
        aux = MoeConfig(aux_loss_coef=args.aux_loss_coef, z_loss_coef=0.0) if cfg.is_moe else None
        try:
            rec = bt._run_config(label, args.remat, args.micro, ns, cfg=cfg, moe=aux)
        except Exception as e:  # noqa: BLE001
            emit(_failed("update", label, args, e))
            continue
        c = counts[kind]
        fpt = bt.flops_per_token(cfg, c["active_params"], args.update_len)
        tokens = rec["rows"] * rec["seq_len"]
        rec.update({"bench": "moe_update", "model": label, "kind": kind, **c, "flops_per_token": fpt,
                    "mfu": fpt * tokens / (rec["step_s"] * args.peak_tflops * 1e12),
                    "mfu_counts": "6 * active params (no embedding lookup) + 12 * layers * heads * head_dim * seq "
                                  "(attention counted; remat recomputation not)",
                    "aux_loss_coef": args.aux_loss_coef if cfg.is_moe else 0.0})
        rec.pop("params", None)
        emit(rec)
        done[kind] = rec
    if len(done) == 2:
        emit({"bench": "moe_update_vs_dense", "model": name, "moe_step_s": done["moe"]["step_s"],
              "dense_step_s": done["dense"]["step_s"], "moe_mfu": done["moe"]["mfu"], "dense_mfu": done["dense"]["mfu"],
              "moe_over_dense": {"step_s": done["moe"]["step_s"] / done["dense"]["step_s"]}})


def bench_mismatch(name, moe, args) -> dict:
    """Engine-recorded vs trainer routing and log-probs in bf16, without and with replay."""
    import jax
    import jax.numpy as jnp

    import rollout
    import sharding
    from jaxrl_llm import config as C, models
    from jaxrl_llm.config import RouterReplayConfig
    from jaxrl_llm.data import RolloutResult
    from jaxrl_llm.trainer._batch import rollout_batch
    from jaxrl_llm.trainer._old_log_prob import router_replay_metrics
    from jaxrl_llm.workers import ActorWorker
    from rollout._engine import PREFILL_BUCKETS

    gc.collect()
    cfg = moe.replace(param_dtype="float32", dtype="bfloat16")  # the trainer's: fp32 params, bf16 compute
    model = models.init_model(cfg, seed=0)
    prefill_len = next(b for b in PREFILL_BUCKETS if b >= args.prompt_len)
    rows = args.mismatch_rows
    engine = rollout.Engine.from_model(model, max_concurrent_decodes=rows, max_prefill_length=prefill_len,
                                       max_target_length=max(prefill_len + 1, args.prompt_len + args.gen_len),
                                       dtype=jnp.bfloat16, temperature=1.0, layer_layout=args.layout,
                                       record_experts=True)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, cfg.vocab_size, args.prompt_len).tolist() for _ in range(rows)]
    t0 = time.perf_counter()
    out = rollout.RolloutDriver(engine, steps_per_sync=args.steps_per_sync).generate(
        prompts, n=1, max_new_tokens=args.gen_len, sampling=rollout.SamplingParams(temperature=1.0), seed=0)
    generate_s = time.perf_counter() - t0
    del engine
    gc.collect()
    gen = RolloutResult(responses=out.responses, response_mask=out.response_mask,
                        rollout_log_probs=out.rollout_log_probs, finish_reasons=tuple(out.finish_reasons),
                        response_lengths=out.response_lengths, prompt_index=out.prompt_index,
                        routed_experts=out.routed_experts)
    examples = [Example(p, i) for i, p in enumerate(prompts)]
    batch = rollout_batch(examples, gen, n=1, pad_token_id=0, max_prompt_length=args.prompt_len)

    cd = C.base_config()
    cd.actor.ppo_micro_batch_size_per_device = min(rows, args.micro)
    cd.data.builtin_task, cd.model.tokenizer = "arithmetic", "char"  # validation only
    actor_cfg = dataclasses.replace(C.to_run_config(cd).actor, router_replay=RouterReplayConfig(mode="replay"))
    mesh = sharding.make_mesh((1, 1, 1), devices=jax.devices()[:1])
    actor = ActorWorker(model, actor_cfg, mesh=mesh, total_steps=1, temperature=1.0)
    del model
    t0 = time.perf_counter()
    got = actor.compute_log_prob(batch)
    log_prob_s = time.perf_counter() - t0
    del actor
    mask = batch.response_mask.astype(bool)

    def diff(lp):
        d = np.abs(lp - batch.rollout_log_probs)[mask]
        return {"mean": float(d.mean()), "max": float(d.max()), "p99": float(np.quantile(d, 0.99))}

    metrics = router_replay_metrics(got, batch)
    return {"bench": "moe_mismatch", "model": name, "device": jax.devices()[0].device_kind,
            "engine_dtype": "bfloat16", "trainer_param_dtype": "float32", "trainer_compute_dtype": "bfloat16",
            "layer_layout": args.layout, "rows": rows, "prompt_len": args.prompt_len, "gen_len": args.gen_len,
            "response_tokens": int(mask.sum()), "routings_compared": int(got["router_compared"].sum()),
            "router_mismatch_frac": metrics["rollout/router_replay/mismatch_frac"],
            "logprob_abs_diff_without_replay": diff(got["log_probs_without_replay"]),
            "logprob_abs_diff_with_replay": diff(got["old_log_probs"]),
            "engine_logprob_mean": float(batch.rollout_log_probs[mask].mean()),
            "generate_s_with_compile": generate_s, "log_prob_s_with_compile": log_prob_s,
            "note": ROUTING_NOTE}


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    args.flag_probe = None
    if args.ragged_dot in ("auto", "cudnn") and "ragged_dot_fusion" not in os.environ.get("XLA_FLAGS", ""):
        # read when the backend starts: set before the first jax import of this process
        args.flag_probe = probe_xla_flag(RAGGED_FUSION_FLAG)
        if args.flag_probe["ok"]:
            os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + RAGGED_FUSION_FLAG).strip()
    from jaxrl_llm.metrics import JsonReport

    report = JsonReport(args.out)
    name, kwargs = shape_kwargs(args.shape, args.layers)
    moe, dense = model_configs(kwargs, dtype="bfloat16", param_dtype="bfloat16", train_attention="auto")
    counts = {"moe": param_counts(moe), "dense": param_counts(dense)}
    report.add({"bench": "moe_shapes", "model": name, "moe": counts["moe"], "dense_twin": counts["dense"],
                "layers": moe.num_hidden_layers, "experts": moe.num_experts, "top_k": moe.num_experts_per_tok,
                "moe_intermediate_size": moe.moe_intermediate_size, "dense_intermediate_size": dense.intermediate_size,
                "parts": args.parts, "note": ROUTING_NOTE})
    check = check_dispatch(moe, args)
    report.add(check)
    # where XLA would expand the grouped matmul on a GPU, the model runs its experts densely
    # (`_decoder.dense_experts`): the MoE records say which dispatch they timed
    dispatch = "dense" if check["backend"] == "gpu" and check["expanded"] else "ragged_dot"
    add = lambda rec: report.add(dict(rec, experts_dispatch=dispatch) if rec.get("kind") != "dense" else rec)  # noqa: E731
    # the order: the update first, on a clean device (its fp32 params and Adam moments are the
    # largest footprint), the decode last (it compiles two engines per batch size)
    if "update" in args.parts:
        bench_update(name, moe, dense, counts, args, add)
    if "mismatch" in args.parts:
        try:
            add(bench_mismatch(name, moe, args))
        except Exception as e:  # noqa: BLE001
            add(_failed("mismatch", name, args, e))
    if "decode" in args.parts:
        bench_decode(name, moe, dense, counts, args, add)
    return report.records


if __name__ == "__main__":
    main()
