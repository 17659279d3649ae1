"""Compiled steps shared by the trained roles: one optimizer step over a mini-batch with
gradient accumulation across micro-batches (a `lax.scan`), and batched forward passes.

A loss function here is `loss_fn(model, micro_batch, denominators) -> (loss, metrics)`; the
denominators are mini-batch totals (token count, non-empty row count) so that the micro-batch
losses add up to exactly the full mini-batch loss (`algos.agg_loss_terms`).
"""
from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import sharding

from ._common import TrainState, put_batch, shardings_of


# Losses that carry the mini-batch normaliser are each micro-batch's share: they add up.
SUMMED_METRICS = frozenset({"pg_loss", "entropy", "kl_loss", "vf_loss", "nll"})


def denominators(mask: jax.Array, row_valid: jax.Array | None = None) -> dict[str, jax.Array]:
    """Mini-batch normalisers from a [..., t] mask: tokens, non-empty rows and all rows.
    `row_valid` [...] (slotted micro-batches, `has_row_slots`): 1 on real rows, 0 on empty slots, which then do
    not count as rows (the others are zero-masked anyway)."""
    m = mask.astype(jnp.float32)
    rows = (jnp.float32(np.prod(m.shape[:-1])) if row_valid is None
            else row_valid.astype(jnp.float32).sum())
    return {"tokens": m.sum(), "seqs": (m.sum(-1) > 0).astype(jnp.float32).sum(), "rows": rows}


def is_packed(mb) -> bool:
    """Whether a micro-batch dict holds packed rows (`_packing.pack_batch`): the model sees
    `[dp * P, C]` packs and per-row fields map through `token_index`."""
    return "token_index" in mb


def has_row_slots(mb) -> bool:
    """Whether a micro-batch dict holds row slots that may be empty (`row_valid`): packed rows, or
    padded rows placed by a token budget (`_packing.slot_batch`)."""
    return "row_valid" in mb


def _nonempty(micro) -> jax.Array:
    """A slotted micro-batch with any real row (the trailing ones may be empty padding)."""
    return jnp.any(micro["row_valid"] > 0)


def make_update_step(graphdef, tx: optax.GradientTransformation, schedule, loss_fn: Callable,
                     mesh, mask_key: str, state: TrainState):
    """jit(state, micro_batches [n_micro, micro, ...], frozen=()) -> (state, metrics); state donated.
    `frozen`: a tuple of states merged with the trained params but not trained (the base weights
    under LoRA: `state.params` then holds only the adapters, and so does the optimizer state).

    A step whose loss, gradient norm or parameter update is not finite is skipped on device:
    the returned state equals the input and `metrics["nonfinite_updates"]` is 1 (else 0), so
    the caller counts skips from the metrics it fetches anyway (no extra host sync)."""

    def step(state: TrainState, mb: dict[str, jax.Array], frozen: tuple = ()):
        with sharding.use_rules(mesh, sharding.TRAIN_RULES):
            slotted = has_row_slots(mb)
            denoms = denominators(mb[mask_key], mb["row_valid"] if slotted else None)

            def grad_one(params, micro):
                def f(p):
                    return loss_fn(nnx.merge(graphdef, p, *frozen), micro, denoms)
                return jax.value_and_grad(f, has_aux=True)(params)

            def body(acc, micro):
                if slotted:  # empty padding micro-batches are skipped, not computed
                    nothing = lambda: jax.tree.map(jnp.zeros_like, jax.eval_shape(  # noqa: E731
                        grad_one, state.params, micro))
                    out = jax.lax.cond(_nonempty(micro), lambda: grad_one(state.params, micro), nothing)
                else:
                    out = grad_one(state.params, micro)
                (loss, metrics), grads = out
                return jax.tree.map(jnp.add, acc, grads), (loss, metrics)

            zeros = jax.tree.map(jnp.zeros_like, state.params)
            grads, (losses, metrics) = jax.lax.scan(body, zeros, mb)
            grad_norm = optax.global_norm(grads)
            updates, opt_state = tx.update(grads, state.opt_state, state.params)
            params = optax.apply_updates(state.params, updates)
            loss = losses.sum()
            finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm) & jnp.isfinite(optax.global_norm(updates))
            new_state = skip_unless(finite, TrainState(params, opt_state, state.step + 1), state)
            metrics = {k: v.sum() if k in SUMMED_METRICS else _mean(v, mb if slotted else None)
                       for k, v in metrics.items()}
            metrics.update(loss=loss, grad_norm=grad_norm, lr=schedule(state.step),
                           nonfinite_updates=1.0 - finite.astype(jnp.float32))
            return new_state, metrics

    return jax.jit(step, donate_argnums=(0,), out_shardings=(shardings_of(state), None))


def _mean(v: jax.Array, slotted_mb=None) -> jax.Array:
    """Mean of a per-micro-batch metric; slotted: over the micro-batches that ran (not the empty)."""
    if slotted_mb is None:
        return v.mean()
    ran = jax.vmap(_nonempty)(slotted_mb).astype(v.dtype)
    return (v * ran).sum() / jnp.maximum(ran.sum(), 1)


def skip_unless(ok: jax.Array, new, old):
    """`new` where the scalar `ok` holds, else `old`, leaf by leaf (a select on device: no host
    sync). A non-finite step leaves params, optimizer state and step count as they were."""
    return jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, old)


def micro_batches(mesh, arrays: dict[str, np.ndarray], micro_size: int) -> dict[str, jax.Array]:
    """[b, ...] host rows -> global [b // micro, micro, ...], rows of a micro-batch spread over devices."""
    b = next(iter(arrays.values())).shape[0]
    if b % micro_size:
        raise ValueError(f"mini-batch of {b} rows is not a multiple of the micro-batch size {micro_size}")
    if "attention_mask" in arrays:
        check_contiguous_mask(arrays["attention_mask"])
    n = b // micro_size
    shaped = {k: v.reshape(n, micro_size, *v.shape[1:]) for k, v in arrays.items()}
    return put_batch(mesh, shaped, batch_axis=1)


def packed_micro_batches(mesh, packed: dict[str, np.ndarray]) -> dict[str, jax.Array]:
    """`_packing.pack_batch` / `slot_batch` output [n_micro, dp x k, ...] -> global arrays: slots
    d * k ... d * k + k - 1 of every micro-batch (device d's packs, or their row slots) on
    data-parallel device d."""
    return put_batch(mesh, packed, batch_axis=1)


def check_contiguous_mask(mask: np.ndarray) -> None:
    """Every row's real tokens must be one run (left and/or right padding only): the models'
    flash-attention path rotates rows so that the run starts at 0."""
    m = np.asarray(mask) != 0
    t = m.shape[1]
    start = m.argmax(axis=1)
    idx = np.arange(t)[None, :]
    expected = (idx >= start[:, None]) & (idx < (start + m.sum(axis=1))[:, None])
    bad = np.nonzero((m != expected).any(axis=1))[0]
    if bad.size:
        raise ValueError(f"attention_mask row {int(bad[0])} has padding between real tokens "
                         f"({int(bad.size)} such rows); rows must be left-padded prompt + "
                         f"right-padded response, one contiguous run of real tokens")


def micro_size_for(rows: int, per_device: int, dp: int) -> int:
    """Largest micro-batch <= per_device * dp that divides `rows` and is a multiple of dp."""
    target = max(per_device, 1) * dp
    for m in range(min(target, rows), 0, -1):
        if rows % m == 0 and m % dp == 0:
            return m
    raise ValueError(
        f"cannot split {rows} rows into micro-batches spread over {dp} data-parallel devices; "
        f"make the mini-batch (ppo_mini_batch_size x rollout.n) a multiple of {dp}")


def make_forward(graphdef, fn: Callable, mesh, n_out: int = 1):
    """jit(params, micro_batches) -> fn outputs stacked per micro-batch (lax.map, low memory).
    `params`: one state, or a tuple of states merged together (adapters + frozen base).
    Slotted micro-batches (`_packing`): the empty trailing ones are skipped (zeros out)."""

    def run(params, mb):
        with sharding.use_rules(mesh, sharding.TRAIN_RULES):
            model = nnx.merge(graphdef, *(params if isinstance(params, tuple) else (params,)))
            if not has_row_slots(mb):
                return jax.lax.map(lambda m: fn(model, m), mb)

            def one(m):
                nothing = lambda: jax.tree.map(jnp.zeros_like, jax.eval_shape(lambda x: fn(model, x), m))  # noqa: E731
                return jax.lax.cond(_nonempty(m), lambda: fn(model, m), nothing)

            return jax.lax.map(one, mb)

    return jax.jit(run)
