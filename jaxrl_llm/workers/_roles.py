"""The model roles: actor (policy + optimizer), reference (frozen), critic (value model), and
the SFT trainer used for warm starts. Each owns its state and a few compiled steps; the math
comes from `jaxrl_llm.algos`.

Batches arrive as `data.Batch`es (or dicts) with verl's field names; sequences are `input_ids [b, p + t]`
(left-padded prompt, right-padded response), `responses [b, t]`, `response_mask [b, t]`.
Two switches, apart or together, change how a pass forms micro-batches (`_packing`):
`model.use_remove_padding` packs rows (the model sees `[dp * P, C]` packs with segment ids, the
losses the same `[rows, t]` fields), a token budget (`actor.use_dynamic_bsz`, `critic.use_dynamic_bsz`,
`reward.model.use_dynamic_bsz`) sizes micro-batches by tokens instead of rows (`_micro_batches`).
"""
from __future__ import annotations

import numpy as np
import jax
import jax.numpy as jnp
from flax import nnx

from jaxrl_llm import algos, models
from jaxrl_llm.config import ActorConfig, ConfigError, CriticConfig, MoeConfig, OptimConfig

from sharding import to_host

from ._common import build_optimizer, data_parallel_size, init_train_state
from ._packing import pack_batch, slot_batch, unpack_rows
from ._step import (check_contiguous_mask, is_packed, make_forward, make_update_step, micro_batches,
                    micro_size_for, packed_micro_batches)

_SEQ_KEYS = ("input_ids", "attention_mask", "position_ids")
_TOKEN_KEYS = ("routed_experts",)  # per-token fields beside the sequence (packed like input_ids)


def _model_kwargs(m, router_logits: bool, replay: bool) -> dict:
    """`hidden_states` keywords: the router logits (MoE), router replay of `m["routed_experts"]`."""
    kw = {"router_logits": True} if router_logits else {}
    if replay:
        kw["routed_experts"] = m["routed_experts"]
    return kw


def rows_from_packs(x, m):
    """[dp * P, C] per pack position -> [dp * P * R, t] per row slot and response token, through
    `token_index` (the position in its pack that predicts each token); 0 past a row's response."""
    idx = m["token_index"]
    rows = jnp.take_along_axis(x, idx.reshape(x.shape[0], -1), axis=1).reshape(idx.shape)
    return jnp.where(m["token_valid"] > 0, rows, jnp.zeros((), x.dtype))


def rows_per_pack(m) -> int:
    """R, the row slots of every pack in a packed micro-batch (static, from the shapes): the bound
    on sequences per pack that the model's packed attention is given (cuDNN's packed layout keeps
    softmax statistics per sequence slot, so an unbounded `packed=True` costs pack-length times
    the memory)."""
    return m["token_index"].shape[0] // m["input_ids"].shape[0]


def _packed_log_probs(model, m, temperature, return_entropy, router_logits=False, replay=False):
    """Log-probs (and entropy) at every pack position of the pack's next token, gathered to rows."""
    ids = m["input_ids"]
    # the cudnn / rolled paths take each pack's rows as separate sequences, at most R per pack
    h = model.hidden_states(ids, attention_mask=m["attention_mask"], positions=m["position_ids"],
                            packed=rows_per_pack(m), **_model_kwargs(m, router_logits, replay))
    if router_logits:
        h, logits = h
    following = jnp.concatenate([ids[:, 1:], jnp.zeros_like(ids[:, :1])], axis=1)
    unembed, layout = model.unembed()
    out = algos.token_log_probs_from_hidden(h, unembed.astype(h.dtype), following,
                                            temperature=temperature, return_entropy=return_entropy,
                                            unembed_layout=layout)
    out = jax.tree.map(lambda x: rows_from_packs(x, m), out)
    return (out, logits) if router_logits else out


def response_hidden(model, m, router_logits=False, replay=False):
    """Final hidden states at the positions that predict each response token. [b, t, e]
    (and, with `router_logits`, a MoE model's router logits [L, b, p + t, E]). `replay`: router
    replay of `m["routed_experts"]`."""
    h = model.hidden_states(m["input_ids"], attention_mask=m["attention_mask"], positions=m["position_ids"],
                            **_model_kwargs(m, router_logits, replay))
    t = m["responses"].shape[-1]
    if router_logits:
        return h[0][:, -t - 1:-1], h[1]
    return h[:, -t - 1:-1]


def response_log_probs(model, m, temperature, return_entropy=False, router_logits=False, replay=False):
    """Log-probs [b, t] of the response tokens (and entropies); packed micro-batches: [dp * P * R, t].
    `router_logits` (MoE): returns (that, router logits [L, *m["attention_mask"].shape, E]), the
    logits of the model's input rows (packs when packed), masked by `m["attention_mask"] != 0`.
    `replay` (MoE, router replay): every layer routes each token to `m["routed_experts"]`
    ([*m["attention_mask"].shape, L, k], the engine's; -1: its own top-k)."""
    if is_packed(m):
        return _packed_log_probs(model, m, temperature, return_entropy, router_logits, replay)
    h = response_hidden(model, m, router_logits, replay)
    if router_logits:
        h, logits = h
    unembed, layout = model.unembed()
    out = algos.token_log_probs_from_hidden(h, unembed.astype(h.dtype), m["responses"],
                                            temperature=temperature, return_entropy=return_entropy,
                                            unembed_layout=layout)
    return (out, logits) if router_logits else out


def router_mismatch_rows(logits, m, top_k: int):
    """Router replay's mismatch per row: (layers x tokens whose own top-k set differs from
    `m["routed_experts"]`, those compared), int32 [rows] each (`models.routing_mismatch` over the
    model's input rows; packed micro-batches: summed into their [dp * R] row slots by segment id)."""
    mask = m["attention_mask"]
    mis, cnt = models.routing_mismatch(logits, m["routed_experts"], top_k, mask)  # [b or dp, s or L]
    if not is_packed(m):
        valid = m["row_valid"] if "row_valid" in m else 1  # token-budget slots: empty ones hold dummies
        return mis.sum(-1) * valid, cnt.sum(-1) * valid
    R = rows_per_pack(m)
    slot = jnp.arange(mask.shape[0], dtype=jnp.int32)[:, None] * R + mask.astype(jnp.int32) - 1
    slot = jnp.where(mask != 0, slot, mask.shape[0] * R)  # padding: out of range, dropped
    n = mask.shape[0] * R
    return (jax.ops.segment_sum(mis.reshape(-1), slot.reshape(-1), num_segments=n),
            jax.ops.segment_sum(cnt.reshape(-1), slot.reshape(-1), num_segments=n))


def moe_router_terms(logits, attention_mask, top_k: int, layers=None) -> dict[str, jax.Array]:
    """The router terms of one micro-batch from its router logits [S, b, t, E] of the sparse
    layers `layers` (their indices in the model, default 0 .. S - 1; real tokens:
    attention_mask != 0): `moe_aux_loss` (`models.load_balancing_loss`), `moe_z_loss`
    (`models.router_z_loss`) and the expert load relative to uniform (E x each expert's share
    of a layer's top-k choices; 1 = balanced), per layer `moe/expert_load/layer_{i}/{min,max,cv}`
    (cv: std / mean over experts; i the layer's index in the model) and over layers
    `moe/expert_load/{min,max}` (the extremes) and `moe/expert_load/cv` (the layers' mean)."""
    aux = models.load_balancing_loss(logits, top_k, attention_mask)
    z = models.router_z_loss(logits, attention_mask)
    load = models.expert_load(logits, top_k, attention_mask) * logits.shape[-1]  # [L, E], mean 1
    lo, hi = load.min(-1), load.max(-1)
    cv = load.std(-1) / jnp.maximum(load.mean(-1), 1e-9)
    out = {"moe_aux_loss": aux, "moe_z_loss": z, "moe/expert_load/min": lo.min(),
           "moe/expert_load/max": hi.max(), "moe/expert_load/cv": cv.mean()}
    for s, i in enumerate(range(load.shape[0]) if layers is None else layers):
        out.update({f"moe/expert_load/layer_{i}/min": lo[s], f"moe/expert_load/layer_{i}/max": hi[s],
                    f"moe/expert_load/layer_{i}/cv": cv[s]})
    return out


def _iter_minibatches(batch: dict[str, np.ndarray], mini_rows: int, epochs: int, shuffle: bool, seed: int):
    b = next(iter(batch.values())).shape[0]
    rng = np.random.default_rng(seed)
    for _ in range(epochs):
        order = rng.permutation(b) if shuffle else np.arange(b)
        for start in range(0, b, mini_rows):
            idx = order[start:start + mini_rows]
            yield {k: v[idx] for k, v in batch.items()}


def token_budget(enabled: bool, tokens: int, field: str, fallback: int = 0,
                 fallback_field: str = "") -> tuple[int, str]:
    """(tokens per device per micro-batch, its config field) of a pass; (0, "") = padded rows.
    `tokens` 0 takes `fallback` (verl's interpolated defaults)."""
    if not enabled:
        return 0, ""
    return (tokens, field) if tokens else (fallback, fallback_field)


# `model.use_remove_padding` packs a pass's rows only when under this share of the padded
# tokens are real. Packed micro-batches cost more per token than padded ones (cuDNN's packed
# layout; measured on one H200, 1.5B, rows of 512 + 1,024 tokens with no padding: the packed
# passes took 1.16x (log-probs) and 1.26x (update) the padded time), so a batch with little
# padding is faster padded; at 44 % real tokens packing made the same passes 3.1-3.6x faster
# (docs/benchmarks.md, "Packing on a long-tailed workload").
PACK_BELOW_REAL_FRACTION = 0.8


def real_fraction(attention_mask) -> float:
    """The share of a padded batch's tokens that are real (attention mask != 0)."""
    mask = np.asarray(attention_mask)
    return float((mask != 0).sum()) / max(mask.size, 1)


def _micro_batches(mesh, arrays, *, rows: int, micro_per_device: int, budget: tuple[int, str],
                   remove_padding: bool):
    """Global micro-batches of `arrays` (padded rows, `rows` of them) -> (plan or None, arrays).

    budget (`token_budget`) > 0: by tokens (`use_dynamic_bsz`), else `micro_per_device` rows per
    device; remove_padding: rows packed with segment ids (`use_remove_padding`), else padded. The
    plan maps outputs back to rows (`unpack_rows`); None: plain `[n_micro, micro]` rows."""
    dp, t = data_parallel_size(mesh), arrays["responses"].shape[-1]
    if remove_padding and real_fraction(arrays["attention_mask"]) >= PACK_BELOW_REAL_FRACTION:
        remove_padding = False  # little padding to remove: the padded layout is faster here
    if not budget[0] and not remove_padding:
        return None, micro_batches(mesh, arrays, micro_size_for(rows, micro_per_device, dp))
    check_contiguous_mask(arrays["attention_mask"])
    row_keys = [k for k in arrays if k not in _SEQ_KEYS + _TOKEN_KEYS + ("responses",)]
    token_keys = [k for k in _TOKEN_KEYS if k in arrays]
    if budget[0] and remove_padding:
        plan, out = pack_batch(arrays, t, budget[0], dp, field=budget[1], row_keys=row_keys,
                               token_keys=token_keys)
    elif budget[0]:
        plan, out = slot_batch(arrays, t, budget[0], dp, field=budget[1])
    else:  # rows per device, in packs of at most the padded micro-batch's tokens per device
        per = micro_size_for(rows, micro_per_device, dp) // dp
        plan, out = pack_batch(arrays, t, per * arrays["input_ids"].shape[1], dp, field="",
                               row_keys=row_keys, rows_per_device=per, token_keys=token_keys)
    return plan, packed_micro_batches(mesh, out)


def _forward_rows(worker, fn, batch, keys, params=None, budget=(0, "")):
    """fn over the batch in micro-batches -> [b, ...] host outputs. budget: `token_budget`;
    `worker.remove_padding`: packed rows."""
    params = worker.params if params is None else params
    arrays = {k: batch[k] for k in keys}
    b = arrays[keys[0]].shape[0]
    plan, mb = _micro_batches(worker.mesh, arrays, rows=b, micro_per_device=worker.micro_per_device,
                              budget=budget, remove_padding=worker.remove_padding)
    if plan is not None:
        return jax.tree.map(lambda x: unpack_rows(plan, to_host(x)), fn(params, mb))
    out = fn(params, mb)
    return jax.tree.map(lambda x: to_host(x).reshape(b, *x.shape[2:]), out)


class _Trained:
    """Shared plumbing of a role with params + optimizer state.

    A model with LoRA adapters (`models.add_lora`) trains only them: `state` holds the adapters
    and their optimizer state, `frozen` the base weights (merged in, never updated or donated)."""

    update_budget = (0, "")  # `token_budget` of the update: token-budget micro-batches when > 0
    remove_padding = False  # model.use_remove_padding: every pass of the role on packed rows

    def __init__(self, model, optim: OptimConfig, mesh, total_steps: int, loss_fn, mask_key: str):
        self.mesh = mesh
        self.lora_spec = model.lora_spec
        if self.lora_spec is not None:
            self.graphdef, params, base = models.split_lora(model)
            self.frozen = (base,)
        else:
            self.graphdef, params = nnx.split(model)
            self.frozen = ()
        self.tx, self.schedule = build_optimizer(optim, total_steps)
        self.state = init_train_state(params, self.tx, mesh)
        self._update = make_update_step(self.graphdef, self.tx, self.schedule, loss_fn, mesh,
                                        mask_key, self.state)

    @property
    def params(self):
        """What a forward needs: the trained state, or (adapters, base) under LoRA."""
        return (self.state.params, *self.frozen) if self.frozen else self.state.params

    def model(self):
        return nnx.merge(self.graphdef, self.state.params, *self.frozen)

    def set_base(self, base) -> None:
        """LoRA: replace the frozen base weights (a Param state of the same tree and shardings)."""
        if not self.frozen:
            raise RuntimeError("set_base: this role trains all its weights (no LoRA base)")
        if jax.tree.structure(base) != jax.tree.structure(self.frozen[0]):
            raise ValueError("set_base: the new base's parameter tree differs from the model's")
        self.frozen = (base,)

    def _run_updates(self, batch, mini_rows, epochs, shuffle, seed, keys, first_flag=None):
        """first_flag: a key that marks the rows of the first mini-batch (1) and all later ones (0)."""
        metrics = []
        for i, mb in enumerate(_iter_minibatches({k: batch[k] for k in keys}, mini_rows, epochs,
                                                 shuffle, seed)):
            if first_flag is not None:
                mb[first_flag] = np.full(len(mb[keys[0]]), 1 if i == 0 else 0, np.int32)
            if "responses" in mb:  # the RL roles; SFT rows are whole sequences, always padded
                _, micro_mb = _micro_batches(self.mesh, mb, rows=mini_rows,
                                             micro_per_device=self.micro_per_device,
                                             budget=self.update_budget, remove_padding=self.remove_padding)
            else:
                micro = micro_size_for(mini_rows, self.micro_per_device, data_parallel_size(self.mesh))
                micro_mb = micro_batches(self.mesh, mb, micro)
            self.state, m = self._update(self.state, micro_mb, self.frozen)
            metrics.append(m)
        stacked = jax.device_get(metrics)  # the one host sync of the update
        # skipped (non-finite) optimizer steps add up; everything else is a mean over them
        return {k: float((np.sum if k == "nonfinite_updates" else np.mean)([m[k] for m in stacked]))
                for k in stacked[0]}


class ActorWorker(_Trained):
    """The policy: log-probs of responses and the PPO-family update."""

    def __init__(self, model, cfg: ActorConfig, *, mesh, total_steps: int, temperature: float,
                 log_prob_max_tokens: int = 0, ref_log_prob_max_tokens: int = 0,
                 remove_padding: bool = False, moe: MoeConfig | None = None):
        """log_prob_max_tokens / ref_log_prob_max_tokens: the token budgets of the old- and
        reference-log-prob passes under `cfg.use_dynamic_bsz` (`rollout.` and
        `ref.log_prob_max_token_len_per_device`); 0 = `cfg.ppo_max_token_len_per_device`.
        remove_padding: `model.use_remove_padding` (packed rows on every pass).
        moe: `model.moe` (router losses; None = both coefficients 0). A MoE model's update also
        logs the router terms and expert load (`moe_router_terms`) whatever the coefficients.
        `cfg.router_replay` record/replay (MoE models): the batches carry `routed_experts`; the
        old-log-prob pass and the update log the routing mismatch, and replay routes by them."""
        self.cfg, self.temperature, self.remove_padding = cfg, temperature, remove_padding
        self.moe = moe if moe is not None else MoeConfig(aux_loss_coef=0.0, z_loss_coef=0.0)
        self._router = model.config.is_moe  # the update reads the router logits (metrics, losses)
        if self._router:
            c = model.config
            models.warn_if_experts_expanded(c.num_experts, c.hidden_size, c.moe_intermediate_size,
                                            c.num_experts_per_tok)
        rr = cfg.router_replay
        if rr.record and not self._router:
            raise ConfigError(f"actor.router_replay.mode={rr.mode!r} needs a mixture-of-experts model; model_type "
                              f"{model.config.model_type!r} has no router: set actor.router_replay.mode='disabled'")
        self._record, self._replay = rr.record, rr.replay
        if not self._router:
            for name in ("aux_loss_coef", "z_loss_coef"):
                if getattr(self.moe, name):
                    raise ValueError(f"model.moe.{name}={getattr(self.moe, name)} needs a mixture-of-experts "
                                     f"model; model_type {model.config.model_type!r} has no router: set it to 0")
        self.micro_per_device = cfg.ppo_micro_batch_size_per_device
        own = (cfg.ppo_max_token_len_per_device, "actor.ppo_max_token_len_per_device")
        self.update_budget = token_budget(cfg.use_dynamic_bsz, *own)
        self.log_prob_budget = token_budget(cfg.use_dynamic_bsz, log_prob_max_tokens,
                                            "rollout.log_prob_max_token_len_per_device", *own)
        self.ref_log_prob_budget = token_budget(cfg.use_dynamic_bsz, ref_log_prob_max_tokens,
                                                "ref.log_prob_max_token_len_per_device", *own)
        super().__init__(model, cfg.optim, mesh, total_steps, self._loss, "response_mask")
        self._log_prob = make_forward(self.graphdef, self._log_prob_fn, mesh)
        if self.lora_spec is not None:  # the reference policy is the base: adapters switched off
            self._adapters_off = jax.tree.map(jnp.zeros_like, self.state.params)
            self._ref_log_prob = make_forward(
                self.graphdef, lambda mdl, m: response_log_probs(mdl, m, temperature), mesh)
            base_shardings = jax.tree.map(lambda x: x.sharding, nnx.to_pure_dict(self.frozen[0]))
            scale = self.lora_spec.scale
            self._merge = jax.jit(lambda b, a, dtype: models.merge_lora(b, a, scale, dtype),
                                  static_argnums=(2,), out_shardings=base_shardings)

    def _log_prob_fn(self, model, m):
        """The old-log-prob pass on one micro-batch: (log-probs, entropies) [rows, t]; with router
        replay recording also the per-row routing mismatch (`router_mismatch_rows`) and, when
        replaying, the log-probs of the same weights without replay (its own top-k: the
        `rollout/router_replay/logprob_abs_diff_without_replay/*` metrics)."""
        if not self._record:
            return response_log_probs(model, m, self.temperature, True)
        (lp, ent), logits = response_log_probs(model, m, self.temperature, True, router_logits=True,
                                               replay=self._replay)
        out = (lp, ent, *router_mismatch_rows(logits, m, model.config.num_experts_per_tok))
        if self._replay:
            out += (response_log_probs(model, m, self.temperature),)
        return out

    def _loss(self, model, m, denoms):
        c = self.cfg
        mask = m["response_mask"]
        glob = dict(global_token_count=denoms["tokens"], global_batch_size=denoms["seqs"])
        if self._router:
            (log_prob, entropy), router_logits = response_log_probs(
                model, m, self.temperature, return_entropy=True, router_logits=True, replay=self._replay)
        else:
            log_prob, entropy = response_log_probs(model, m, self.temperature, return_entropy=True)
        old_log_prob = m["old_log_probs"]
        if "first_minibatch" in m:
            # On-policy data, first mini-batch: the params are those that computed old_log_probs,
            # so old == current exactly; but a bf16 forward compiled with its backward rounds
            # differently from the standalone forward (|dlog p| up to ~0.3), which would show as
            # ppo_kl != 0 and clipped tokens. As verl's actor does for a one-mini-batch update
            # (its `on_policy` case), take the old log-probs from this very forward: the ratio is
            # exactly 1, the gradient unchanged.
            old_log_prob = jnp.where(m["first_minibatch"][:, None] > 0,
                                     jax.lax.stop_gradient(log_prob), old_log_prob)
        pg_loss, pg_metrics = algos.get_policy_loss(c.policy_loss)(
            old_log_prob, log_prob, m["advantages"], mask, c.loss_agg_mode,
            clip_ratio=c.clip_ratio, clip_ratio_low=c.clip_ratio_low,
            clip_ratio_high=c.clip_ratio_high, clip_ratio_c=c.clip_ratio_c,
            rollout_is_weights=m.get("rollout_is_weights"),
            global_row_count=denoms["rows"], **glob)  # rows: geo_mean averages over every row
        entropy_loss = algos.agg_loss(entropy, mask, c.loss_agg_mode, **glob)
        loss = pg_loss - c.entropy_coeff * entropy_loss
        metrics = {"pg_loss": pg_loss, "entropy": entropy_loss, **pg_metrics}
        if c.use_kl_loss:
            kld = algos.kl_penalty(log_prob, m["ref_log_prob"], c.kl_loss_type)
            kl_loss = algos.agg_loss(kld, mask, c.loss_agg_mode, **glob)
            loss = loss + c.kl_loss_coef * kl_loss
            metrics.update(kl_loss=kl_loss, kl_coef=jnp.asarray(c.kl_loss_coef))
        if self._router:
            # Per micro-batch (its real prompt + response tokens, packs included), weighted by the
            # micro-batch's share of the mini-batch's response tokens: the update's gradient sums
            # micro-batches, so the optimizer sees coef x the token-weighted mean of the micro-batch
            # losses. The logged values are plain per-micro-batch values, averaged like the other
            # metrics.
            terms = moe_router_terms(router_logits, m["attention_mask"], model.config.num_experts_per_tok,
                                     model.config.sparse_layers)
            share = mask.astype(jnp.float32).sum() / jnp.maximum(denoms["tokens"], 1.0)
            if self.moe.aux_loss_coef:
                loss = loss + self.moe.aux_loss_coef * share * terms["moe_aux_loss"]
            if self.moe.z_loss_coef:
                loss = loss + self.moe.z_loss_coef * share * terms["moe_z_loss"]
            metrics.update(jax.tree.map(jax.lax.stop_gradient, terms))
        if self._record:  # this micro-batch's share of (token, layer) routings unlike the engine's
            mis, cnt = router_mismatch_rows(router_logits, m, model.config.num_experts_per_tok)
            metrics["router_replay/mismatch_frac"] = mis.sum() / jnp.maximum(cnt.sum(), 1).astype(jnp.float32)
        return loss, metrics

    def compute_log_prob(self, batch) -> dict[str, np.ndarray]:
        """old_log_probs and entropys [b, t]; with router replay recording also router_mismatched /
        router_compared int [b] (`router_mismatch_rows`) and, when replaying,
        log_probs_without_replay [b, t]."""
        keys = _SEQ_KEYS + ("responses",) + (("routed_experts",) if self._record else ())
        out = _forward_rows(self, self._log_prob, batch, keys, budget=self.log_prob_budget)
        result = {"old_log_probs": out[0].astype(np.float32), "entropys": out[1].astype(np.float32)}
        if self._record:
            result.update(router_mismatched=out[2].astype(np.int64), router_compared=out[3].astype(np.int64))
        if self._replay:
            result["log_probs_without_replay"] = out[4].astype(np.float32)
        return result

    def compute_ref_log_prob(self, batch) -> dict[str, np.ndarray]:
        """LoRA only: log-probs of the base weights with the adapters zeroed (the initial policy;
        exactly the base model's, since a zero B adds 0) — no second copy of the model."""
        if self.lora_spec is None:
            raise RuntimeError("ActorWorker.compute_ref_log_prob needs LoRA adapters (actor.lora); "
                               "a full fine-tuning run has a ReferenceWorker")
        params = (self._adapters_off, *self.frozen)
        lp = _forward_rows(self, self._ref_log_prob, batch, _SEQ_KEYS + ("responses",), params=params,
                           budget=self.ref_log_prob_budget)
        return {"ref_log_prob": lp.astype(np.float32)}

    def rollout_params(self, dtype=None):
        """The weights the rollout engine serves: the trained params themselves, or under LoRA the
        merged W + (α/r)·A·B of the current adapters (one jitted program on device, cast to
        `dtype` fused; the result has the base model's tree and shardings)."""
        if self.lora_spec is None:
            return self.state.params
        base = nnx.to_pure_dict(self.frozen[0])
        adapters = nnx.to_pure_dict(self.state.params)
        return self._merge(base, adapters, None if dtype is None else jnp.dtype(dtype))

    def update(self, batch, *, mini_rows: int, seed: int, on_policy: bool = False) -> dict[str, float]:
        """on_policy: `old_log_probs` were computed by `compute_log_prob` with the current params
        (not the rollout's), so the first mini-batch takes them from its own forward (exact ratio 1)."""
        keys = _SEQ_KEYS + ("responses", "response_mask", "old_log_probs", "advantages")
        if self.cfg.use_kl_loss:
            keys += ("ref_log_prob",)
        if "rollout_is_weights" in batch:  # algorithm.rollout_correction.rollout_is
            keys += ("rollout_is_weights",)
        if self._record:  # actor.router_replay
            keys += ("routed_experts",)
        m = self._run_updates(batch, mini_rows, self.cfg.ppo_epochs, self.cfg.shuffle, seed, keys,
                              first_flag="first_minibatch" if on_policy else None)
        # the expert-load metrics keep their own `moe/` prefix; everything else is the actor's
        return {(k if k.startswith("moe/") else f"actor/{k}"): v for k, v in m.items() if k != "loss"}


class ReferenceWorker:
    """Frozen copy of the initial policy: log-probs for the KL terms."""

    def __init__(self, graphdef, params, *, mesh, temperature: float, micro_per_device: int,
                 budget: tuple[int, str] = (0, ""), remove_padding: bool = False):
        """budget: `token_budget` of the pass (token-budget micro-batches), (0, "") = rows;
        remove_padding: packed rows (`model.use_remove_padding`)."""
        self.graphdef, self.mesh, self.micro_per_device = graphdef, mesh, micro_per_device
        self.budget, self.remove_padding = budget, remove_padding
        self.params = jax.tree.map(jnp.copy, params)
        self._log_prob = make_forward(graphdef, lambda mdl, m: response_log_probs(mdl, m, temperature), mesh)

    def compute_ref_log_prob(self, batch) -> dict[str, np.ndarray]:
        lp = _forward_rows(self, self._log_prob, batch, _SEQ_KEYS + ("responses",), budget=self.budget)
        return {"ref_log_prob": lp.astype(np.float32)}


def response_values(model, m):
    """Values [b, t] at the positions that predict each response token; packed: [dp * P * R, t]."""
    packed = is_packed(m)  # static: whether the micro-batch carries the pack layout
    v = model(m["input_ids"], attention_mask=m["attention_mask"], positions=m["position_ids"],
              packed=rows_per_pack(m) if packed else False)
    if packed:
        return rows_from_packs(v, m)
    t = m["responses"].shape[-1]
    return v[:, -t - 1:-1]


class CriticWorker(_Trained):
    """The value model: values of response tokens and the clipped value-loss update."""

    def __init__(self, model, cfg: CriticConfig, *, mesh, total_steps: int, remove_padding: bool = False):
        """remove_padding: `model.use_remove_padding` (the values pass and the update packed)."""
        self.cfg, self.remove_padding = cfg, remove_padding
        self.micro_per_device = cfg.ppo_micro_batch_size_per_device
        self.update_budget = token_budget(cfg.use_dynamic_bsz, cfg.ppo_max_token_len_per_device,
                                          "critic.ppo_max_token_len_per_device")
        super().__init__(model, cfg.optim, mesh, total_steps, self._loss, "response_mask")
        self._values = make_forward(self.graphdef, response_values, mesh)

    def _loss(self, model, m, denoms):
        vpreds = response_values(model, m)
        vf_loss, clipfrac = algos.value_loss(
            vpreds, m["returns"], m["values"], m["response_mask"], self.cfg.cliprange_value,
            self.cfg.loss_agg_mode, global_token_count=denoms["tokens"], global_batch_size=denoms["seqs"])
        mask = m["response_mask"].astype(jnp.float32)
        vpred_mean = (vpreds * mask).sum() / jnp.maximum(mask.sum(), 1.0)
        return vf_loss, {"vf_loss": vf_loss, "vf_clipfrac": clipfrac, "vpred_mean": vpred_mean}

    def compute_values(self, batch) -> dict[str, np.ndarray]:
        v = _forward_rows(self, self._values, batch, _SEQ_KEYS + ("responses",), budget=self.update_budget)
        return {"values": v.astype(np.float32)}

    def update(self, batch, *, mini_rows: int, seed: int) -> dict[str, float]:
        keys = _SEQ_KEYS + ("responses", "response_mask", "values", "returns")
        m = self._run_updates(batch, mini_rows, self.cfg.ppo_epochs, False, seed, keys)
        return {f"critic/{k}": v for k, v in m.items() if k != "loss"}


def last_token_values(model, m):
    """Values at the response tokens themselves (the state after reading each token). [b, t];
    packed: [dp * P * R, t] (one position past the one that predicts each token)."""
    packed = is_packed(m)
    v = model(m["input_ids"], attention_mask=m["attention_mask"], positions=m["position_ids"],
              packed=rows_per_pack(m) if packed else False)
    if packed:
        return rows_from_packs(v, {**m, "token_index": m["token_index"] + 1})
    return v[:, -m["responses"].shape[-1]:]


class RewardModelWorker:
    """A frozen value-head model scoring whole responses: its value at each response's last
    valid token is the sequence reward (verl's `rm_scores`, placed on that token)."""

    def __init__(self, model, *, mesh, micro_per_device: int, budget: tuple[int, str] = (0, ""),
                 remove_padding: bool = False):
        """budget: `token_budget` of the scoring pass (`reward.model.use_dynamic_bsz`,
        `reward.model.forward_max_token_len_per_device`); remove_padding: packed rows."""
        self.mesh, self.micro_per_device = mesh, micro_per_device
        self.budget, self.remove_padding = budget, remove_padding
        self.graphdef, self.params = nnx.split(model)
        self._values = make_forward(self.graphdef, last_token_values, mesh)

    def compute_rm_score(self, batch) -> dict[str, np.ndarray]:
        v = _forward_rows(self, self._values, batch, _SEQ_KEYS + ("responses",), budget=self.budget)
        # 1 on each row's last model token (the one placement of a sequence score, `algos`)
        on_last = np.asarray(algos.sequence_scores_to_token_level(
            np.ones(len(v), np.float32), np.asarray(batch["response_mask"])))
        return {"rm_scores": np.where(on_last > 0, v, 0.0).astype(np.float32)}


def sft_loss(model, m, denoms):
    """Next-token cross-entropy on `loss_mask` tokens (assistant turns), token-mean over the batch."""
    ids, mask = m["input_ids"], m["loss_mask"]
    h = model.hidden_states(ids, attention_mask=m["attention_mask"], positions=m["position_ids"])
    unembed, layout = model.unembed()
    lp = algos.token_log_probs_from_hidden(h[:, :-1], unembed.astype(h.dtype), ids[:, 1:],
                                           unembed_layout=layout)
    target_mask = mask[:, 1:].astype(jnp.float32)
    nll = -(lp * target_mask).sum() / jnp.maximum(denoms["tokens"], 1.0)
    correct = (lp > jnp.log(0.5)).astype(jnp.float32)
    return nll, {"nll": nll, "token_acc50": (correct * target_mask).sum() / jnp.maximum(target_mask.sum(), 1.0)}


class SFTWorker(_Trained):
    """Supervised fine-tuning on chat data (loss on assistant tokens only)."""

    def __init__(self, model, optim: OptimConfig, *, mesh, total_steps: int, micro_per_device: int):
        self.micro_per_device = micro_per_device
        super().__init__(model, optim, mesh, total_steps, sft_loss, "loss_mask_shifted")

    def step(self, batch: dict[str, np.ndarray]) -> dict[str, float]:
        batch = dict(batch)
        shifted = np.zeros_like(batch["loss_mask"])
        shifted[:, 1:] = batch["loss_mask"][:, 1:]
        batch["loss_mask_shifted"] = shifted
        keys = _SEQ_KEYS + ("loss_mask", "loss_mask_shifted")
        rows = batch["input_ids"].shape[0]
        m = self._run_updates(batch, rows, 1, False, 0, keys)
        return {f"sft/{k}": v for k, v in m.items()}
