"""Router replay in the full forward (`routed_experts`) on the tiny Qwen3-MoE fixture, fp32: the
replayed experts follow their tokens through the rotated (cudnn/rolled) path."""
import dataclasses
import os

import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrl_llm import models

FIXTURE = os.path.join(os.path.dirname(__file__), "..", "fixtures", "models", "qwen3_moe")


def test_replayed_experts_follow_their_tokens_on_the_rotated_path():
    model = models.from_pretrained(FIXTURE)
    rng = np.random.default_rng(0)
    ids = rng.integers(1, 96, (3, 10)).astype(np.int32)
    mask = np.zeros((3, 10), np.int32)
    mask[0, 2:9], mask[1, :], mask[2, 4:7] = 1, 1, 1  # left and right padding: rows rotate by 2, 0, 4
    given = rng.integers(0, 4, (3, 10, 2, 1)).astype(np.int8)
    given = np.concatenate([given, (given + 1) % 4], -1)  # two distinct experts per token and layer
    given[rng.random((3, 10)) < 0.3] = -1  # some tokens keep their own top-k
    _, state = nnx.split(model)
    out = {}
    for impl in ("xla", "rolled"):
        m = models.CausalLM(dataclasses.replace(model.config, train_attention=impl), rngs=nnx.Rngs(0))
        nnx.update(m, state)
        h = m.hidden_states(jnp.asarray(ids), attention_mask=jnp.asarray(mask), routed_experts=jnp.asarray(given))
        out[impl] = np.where(mask[..., None] > 0, np.asarray(h), 0.0)
    own = model.hidden_states(jnp.asarray(ids), attention_mask=jnp.asarray(mask))
    own = np.where(mask[..., None] > 0, np.asarray(own), 0.0)
    assert np.abs(out["xla"] - own).max() > 1e-2  # the replayed experts are not the model's own
    np.testing.assert_allclose(out["rolled"], out["xla"], atol=1e-5)
