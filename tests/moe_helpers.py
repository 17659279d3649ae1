"""Helpers shared by the router-replay tests of several folders (tests/ is on sys.path through
tests/conftest.py)."""
import jax.numpy as jnp
import numpy as np


def own_top_k(model, seq) -> np.ndarray:
    """[len(seq), L, k]: the experts the model picks on a full forward of seq (sorted ids)."""
    ids = jnp.asarray([seq], jnp.int32)
    out = model.prefill(ids, attention_mask=jnp.ones_like(ids), record_experts=True)
    return np.sort(np.moveaxis(np.asarray(out[2]), 0, 2)[0], -1)
