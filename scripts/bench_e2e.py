"""End-to-end GRPO step benchmark: rollout, reward, old/ref log-probs, advantages, actor update
and weight sync, timed per stage with verl's metric names, on one or several accelerators.

    python scripts/bench_e2e.py                          # Qwen2.5-0.5B and -1.5B shapes
    python scripts/bench_e2e.py --models 1.5b --prompts 32 --steps 2
    python scripts/bench_e2e.py --mesh 1 -1 1 --rollout-mesh 1 1 -1     # fsdp train, TP decode
    python scripts/bench_e2e.py --placement separate --rollout-mesh 1 1 1 --overlap
    python scripts/bench_e2e.py --tiny                   # CPU smoke run (tests call it)
    python scripts/bench_e2e.py --models 1.5b --response-len 4096 --lengths lognormal \
        --modes padded packed                            # padded vs packed on long-tailed lengths

Placement (as `placement.*` in the run config): `colocated` runs everything on all devices (the
training mesh `--mesh`; `--rollout-mesh` other than 1 1 1 re-meshes the same devices for decode);
`separate` gives the rollout the last `--rollout-mesh` devices and training the rest;
`--overlap` (separate only) is the trainer's one-step-off-policy mode: step k+1's rollout runs
while step k trains, `timing_s/gen` is then only the wait for it and `timing_s/gen_async` its
whole duration.

The step is `RLTrainer.train_step`'s sequence of `HostWorker` calls (the workers the trainer
uses, in-process), on random-init bf16-compute models with Qwen2.5 shapes: `--prompts` random
prompts of `--prompt-len` tokens, `n` samples each, exactly `--response-len` generated tokens (no
stop token), a rule reward on the host (fraction of even token ids), GRPO advantages, a KL loss
against the reference (so the reference forward runs), one optimizer step per RL step.

Response lengths (`--lengths`): `fixed` (the default) keeps every response at the budget.
`lognormal` draws each row's length from lognormal(log `--median`, `--sigma`) rounded, in
[1, `--response-len`], deterministically per (step seed, row) (`response_length`); the generated
rows are cut to those lengths right after the rollout (tokens past the length become padding, out
of `response_mask`), before the reward and the log-prob passes: generation still runs every row to
the budget (its time is not what this workload measures), every training pass (old and reference
log-probs, the update) sees the long-tailed batch. The cut is host work inside the step time,
outside every timed stage.

Padded vs packed (`--modes padded packed`): each mode builds its own workers in turn in this
process, on the same prompts, seeds and lengths (like for like); `packed` sets
`model.use_remove_padding` and `actor.use_dynamic_bsz` with
`actor.ppo_max_token_len_per_device = --max-token-len` (the old- and
reference-log-prob passes inherit that budget; GRPO runs no critic), `padded` keeps `--micro`
rows per micro-batch. The benchmark calls the worker passes directly, so the old-log-prob pass
always runs (the trainer's `actor.skip_redundant_old_log_prob` does not apply here). Each mode's
record carries `mode`, `real_tokens` (prompt + response tokens in the masks over the timed
steps, pad excluded) and `real_tokens_per_s/<stage>` for `old_log_prob`, `ref`, `update_actor` and
`step` (those real tokens / the stage's seconds summed over the timed steps), `response_len_mean` / `response_len_max`, and `compiled/<pass>`
(the number of programs each jitted pass compiled, when jax exposes it) and
`compiled_after_warmup/<pass>` (the same after the warm-up step: a larger `compiled/` count means
a timed step met a new pack shape and its stage time includes a compilation). With both modes, a
record `bench: e2e_packing` follows with `speedup/<stage>` = padded seconds / packed seconds
(= packed / padded real tokens per second: the real tokens are the same). `compile_s/<stage>` is
the time JAX reported tracing, lowering and compiling inside the stage (`jax.monitoring` events),
`timing_s_excl_compile/<stage>` the stage without it and `speedup_excl_compile/<stage>` their
ratio: the steady-state comparison when a timed step met a new shape.

Reported per model (the mean over the timed steps after one warm-up step):
- `timing_s/<stage>` and `perf/throughput` = (prompt + response tokens) / step time / devices,
  verl's definition; `timing_s/update_tail` is the wait for the actor's new params after
  `update_actor` returned its metrics (synchronous steps), so that `timing_s/update_weights` times
  the sync alone; `--sync-twice` also times a second sync right after it
  (`timing_s/update_weights_again`, not in the step time);
- `sync/copy_limit_s` = (bytes read + bytes written by the cast-and-copy) / `--copy-tbs`, and
  `sync/multiple_of_copy_limit` = measured `timing_s/update_weights` / that; `sync/zero_copy_bytes`
  is what `update_params` moved when handed the engine's own (layout-matching) buffers;
- `idle_fraction` = 1 - (time inside device stages) / step time: host-only work (reward,
  advantages, batch assembly), a lower bound on the accelerator's idle time (not defined with
  `--overlap`, whose stages run at the same time);
- `--sync-repeats N` (after the steps; `--sync-only` skips the steps): N more back-to-back
  `HostWorker.sync_weights` calls, `sync/repeat_median_s` and its `sync/repeat_multiple_of_copy_limit`,
  split into `sync/engine_median_s` (`Engine.update_params` alone), `sync/host_s` (the sync's
  Python and program dispatch, not waiting for the device) and `sync/program_s` (N syncs enqueued
  back to back, one wait: the device program when it is the bottleneck); `--sync-trace FILE` also
  writes a `jax.profiler` trace of 5 syncs and reports `sync/trace` (kernel ms and calls per sync);
- with several devices, `sync/cross_device_bytes_max` = the most bytes any one device must receive
  from other devices to build its rollout shards (counted at the rollout dtype), and
  `sync/multiple_of_link_limit` = sync time / (that / `--link-gbs`), the NVLink byte limit.
"""
from __future__ import annotations

import argparse
import functools
import math
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import numpy as np

from jaxrl_llm.models import QWEN25_SHAPES

_ARCH = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads")
QWEN25 = {k: {f: QWEN25_SHAPES[k][f] for f in _ARCH} for k in ("0.5b", "1.5b", "tiny")}
VOCAB = {k: QWEN25_SHAPES[k]["vocab_size"] for k in QWEN25}
DEVICE_STAGES = ("gen", "old_log_prob", "ref", "update_actor", "update_tail", "update_weights")
PACKING_STAGES = ("old_log_prob", "ref", "update_actor", "step")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", nargs="+", default=["0.5b", "1.5b"], choices=sorted(QWEN25))
    p.add_argument("--prompts", type=int, default=32, help="prompts per step")
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--response-len", type=int, default=1024)
    p.add_argument("--steps", type=int, default=2, help="timed steps after one warm-up step")
    p.add_argument("--micro", type=int, default=8, help="micro-batch rows per device (update, log-probs)")
    p.add_argument("--remat", default="dots", choices=["none", "full", "dots", "dots_no_batch"])
    p.add_argument("--param-dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--steps-per-sync", type=int, default=64)
    p.add_argument("--copy-tbs", type=float, default=4.3, help="measured device copy rate, TB/s")
    p.add_argument("--link-gbs", type=float, default=450.0,
                   help="device-to-device link rate per direction, GB/s (H100/H200 NVLink 4: 450)")
    p.add_argument("--mesh", nargs=3, type=int, default=[1, -1, 1], metavar=("DATA", "FSDP", "TENSOR"),
                   help="training mesh (-1 = fill with the training devices)")
    p.add_argument("--placement", default="colocated", choices=["colocated", "separate"])
    p.add_argument("--rollout-mesh", nargs=3, type=int, default=[1, 1, 1], metavar=("DATA", "FSDP", "TENSOR"),
                   help="colocated: 1 1 1 = the training mesh, else a re-mesh of its devices; "
                        "separate: the rollout's own devices")
    p.add_argument("--overlap", action="store_true",
                   help="one-step-off-policy: rollout of step k+1 during step k (needs --placement separate)")
    p.add_argument("--sync-repeats", type=int, default=0,
                   help="after the steps, time this many more weight syncs (median) and split them")
    p.add_argument("--sync-twice", action="store_true",
                   help="sync a second time right after each step's sync (timing_s/update_weights_again), "
                   "outside the step time")
    p.add_argument("--sync-only", action="store_true",
                   help="no GRPO steps: build the workers, then the --sync-repeats timings (default 20)")
    p.add_argument("--sync-trace", default="", help="trace 5 weight syncs into this .json.gz file")
    p.add_argument("--lengths", default="fixed", choices=["fixed", "lognormal"],
                   help="response lengths: fixed = all at --response-len; lognormal = drawn per row, "
                        "rows cut to them before the training passes")
    p.add_argument("--median", type=float, default=300.0, help="--lengths lognormal: median length")
    p.add_argument("--sigma", type=float, default=1.0, help="--lengths lognormal: log-std")
    p.add_argument("--modes", nargs="+", default=["padded"], choices=["padded", "packed"],
                   help="padded = --micro rows per micro-batch; packed = model.use_remove_padding + actor.use_dynamic_bsz with "
                        "--max-token-len tokens per device per micro-batch; both: one after the other")
    p.add_argument("--packing", action="store_true", help="= --modes packed")
    p.add_argument("--max-token-len", type=int, default=16384,
                   help="packed: actor.ppo_max_token_len_per_device (prompt + response tokens)")
    p.add_argument("--out", default="", help="also write the results (a JSON list) here")
    p.add_argument("--peak-tflops", type=float, default=989.0,
                   help="the device's dense bf16 peak for mfu_real/* (989: H100/H200)")
    p.add_argument("--add-mfu", default="", metavar="JSON",
                   help="only add mfu_real/* to the records of a saved --out file (rewritten in place)")
    p.add_argument("--tiny", "--dry-run", dest="tiny", action="store_true",
                   help="tiny model, 2 prompts x 2 samples, 8+8 tokens, fp32, CPU: a smoke run")
    args = p.parse_args(argv)
    if args.tiny:
        args.models, args.prompts, args.n, args.prompt_len, args.response_len = ["tiny"], 4, 2, 8, 8
        args.steps, args.micro, args.steps_per_sync = 1, 8, 4
        args.sync_repeats = args.sync_repeats or 2
    if args.packing:
        args.modes = ["packed"]
    args.modes = list(dict.fromkeys(args.modes))
    if args.median <= 0 or args.sigma < 0:
        p.error("--median must be > 0 and --sigma >= 0")
    if args.sync_only:
        args.sync_repeats = args.sync_repeats or 20
    if args.overlap and args.placement != "separate":
        p.error("--overlap needs --placement separate")
    return args


def _config(name: str, args, mode: str = "padded"):
    from jaxrl_llm import config as C

    tiny = name == "tiny"
    c = C.base_config()
    s = QWEN25[name]
    c.model.init.update(model_type="qwen2", rope_theta=1e6, max_position_embeddings=32768,
                        head_dim=s["hidden_size"] // s["num_attention_heads"], tie_word_embeddings=True, **s)
    c.model.dtype = "float32" if tiny else "bfloat16"
    c.model.param_dtype = "float32" if tiny else args.param_dtype
    c.model.remat = args.remat
    c.data.max_prompt_length = args.prompt_len
    c.data.max_response_length = args.response_len
    c.data.train_batch_size = args.prompts
    c.actor.ppo_mini_batch_size = args.prompts  # one optimizer step per RL step
    c.actor.ppo_micro_batch_size_per_device = args.micro
    c.actor.use_kl_loss = True
    if mode == "packed":  # verl's two switches together: packed rows in token-budget micro-batches
        c.model.use_remove_padding = True
        c.actor.use_dynamic_bsz = True
        c.actor.ppo_max_token_len_per_device = args.max_token_len
    c.rollout.n = args.n
    c.rollout.max_concurrent_decodes = args.prompts * args.n
    c.rollout.steps_per_sync = args.steps_per_sync
    c.trainer.default_local_dir = "/tmp/bench_e2e"
    c.data.builtin_task, c.model.tokenizer = "arithmetic", "char"  # validation only: prompts are ours
    c.trainer.async_save = False
    c.mesh.data, c.mesh.fsdp, c.mesh.tensor = args.mesh
    c.placement.mode = args.placement
    r = c.placement.rollout_mesh
    r.data, r.fsdp, r.tensor = args.rollout_mesh
    c.placement.one_step_off_policy = args.overlap
    return C.to_run_config(c)


def _reward(responses: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """A rule reward in [0, 1]: the fraction of even token ids in the response."""
    return ((responses % 2 == 0) * mask).sum(-1) / np.maximum(mask.sum(-1), 1)


def response_length(seed: int, row: int, *, median: float, sigma: float, cap: int) -> int:
    """Row `row`'s response length at step `seed`: lognormal(log(median), sigma) rounded, in
    [1, cap]; the same on every call (its own generator per (seed, row))."""
    rng = np.random.default_rng([seed, row])
    return int(min(cap, max(1, round(rng.lognormal(math.log(median), sigma)))))


def cut_responses(gen, lengths: np.ndarray):
    """The rollout `gen` with row i's response cut to `lengths[i]` tokens: the rest right-padded
    (token 0, out of the mask, log-prob 0, version -1)."""
    keep = np.arange(gen.responses.shape[1])[None, :] < np.asarray(lengths)[:, None]
    fields = {"responses": np.where(keep, gen.responses, 0),
              "response_mask": np.where(keep, gen.response_mask, 0),
              "rollout_log_probs": np.where(keep, gen.rollout_log_probs, 0.0).astype(np.float32)}
    if gen.response_attention_mask is not None:
        fields["response_attention_mask"] = np.where(keep, gen.response_attention_mask, 0)
    if gen.rollout_versions is not None:
        fields["rollout_versions"] = np.where(keep, gen.rollout_versions, -1)
    if gen.response_lengths is not None:
        fields["response_lengths"] = np.minimum(gen.response_lengths, lengths).astype(np.int32)
    return gen.replace(**fields)


def _generate(worker, cfg, prompts, seed: int) -> dict:
    import rollout

    return worker.generate([e.prompt_ids for e in prompts], n=cfg.rollout.n,
                           max_new_tokens=cfg.data.max_response_length,
                           sampling=rollout.SamplingParams(temperature=1.0), seed=seed)


# seconds JAX spent tracing, lowering and compiling programs, all threads (`_watch_compiles`)
_COMPILE_S = [0.0]
_COMPILE_EVENTS = ("/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/jaxpr_to_mlir_module_duration",
                   "/jax/core/compile/backend_compile_duration")


@functools.cache
def _watch_compiles() -> None:
    """Adds every trace / lowering / backend-compile duration JAX reports to `_COMPILE_S` (once per
    process), so a stage's time can be given without the compiles inside it."""
    import jax

    def listen(event, duration, **_):
        if event in _COMPILE_EVENTS:
            _COMPILE_S[0] += float(duration)

    jax.monitoring.register_event_duration_secs_listener(listen)


def _step(worker, cfg, prompts, seed: int, *, overlap=False, pending=None, start_next=None, twice=False,
          lengths=None):
    """One GRPO step -> (timing, step info, future of the next step's rollout or None).

    Synchronous: generates `prompts` now and syncs weights at the end. One-step-off-policy
    (`overlap`): takes this step's rollout from `pending` (a future) if there is one, syncs the
    now idle engine, calls `start_next()` (if given) to start the next rollout, then trains.
    `lengths` (a dict of `response_length`'s keywords) cuts the rows to drawn lengths."""
    import jax

    from jaxrl_llm.trainer import _batch as B

    timing: dict[str, float] = {}

    _watch_compiles()

    def timed(name, fn):
        t0, c0 = time.perf_counter(), _COMPILE_S[0]
        out = fn()
        timing[name] = time.perf_counter() - t0
        timing[f"compile_s/{name}"] = _COMPILE_S[0] - c0  # compiles inside it (overlap: any thread's)
        return out

    t_step, c_step = time.perf_counter(), _COMPILE_S[0]
    n = cfg.rollout.n
    if pending is not None:
        gen = timed("gen", pending.result)
        timing["gen_async"] = gen.time_s
    else:
        gen = timed("gen", lambda: _generate(worker, cfg, prompts, seed))
    following = None
    if overlap:  # the engine is idle now: give it the newest weights, start the next rollout
        sync = timed("update_weights", worker.sync_weights)
        following = start_next() if start_next is not None else None
    if lengths is not None:  # the long-tailed workload: every training pass sees the cut rows
        gen = cut_responses(gen, np.array([response_length(seed, r, **lengths) for r in range(gen.rows)]))
    batch = B.rollout_batch(prompts, gen, n=n, pad_token_id=0, max_prompt_length=cfg.data.max_prompt_length)

    def reward():
        batch.token_level_scores = B.token_level_scores(
            _reward(batch.responses, batch.response_mask).astype(np.float32), batch.response_mask)
    timed("reward", reward)
    batch.old_log_probs = timed("old_log_prob", lambda: worker.compute_old_log_prob(batch))["old_log_probs"]
    batch.update(timed("ref", lambda: worker.compute_ref_log_prob(batch)))

    def adv():
        batch.token_level_rewards = batch.token_level_scores
        batch.advantages, batch.returns = B.compute_advantages(
            batch, estimator="grpo", gamma=1.0, lam=1.0, norm_adv_by_std_in_grpo=True)
    timed("adv", adv)
    metrics = timed("update_actor", lambda: worker.update_actor(
        batch, mini_rows=cfg.actor.ppo_mini_batch_size * n, seed=seed))
    if not overlap:
        # what is still running of the update once its metrics are back (its new params), so
        # that `update_weights` below times the sync alone
        timed("update_tail", lambda: jax.block_until_ready(worker.actor.params))
        sync = timed("update_weights", worker.sync_weights)
    timing["step"] = time.perf_counter() - t_step
    timing["compile_s/step"] = _COMPILE_S[0] - c_step
    if twice and not overlap:  # the same sync again at once: what the first one pays for coming first
        timed("update_weights_again", worker.sync_weights)
    n_prompt = int(batch.attention_mask[:, :batch.prompts.shape[1]].sum())
    n_resp = int(batch.response_mask.sum())
    resp_lens = batch.response_mask.sum(-1)
    return timing, {"n_prompt": n_prompt, "n_resp": n_resp, "sync": sync, "resp_lens": resp_lens,
                    "score": float(batch["token_level_scores"].sum(-1).mean()), **metrics}, following


def run_model(name: str, args, mode: str = "padded") -> dict:
    import jax

    from jaxrl_llm import metrics as M
    from jaxrl_llm.workers import HostWorker

    cfg = _config(name, args, mode)
    rng = np.random.default_rng(0)
    worker = HostWorker(cfg, vocab_size=VOCAB[name], pad_token_id=0, stop_token_ids=())
    info = worker.info()
    t0 = time.perf_counter()
    start = worker.start_rl(total_steps=100)
    setup_s = time.perf_counter() - t0

    def prompts():
        return [SimpleNamespace(prompt_ids=rng.integers(1, VOCAB[name], args.prompt_len).tolist())
                for _ in range(args.prompts)]

    out = {"bench": "e2e", "model": f"qwen2.5-{name}", "params": info["num_params"],
           "device": info["device_kind"], "num_devices": info["num_devices"],
           "prompts": args.prompts, "n": args.n, "prompt_len": args.prompt_len,
           "response_len": args.response_len, "remat": args.remat, "micro_batch": args.micro,
           "param_dtype": args.param_dtype, "steps_timed": 0 if args.sync_only else args.steps,
           "placement": args.placement, "overlap": args.overlap, "mode": mode,
           "max_token_len": args.max_token_len if mode == "packed" else None, "lengths": args.lengths,
           **({"median": args.median, "sigma": args.sigma} if args.lengths == "lognormal" else {}),
           "train_mesh": dict(worker.mesh.shape), "rollout_mesh": dict(worker.rollout_mesh.shape),
           "rollout_layer_layout": worker.engine.layer_layout, "setup_s": setup_s}
    # weight sync against the byte-copy limit: read every source byte, write every target byte
    src = sum(x.nbytes for x in jax.tree.leaves(worker.actor.params))
    dst = sum(x.nbytes for x in jax.tree.leaves(worker.engine.params))
    limit = (src + dst) / (args.copy_tbs * 1e12) if start["bytes_moved"] > 0 else 0.0
    out.update({"sync/bytes_src": int(src), "sync/bytes_dst": int(dst), "sync/copy_limit_s": limit,
                "sync/start_rl_bytes_moved": int(start["bytes_moved"])})
    if not args.sync_only:
        out.update(_steps(worker, cfg, args, prompts, limit))
        out.update(mfu_real(out, args.peak_tflops))
    if args.sync_repeats:
        out.update(sync_timings(worker, args.sync_repeats, limit, args.sync_trace))
    if info["num_devices"] > 1:
        itemsize = np.dtype(jax.tree.leaves(worker.engine.params)[0].dtype).itemsize
        cross = cross_device_bytes(pure_params(worker.actor.params), _rollout_layout(worker), itemsize)
        link = max(cross.values()) / (args.link_gbs * 1e9)
        sync_s = out.get("timing_s/update_weights", out.get("sync/repeat_median_s"))
        out.update({"sync/cross_device_bytes_max": int(max(cross.values())),
                    "sync/cross_device_bytes_total": int(sum(cross.values())),
                    "sync/link_limit_s": link,
                    "sync/multiple_of_link_limit": sync_s / link if link else None})
    same = worker.engine.update_params(worker.engine.params)  # layouts match: nothing should move
    out["sync/zero_copy_bytes"] = int(same["bytes_moved"])
    out["sync/zero_copy_time_s"] = float(same["time_s"])
    out["perf/max_memory_allocated_gb"] = M.max_memory_allocated_gb()
    out.update(compiled_programs(worker))
    worker.close()
    return out


def compiled_programs(worker) -> dict:
    """`compiled/<pass>`: programs each jitted training pass compiled (jax's cache size; left out
    where the pass is not a plain jitted function)."""
    passes = {"old_log_prob": getattr(worker.actor, "_log_prob", None),
              "ref": getattr(worker.ref, "_log_prob", None) if worker.ref is not None
              else getattr(worker.actor, "_ref_log_prob", None),
              "update_actor": getattr(worker.actor, "_update", None)}
    out = {}
    for name, fn in passes.items():
        size = getattr(fn, "_cache_size", None)
        if callable(size):
            out[f"compiled/{name}"] = int(size())
    return out


def _steps(worker, cfg, args, prompts, limit: float) -> dict:
    """One warm-up GRPO step and `args.steps` timed ones -> the step metrics (means)."""
    from jaxrl_llm import metrics as M

    pool = ThreadPoolExecutor(1) if args.overlap else None
    pending = None
    timings, last, warmup_s, reals = [], None, 0.0, []
    batches = [prompts() for _ in range(args.steps + 1)]
    lengths = (dict(median=args.median, sigma=args.sigma, cap=args.response_len)
               if args.lengths == "lognormal" else None)
    for i in range(args.steps + 1):  # step 0 is the warm-up: it compiles every piece
        start_next = None
        if pool is not None and i < args.steps:
            start_next = functools.partial(pool.submit, _generate, worker, cfg, batches[i + 1], i + 1)
        t0 = time.perf_counter()
        timing, last, pending = _step(worker, cfg, batches[i], seed=i, overlap=args.overlap,
                                      pending=pending, start_next=start_next, twice=args.sync_twice,
                                      lengths=lengths)
        if i == 0:
            warmup_s = time.perf_counter() - t0
            after_warmup = compiled_programs(worker)
        else:
            timings.append(timing)
            reals.append(last["n_prompt"] + last["n_resp"])
    if pool is not None:
        pool.shutdown()
    keys = set.intersection(*(set(t) for t in timings))
    timing = {k: float(np.mean([t[k] for t in timings])) for k in sorted(keys)}
    compiles = {k: timing.pop(k) for k in [k for k in timing if k.startswith("compile_s/")]}
    out = {"warmup_step_s": warmup_s,
           **{k.replace("compiled/", "compiled_after_warmup/"): v for k, v in after_warmup.items()}}
    out.update(M.compute_timing_metrics(timing, num_prompt_tokens=last["n_prompt"],
                                        num_response_tokens=last["n_resp"]))
    out.update(M.compute_throughput_metrics(total_tokens=last["n_prompt"] + last["n_resp"],
                                            step_time_s=timing["step"], num_devices=worker.info()["num_devices"]))
    out["gen_tokens_per_s"] = last["n_resp"] / timing["gen"]
    out["idle_fraction"] = (None if args.overlap else
                            1.0 - sum(timing[s] for s in DEVICE_STAGES) / timing["step"])
    out.update({"sync/bytes_moved": int(last["sync"]["bytes_moved"]),
                "sync/zero_copy": bool(last["sync"]["zero_copy"]),
                "sync/donated": bool(last["sync"].get("donated", False)),
                "sync/multiple_of_copy_limit": timing["update_weights"] / limit if limit else None})
    out["actor/pg_loss"] = float(last["actor/pg_loss"])
    # per-stage throughput on real tokens: all timed steps' tokens / their summed stage seconds
    # (each step draws its own lengths); response lengths: the last step's
    out["real_tokens"] = int(sum(reals))
    out["response_len_mean"] = float(np.mean(last["resp_lens"]))
    out["response_len_max"] = int(np.max(last["resp_lens"]))
    out.update({f"real_tokens_per_s/{s}": sum(reals) / (timing[s] * len(reals)) if timing.get(s) else None
                for s in PACKING_STAGES})
    # the timed steps' compiles (a shape first seen after the warm-up) and each stage without them
    out.update(compiles)
    out.update({f"timing_s_excl_compile/{k[len('compile_s/'):]}": timing[k[len('compile_s/'):]] - v
                for k, v in compiles.items() if k[len("compile_s/"):] in timing})
    return out


# matmul FLOPs per real token, in units of N: the log-prob passes are forward only, the update
# forward + backward (remat's recomputation not counted)
_MFU_FLOPS_PER_N = {"old_log_prob": 2.0, "ref": 2.0, "update_actor": 6.0}


def mfu_real(record: dict, peak_tflops: float) -> dict:
    """`mfu_real/<stage>`: model FLOPs utilisation of a stage counted on REAL tokens only (prompt +
    response tokens in the masks; padding and pack filler add time, no FLOPs): real tokens/s x
    (2N forward, 6N update) / peak. N: the parameters in matmuls (the embedding lookup left out
    unless tied, where it is the LM head). Attention's FLOPs are not counted, so this is a lower
    bound that grows less than the time with long rows."""
    shape = QWEN25_SHAPES.get(record["model"].removeprefix("qwen2.5-"))
    if shape is None or not record.get("params"):
        return {}
    n = record["params"] - (0 if shape["tie_word_embeddings"] else shape["vocab_size"] * shape["hidden_size"])
    devices = record.get("num_devices", 1)
    return {f"mfu_real/{s}": record[f"real_tokens_per_s/{s}"] * k * n / (devices * peak_tflops * 1e12)
            for s, k in _MFU_FLOPS_PER_N.items() if record.get(f"real_tokens_per_s/{s}")}


def add_mfu(path: str, peak_tflops: float) -> list[dict]:
    """Adds `mfu_real/*` to every stage record of a saved JSON list (rewritten in place)."""
    import json

    with open(path) as f:
        records = json.load(f)
    for r in records:
        if r.get("bench") == "e2e" and "error" not in r:
            r.update(mfu_real(r, peak_tflops))
    with open(path, "w") as f:
        json.dump(records, f, indent=1)
    return records


def packing_summary(padded: dict, packed: dict) -> dict:
    """padded seconds / packed seconds per stage (> 1: packing is faster)."""
    out = {"bench": "e2e_packing", "model": padded["model"], "lengths": padded.get("lengths")}
    for s in PACKING_STAGES:
        a, b = padded.get(f"timing_s/{s}"), packed.get(f"timing_s/{s}")
        out[f"speedup/{s}"] = a / b if a and b else None
        a, b = padded.get(f"timing_s_excl_compile/{s}"), packed.get(f"timing_s_excl_compile/{s}")
        out[f"speedup_excl_compile/{s}"] = a / b if a and b else None
    return out


def sync_timings(worker, repeats: int, limit: float, trace: str = "") -> dict:
    """`repeats` more weight syncs after the run's own (warm) -> medians of the whole
    `HostWorker.sync_weights`, of `Engine.update_params` alone, of the sync's host part (Python
    and dispatch, no wait) and the device program's time with syncs enqueued back to back."""
    import jax

    engine = worker.engine
    params = worker.actor.rollout_params(engine.config.param_dtype)
    source = worker._to_replica(params) if worker.replica_mesh is not None else params

    def stats(fn) -> list[float]:
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return times

    def host_part():  # the engine's sync up to the enqueued program (what update_params adds: the wait)
        t0 = time.perf_counter()
        new = engine._sync(pure_params(source))[0]
        dt = time.perf_counter() - t0
        jax.block_until_ready(new)
        return dt

    whole = stats(worker.sync_weights)
    alone = stats(lambda: engine.update_params(source))
    host = [host_part() for _ in range(repeats)]
    t0 = time.perf_counter()
    new = None
    for _ in range(repeats):
        new = engine._sync(pure_params(source))[0]  # the previous copy is freed once read
    jax.block_until_ready(new)
    program = (time.perf_counter() - t0) / repeats
    del new
    engine.update_params(source)
    med = float(np.median(whole))
    out = {"sync/repeats": repeats, "sync/repeat_median_s": med, "sync/repeat_min_s": float(min(whole)),
           "sync/repeat_multiple_of_copy_limit": med / limit if limit else None,
           "sync/engine_median_s": float(np.median(alone)), "sync/host_s": float(np.median(host)),
           "sync/program_s": program}
    if trace:
        from jaxrl_llm.metrics import perfetto_trace

        import trace_summary
        perfetto_trace(lambda: [worker.sync_weights() for _ in range(5)], trace)
        try:
            out["sync/trace"] = trace_summary.summarize(trace_summary.load_events(trace), per=5, top=12)
        except ValueError as e:  # e.g. a CPU trace has no device tracks
            out["sync/trace"] = str(e)
    return out


def pure_params(params):
    """Params (a Param state, a module or a pure dict) as the pure dict the engine's sync takes:
    the engine's own conversion."""
    from rollout._engine import _pure

    return _pure(params)


def cross_device_bytes(src_tree, dst_shardings, itemsize: int) -> dict:
    """Bytes each device must receive from other devices to turn `src_tree`'s shards into the
    layout `dst_shardings` (a matching tree of shardings; elements of `itemsize` bytes): for each
    destination shard, its elements that the same device does not already hold in the source."""
    import jax

    src, dst = jax.tree.leaves(src_tree), jax.tree.leaves(dst_shardings)
    if len(src) != len(dst):
        raise ValueError(f"cross_device_bytes: {len(src)} source leaves vs {len(dst)} destination shardings")
    out: dict = {}
    for x, s in zip(src, dst):
        have = x.sharding.devices_indices_map(x.shape)
        for dev, idx in s.devices_indices_map(x.shape).items():
            want = _box(idx, x.shape)
            local = _overlap(want, _box(have[dev], x.shape)) if dev in have else 0
            out[dev] = out.get(dev, 0) + (math.prod(b - a for a, b in want) - local) * itemsize
    return out


def _rollout_layout(worker):
    """The engine's parameter shardings in the trainer's stacked tree layout (the per-layer split
    never cuts a shard: the layer axis is not sharded, so the bytes to move are the same)."""
    from flax import nnx

    import sharding
    from jaxrl_llm import models

    abstract = nnx.state(models.abstract_model(worker.actor.model().config), nnx.Param)
    return nnx.to_pure_dict(sharding.state_shardings(abstract, worker.rollout_mesh, sharding.ROLLOUT_RULES))


def _box(index, shape) -> list[tuple[int, int]]:
    return [(sl.start or 0, n if sl.stop is None else sl.stop) for sl, n in zip(index, shape)]


def _overlap(a, b) -> int:
    return math.prod(max(0, min(a1, b1) - max(a0, b0)) for (a0, a1), (b0, b1) in zip(a, b))


def main(argv=None) -> list[dict]:
    from jaxrl_llm.metrics import JsonReport

    args = parse_args(argv)
    if args.add_mfu:
        return add_mfu(args.add_mfu, args.peak_tflops)
    report = JsonReport(args.out)
    for name in args.models:
        by_mode = {}
        for mode in args.modes:
            try:
                r = run_model(name, args, mode)
            except Exception as e:  # noqa: BLE001 - report and go on to the next model
                if args.tiny:
                    raise
                import traceback
                r = {"bench": "e2e", "model": f"qwen2.5-{name}", "mode": mode,
                     "error": traceback.format_exc()[-3000:]}
                del e
            report.add(r)
            by_mode[mode] = r
        if len(by_mode) == 2 and not any("error" in r for r in by_mode.values()) and not args.sync_only:
            report.add(packing_summary(by_mode["padded"], by_mode["packed"]))
    return report.records


if __name__ == "__main__":
    main()
