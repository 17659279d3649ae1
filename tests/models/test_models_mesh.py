"""Sharded loading: `from_pretrained(mesh=..., rules=...)` places every parameter as the sharding
rules say, and the forward gives the same logits on every mesh shape (8 fake CPU devices)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

import sharding
from jaxrl_llm import models

MESHES = [(1, 1, 1), (8, 1, 1), (1, 8, 1), (1, 2, 4), (2, 2, 2)]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A tiny qwen2 (biases) whose heads and kv_heads split over tensor=4, saved HF-style."""
    config = models.ModelConfig(vocab_size=96, hidden_size=32, intermediate_size=64,
                                num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4,
                                model_type="qwen2", attention_bias=True)
    base = models.abstract_model(config)
    graphdef, state = nnx.split(base)
    rng = np.random.default_rng(0)
    for _, var in nnx.to_flat_state(state):
        shape = var.get_value().shape
        var.set_value(jnp.asarray(rng.normal(0, 0.3, shape), jnp.float32))
    path = tmp_path_factory.mktemp("mesh") / "tiny_tp4"
    models.save_pretrained(nnx.merge(graphdef, state), path)
    return path


def run(model, mesh, rules, ids):
    graphdef, state = nnx.split(model)
    with sharding.use_rules(mesh, rules):
        fn = jax.jit(lambda s, i: nnx.merge(graphdef, s)(i))
        x = jax.device_put(ids, NamedSharding(mesh, sharding.logical_to_spec(("batch", "length"), rules)))
        return np.asarray(fn(state, x))


def test_forward_is_the_same_on_every_mesh(folder):
    ids = np.random.default_rng(1).integers(0, 96, (8, 8)).astype(np.int32)
    plain = models.from_pretrained(folder)
    want = np.asarray(plain(jnp.asarray(ids)))
    assert np.abs(want).max() > 1.0
    for shape in MESHES:
        n = int(np.prod(shape))
        mesh = sharding.make_mesh(shape, devices=jax.devices()[:n])
        model = models.from_pretrained(folder, mesh=mesh, rules=sharding.TRAIN_RULES)
        got = run(model, mesh, sharding.TRAIN_RULES, ids)
        assert np.abs(got - want).max() <= 1e-5, shape


@pytest.mark.parametrize("rules_name", ["train", "rollout"])
def test_parameters_are_placed_as_the_rules_say(folder, rules_name):
    rules = sharding.get_rules(rules_name)
    mesh = sharding.make_mesh((2, 2, 2))
    model = models.from_pretrained(folder, mesh=mesh, rules=rules)
    state = nnx.state(model, nnx.Param)
    for path, var in nnx.to_flat_state(state):
        value = var.get_value()
        want = NamedSharding(mesh, sharding.logical_to_spec(var.get_metadata()["logical_axes"], rules))
        assert value.sharding.is_equivalent_to(want, value.ndim), path
    q = model.model.layers.self_attn.q_proj["kernel"].get_value()  # [L, e, heads, d]
    emb = model.model.embed_tokens["embedding"].get_value()  # [vocab, e]
    if rules_name == "train":  # fsdp on embed, tensor on heads / vocab
        assert q.sharding.spec == P(None, "fsdp", "tensor", None)
        assert q.addressable_shards[0].data.shape == (2, 16, 4, 4)
        assert emb.addressable_shards[0].data.shape == (48, 16)
    else:  # rollout: parameters replicated over data/fsdp, split over tensor only
        assert q.sharding.spec == P(None, None, "tensor", None)
        assert emb.addressable_shards[0].data.shape == (48, 32)
    np.testing.assert_array_equal(np.asarray(q), np.asarray(
        models.from_pretrained(folder).model.layers.self_attn.q_proj["kernel"].get_value()))


def test_indivisible_sharding_names_the_tensor(folder):
    mesh = sharding.make_mesh((1, 1, 8))  # kv_heads=4 cannot split 8 ways
    with pytest.raises(ValueError, match=r"model\.layers\.\*\.self_attn\.k_proj\.(weight|bias).*kv_heads"):
        models.from_pretrained(folder, mesh=mesh, rules=sharding.TRAIN_RULES)
