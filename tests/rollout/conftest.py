"""Shared tiny models and engines for the rollout tests (built once per session: compiles are the
slow part on CPU)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl_llm.models import ModelConfig, init_model

import rollout

TINY = ModelConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, model_type="qwen2",
                   attention_bias=True)


_PAD_TO = 64
_FORWARDS = {}


def hook_decode(monkeypatch, engine, hooks):
    """Runs hooks[i]() on the scheduler thread just before its i-th decode loop (from 1)."""
    real, calls = engine.decode_loop, [0]

    def decode_loop(*args):
        calls[0] += 1
        if calls[0] in hooks:
            hooks[calls[0]]()
        return real(*args)

    monkeypatch.setattr(engine, "decode_loop", decode_loop)


def full_logits(model, ids):
    """Logits f32[len(ids), vocab] of one full causal forward (right-padded to a fixed length so
    it compiles once per model; causal attention makes the padding irrelevant)."""
    if id(model) not in _FORWARDS:
        graphdef, state = nnx.split(model)
        _FORWARDS[id(model)] = (model, jax.jit(lambda st, x: nnx.merge(graphdef, st)(x)), state)
    _, fwd, state = _FORWARDS[id(model)]
    padded = np.zeros((1, _PAD_TO), np.int32)
    padded[0, :len(ids)] = ids
    return fwd(state, jnp.asarray(padded))[0, :len(ids)]


def greedy_reference(model, prompt, steps, stop_ids=()):
    """Argmax continuation by full forward passes (no KV cache)."""
    ids = list(prompt)
    out = []
    for _ in range(steps):
        tok = int(jnp.argmax(full_logits(model, ids)[-1]))
        out.append(tok)
        ids.append(tok)
        if tok in stop_ids:
            break
    return out


def trainer_log_probs(model, prompt, response, temperature):
    """The trainer's definition: log_softmax(logits / T) of the response tokens (full forward)."""
    logits = full_logits(model, list(prompt) + list(response))[len(prompt) - 1:-1]
    logits = logits / (temperature if temperature > 0 else 1.0)
    lp = jax.nn.log_softmax(logits, axis=-1)
    return np.asarray(jnp.take_along_axis(lp, jnp.asarray(response)[:, None], axis=-1)[:, 0])


@pytest.fixture(scope="session")
def tiny_model():
    return init_model(TINY, seed=3)


@pytest.fixture(scope="session")
def prompts():
    rng = np.random.default_rng(0)
    return [[int(t) for t in rng.integers(8, 96, size=int(s))] for s in (3, 7, 1, 12, 5, 9)]


@pytest.fixture(scope="session")
def stop_id(tiny_model, prompts):
    """A token that greedy decoding of prompt 0 emits mid-way, so some rows really stop early."""
    ref = greedy_reference(tiny_model, prompts[0], 8)
    return ref[3]


def _tiny_engine(model, stop_id, layer_layout):
    return rollout.Engine.from_model(model, max_concurrent_decodes=4, max_prefill_length=16,
                                     max_target_length=32, temperature=0.0,
                                     stop_token_ids=(stop_id,), pad_token_id=0,
                                     layer_layout=layer_layout)


@pytest.fixture(scope="session")
def tiny_engine(tiny_model, stop_id):
    """The per-layer layout (what `auto` picks whenever the sync copies): the fast decode path."""
    return _tiny_engine(tiny_model, stop_id, "per_layer")


@pytest.fixture(scope="session")
def tiny_stacked_engine(tiny_model, stop_id):
    """The stacked layout (what `auto` picks when it can share the model's buffers)."""
    engine = _tiny_engine(tiny_model, stop_id, "auto")
    assert engine.layer_layout == "stacked"
    return engine


@pytest.fixture(scope="session")
def tiny_driver(tiny_engine):
    return rollout.RolloutDriver(tiny_engine, steps_per_sync=4)


@pytest.fixture(scope="session")
def tiny_stacked_driver(tiny_stacked_engine):
    return rollout.RolloutDriver(tiny_stacked_engine, steps_per_sync=4)
