"""Chunked log-probs / entropy equal the naive full-softmax computation, values and gradients."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm import algos


def close(a, b, tol=1e-5):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=tol, atol=tol)


def naive(logits, tokens, temperature=1.0):
    logp = jax.nn.log_softmax(logits.astype(jnp.float32) / temperature, axis=-1)
    chosen = jnp.take_along_axis(logp, tokens[..., None], axis=-1)[..., 0]
    ent = -jnp.sum(jnp.exp(logp) * logp, axis=-1)
    return chosen, ent


B, S, E, V = 2, 13, 8, 37  # S not a multiple of the chunk size


@pytest.fixture(scope="module")
def data():
    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(0), 3)
    hidden = jax.random.normal(k1, (B, S, E))
    unembed = jax.random.normal(k2, (E, V)) * 0.5
    tokens = jax.random.randint(k3, (B, S), 0, V)
    return hidden, unembed, tokens


def test_entropy_from_logits_hand_values():
    logits = jnp.array([[0.0, 0.0, 0.0, 0.0], [100.0, 0.0, 0.0, 0.0]])
    close(algos.entropy_from_logits(logits), [np.log(4.0), 0.0])


def test_logits_version_matches_naive_with_temperature(data):
    hidden, unembed, tokens = data
    logits = hidden @ unembed
    lp, ent = algos.token_log_probs_from_logits(logits, tokens, 0.7, chunk_size=4,
                                                return_entropy=True)
    ref_lp, ref_ent = naive(logits, tokens, 0.7)
    close(lp, ref_lp)
    close(ent, ref_ent)
    close(algos.entropy_from_logits(logits / 0.7), ref_ent)


@pytest.mark.parametrize("chunk_size", [1, 5, 13, 64])
def test_hidden_version_matches_naive(data, chunk_size):
    hidden, unembed, tokens = data
    lp, ent = algos.token_log_probs_from_hidden(hidden, unembed, tokens, temperature=1.3,
                                                chunk_size=chunk_size, return_entropy=True)
    ref_lp, ref_ent = naive(hidden @ unembed, tokens, 1.3)
    assert lp.shape == (B, S) and lp.dtype == jnp.float32
    close(lp, ref_lp)
    close(ent, ref_ent)
    lp_only = algos.token_log_probs_from_hidden(hidden, unembed, tokens, chunk_size=chunk_size)
    close(lp_only, naive(hidden @ unembed, tokens)[0])


def test_hidden_version_gradients_match_naive(data):
    hidden, unembed, tokens = data
    w = jax.random.normal(jax.random.PRNGKey(1), (B, S))

    def chunked(h, u):
        lp, ent = algos.token_log_probs_from_hidden(h, u, tokens, chunk_size=4,
                                                    return_entropy=True)
        return jnp.sum(w * lp) + 0.1 * jnp.sum(ent)

    def reference(h, u):
        lp, ent = naive(h @ u, tokens)
        return jnp.sum(w * lp) + 0.1 * jnp.sum(ent)

    g = jax.jit(jax.grad(chunked, argnums=(0, 1)))(hidden, unembed)
    r = jax.jit(jax.grad(reference, argnums=(0, 1)))(hidden, unembed)
    close(g[0], r[0], 1e-4)
    close(g[1], r[1], 1e-4)


def test_transposed_unembed_layout_gives_the_same_values_and_gradients(data):
    hidden, unembed, tokens = data

    def loss(h, u, layout):
        lp, ent = algos.token_log_probs_from_hidden(h, u, tokens, chunk_size=4, return_entropy=True,
                                                    unembed_layout=layout)
        return jnp.sum(lp) + 0.1 * jnp.sum(ent)

    ev = jax.value_and_grad(loss, argnums=(0, 1))(hidden, unembed, "ev")
    ve = jax.value_and_grad(loss, argnums=(0, 1))(hidden, unembed.T, "ve")
    close(ev[0], ve[0])
    close(ev[1][0], ve[1][0])
    close(ev[1][1], ve[1][1].T)
    with pytest.raises(ValueError, match="unembed_layout"):
        algos.token_log_probs_from_hidden(hidden, unembed, tokens, unembed_layout="vv")


def test_bf16_backward_casts_the_logit_gradient_to_bf16():
    h = jax.random.normal(jax.random.PRNGKey(0), (2, 3, 8), jnp.bfloat16)
    w = jax.random.normal(jax.random.PRNGKey(1), (8, 16), jnp.bfloat16)
    g = jax.random.normal(jax.random.PRNGKey(2), (2, 3, 16), jnp.float32)
    _, vjp = jax.vjp(lambda a, b: algos.project_logits(a, b, "ev"), h, w)
    dh, dw = vjp(g)
    assert dh.dtype == jnp.bfloat16 and dw.dtype == jnp.bfloat16
    gb = g.astype(jnp.bfloat16).astype(jnp.float32)  # the rule: cast first, accumulate in fp32
    close(dh.astype(jnp.float32), jnp.einsum("bcv,ev->bce", gb, w.astype(jnp.float32)), 2e-2)
    close(dw.astype(jnp.float32), jnp.einsum("bce,bcv->ev", h.astype(jnp.float32), gb), 2e-2)
    # the backward's matmuls take bf16 operands (no fp32/TF32 products)
    hlo = jax.jit(lambda a, b, c: jax.vjp(lambda x, y: algos.project_logits(x, y, "ev"), a, b)[1](c)
                  ).lower(h, w, g).as_text()
    dots = [ln for ln in hlo.splitlines() if "dot_general" in ln]
    assert dots and all("tensor<2x3x16xf32>" not in ln.split("->")[0] for ln in dots), dots


def test_bf16_hidden_is_computed_in_fp32(data):
    hidden, unembed, tokens = data
    lp = algos.token_log_probs_from_hidden(hidden.astype(jnp.bfloat16),
                                           unembed.astype(jnp.bfloat16), tokens, chunk_size=4)
    ref = naive(hidden.astype(jnp.bfloat16).astype(jnp.float32)
                @ unembed.astype(jnp.bfloat16).astype(jnp.float32), tokens)[0]
    assert lp.dtype == jnp.float32
    close(lp, ref, 1e-4)


def test_chunked_backward_never_holds_full_fp32_logits():
    b, s, e, v = 2, 512, 32, 4096
    hidden, unembed = jnp.ones((b, s, e)), jnp.ones((e, v))
    tokens = jnp.zeros((b, s), jnp.int32)

    def loss(h, u):
        return algos.token_log_probs_from_hidden(h, u, tokens, chunk_size=64).sum()

    compiled = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(hidden, unembed).compile()
    stats = compiled.memory_analysis()
    if stats is None:
        pytest.skip("memory_analysis unavailable on this backend")
    full_logits_bytes = b * s * v * 4
    assert stats.temp_size_in_bytes < full_logits_bytes / 2
