"""Chosen-token log-probs and entropy from logits or from final hidden states.

Vocabularies are ~150k, so a full fp32 ``[b, s, v]`` softmax does not fit next to a model.
The chunked functions walk the sequence in chunks of ``chunk_size`` positions with
``lax.map``; each chunk computes its logits in fp32, reduces them to ``[b, chunk]`` and drops
them. The chunk body is wrapped in ``jax.checkpoint``, so the backward pass recomputes a
chunk's logits instead of storing them: peak memory is one ``[b, chunk, v]`` fp32 block.
All functions are differentiable (the actor loss backprops through them).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

DEFAULT_CHUNK_SIZE = 128


def _stats(logits, tokens, return_entropy):
    """fp32 logits [..., v], tokens [...] -> (log_prob [...], entropy [...] or None)."""
    lse = jax.nn.logsumexp(logits, axis=-1)
    chosen = jnp.take_along_axis(logits, tokens[..., None].astype(jnp.int32), axis=-1)[..., 0]
    if not return_entropy:
        return chosen - lse, None
    probs = jnp.exp(logits - lse[..., None])
    return chosen - lse, lse - jnp.sum(probs * logits, axis=-1)


@jax.jit
def entropy_from_logits(logits):
    """Categorical entropy per position, in fp32. logits [..., v] -> [...]."""
    logits = logits.astype(jnp.float32)
    lse = jax.nn.logsumexp(logits, axis=-1)
    return lse - jnp.sum(jax.nn.softmax(logits, axis=-1) * logits, axis=-1)


def _to_chunks(x, chunk):
    """[b, s, ...] -> [n, b, chunk, ...], zero-padding s up to n * chunk."""
    b, s = x.shape[:2]
    n = -(-s // chunk)
    x = jnp.pad(x, [(0, 0), (0, n * chunk - s)] + [(0, 0)] * (x.ndim - 2))
    return x.reshape(b, n, chunk, *x.shape[2:]).swapaxes(0, 1)


def _from_chunks(y, s):
    """[n, b, chunk] -> [b, s]."""
    n, b, chunk = y.shape
    return y.swapaxes(0, 1).reshape(b, n * chunk)[:, :s]


def _chunked(logits_fn, xs, tokens, chunk_size, return_entropy):
    """Maps ``logits_fn`` over sequence chunks of ``xs`` (pytree of [b, s, ...]) with remat."""
    s = tokens.shape[1]
    chunk = max(1, min(chunk_size, s))

    @jax.checkpoint
    def body(args):
        x, tok = args
        logp, ent = _stats(logits_fn(x), tok, return_entropy)
        return (logp, ent) if return_entropy else (logp,)

    chunks = jax.tree_util.tree_map(lambda a: _to_chunks(a, chunk), (xs, tokens))
    out = jax.lax.map(body, chunks)
    out = tuple(_from_chunks(o, s) for o in out)
    return out if return_entropy else out[0]


@functools.partial(jax.jit, static_argnames=("chunk_size", "return_entropy"))
def token_log_probs_from_logits(logits, tokens, temperature=1.0, *, chunk_size=DEFAULT_CHUNK_SIZE,
                                return_entropy=False):
    """log softmax(logits / temperature)[token], chunked over the sequence.

    logits [b, s, v] (any float dtype), tokens int[b, s] -> fp32 [b, s] (and entropy [b, s]
    of the tempered distribution when ``return_entropy``).
    """
    def logits_fn(x):
        return x.astype(jnp.float32) / temperature

    return _chunked(logits_fn, logits, tokens, chunk_size, return_entropy)


_PROJECT = {"ev": ("bce,ev->bcv", "bcv,ev->bce", "bce,bcv->ev"),
            "ve": ("bce,ve->bcv", "bcv,ve->bce", "bce,bcv->ve")}


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def project_logits(h, w, layout="ev"):
    """fp32 logits ``h @ w`` (``w`` is [e, v] for layout "ev", [v, e] for "ve": a tied embedding,
    used without a transposed copy). Products accumulate in fp32 from inputs of any dtype.

    The backward pass casts the fp32 logit gradient to the inputs' dtype before its two matmuls
    (the usual mixed-precision rule), so bf16 models get bf16 tensor-core gradients instead of
    fp32 (TF32) ones; with fp32 inputs it is the exact gradient.
    """
    return jnp.einsum(_PROJECT[layout][0], h, w, preferred_element_type=jnp.float32)


def _project_fwd(h, w, layout):
    return project_logits(h, w, layout), (h, w)


def _project_bwd(layout, res, g):
    h, w = res
    g = g.astype(jnp.promote_types(h.dtype, w.dtype))
    _, dh_eq, dw_eq = _PROJECT[layout]
    dh = jnp.einsum(dh_eq, g, w, preferred_element_type=jnp.float32).astype(h.dtype)
    dw = jnp.einsum(dw_eq, h, g, preferred_element_type=jnp.float32).astype(w.dtype)
    return dh, dw


project_logits.defvjp(_project_fwd, _project_bwd)


@functools.partial(jax.jit, static_argnames=("chunk_size", "return_entropy", "unembed_layout"))
def token_log_probs_from_hidden(hidden, unembed, tokens, *, temperature=1.0,
                                chunk_size=DEFAULT_CHUNK_SIZE, return_entropy=False,
                                unembed_layout="ev"):
    """Chosen-token log-probs from final hidden states, never holding all logits at once.

    hidden [b, s, e], unembed [e, v] (or [v, e] with ``unembed_layout="ve"``, e.g. a tied
    embedding), tokens int[b, s] -> fp32 log_probs [b, s] (and entropy [b, s] when
    ``return_entropy``). Logits are ``hidden @ unembed`` in fp32 (`project_logits`), divided
    by ``temperature``, one ``[b, chunk_size, v]`` block at a time; ``tokens[:, i]`` is the
    token whose probability position ``i`` predicts.
    """
    if unembed_layout not in _PROJECT:
        raise ValueError(f"unembed_layout must be 'ev' or 've', got {unembed_layout!r}")

    def logits_fn(h):
        return project_logits(h, unembed, unembed_layout) / temperature

    return _chunked(logits_fn, hidden, tokens, chunk_size, return_entropy)
