"""State shardings from NNX metadata, shard_state, reshard (zero copy, bytes, dtype, donation)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import sharding


class Tiny(nnx.Module):
    """Scanned-layer-like parameters annotated with logical axes, plus an unannotated bias.

    Values come from numpy (no JAX RNG) so building it compiles nothing and the tests stay fast.
    """

    def __init__(self, embed=16, mlp=32, vocab=24, seed=0):
        rng = np.random.default_rng(seed)
        init = lambda *shape: jnp.asarray(rng.standard_normal(shape, dtype=np.float32))
        self.embedding = nnx.Param(init(vocab, embed), logical_axes=("vocab", "embed"))
        self.w_in = nnx.Param(init(2, embed, mlp), logical_axes=("layers", "embed", "mlp"))
        self.w_out = nnx.Param(init(2, mlp, embed), logical_axes=("layers", "mlp", "embed"))
        self.bias = nnx.Param(jnp.zeros((embed,)))
        self.steps = nnx.Variable(jnp.zeros((), jnp.int32))


@pytest.fixture(scope="module")
def mesh():
    return sharding.make_mesh((2, 2, 2))


def test_param_metadata_carries_logical_axes():
    model = Tiny()
    assert model.w_in.get_metadata()["logical_axes"] == ("layers", "embed", "mlp")


@pytest.mark.parametrize("rules, expected", [
    ("train", {"embedding": P("tensor", "fsdp"), "w_in": P(None, "fsdp", "tensor"),
               "w_out": P(None, "tensor", "fsdp")}),
    ("rollout", {"embedding": P("tensor", None), "w_in": P(None, None, "tensor"),
                 "w_out": P(None, "tensor", None)}),
])
def test_state_shardings_follow_metadata(mesh, rules, expected):
    state = nnx.state(Tiny())
    shardings = sharding.state_shardings(state, mesh, rules)
    assert jax.tree.structure(shardings) == jax.tree.structure(nnx.as_pure(state))
    for name, spec in expected.items():
        assert shardings[name].spec == spec and shardings[name].mesh is mesh
    assert shardings["bias"].spec == P() and shardings["steps"].spec == P()


def test_state_shardings_on_abstract_state_matches_concrete(mesh):
    _, abstract = nnx.split(nnx.eval_shape(lambda: Tiny()))
    concrete = nnx.state(Tiny())
    assert sharding.state_shardings(abstract, mesh, "train") == \
        sharding.state_shardings(concrete, mesh, "train")


def test_state_shardings_indivisible_dim_names_the_parameter(mesh):
    state = nnx.state(Tiny(mlp=3))
    with pytest.raises(ValueError, match=r"w_in.*dim 2 \(size 3, logical axis 'mlp'\)"):
        sharding.state_shardings(state, mesh, "train")


def test_shard_state_places_values(mesh):
    state = nnx.state(Tiny())
    placed = sharding.shard_state(state, mesh, "train")
    assert isinstance(placed, nnx.State)
    assert placed["w_in"].get_value().sharding.spec == P(None, "fsdp", "tensor")
    assert placed["w_in"].get_value().addressable_shards[0].data.shape == (2, 8, 16)
    assert placed["embedding"].get_metadata()["logical_axes"] == ("vocab", "embed")
    np.testing.assert_array_equal(placed["w_out"].get_value(), state["w_out"].get_value())


def test_shard_state_on_module_returns_sharded_module(mesh):
    model = Tiny()
    sharded = sharding.shard_state(model, mesh, "rollout")
    assert isinstance(sharded, Tiny)
    assert sharded.w_out.get_value().sharding.spec == P(None, "tensor", None)
    np.testing.assert_array_equal(sharded.embedding.get_value(), model.embedding.get_value())


def test_init_sharded_builds_in_place(mesh):
    model = sharding.init_sharded(lambda: Tiny(), mesh, "train")
    ref = Tiny()
    assert model.embedding.get_value().sharding.spec == P("tensor", "fsdp")
    np.testing.assert_allclose(model.w_in.get_value(), ref.w_in.get_value(), rtol=1e-6)


def test_tree_shardings_pairs_values_with_axes(mesh):
    cache = {"k": jnp.zeros((4, 8, 2, 4)), "v": jnp.zeros((4, 8, 2, 4)), "pos": jnp.zeros((4,), jnp.int32)}
    axes = {"k": ("cache_batch", "cache_length", "kv_heads", "head_dim"),
            "v": ("cache_batch", "cache_length", "kv_heads", "head_dim"), "pos": None}
    shardings = sharding.tree_shardings(cache, axes, mesh, "rollout")
    assert shardings["k"].spec == P(("data", "fsdp"), None, "tensor", None)
    assert shardings["pos"].spec == P()
    # a prefix annotation applies to every array below it
    opt = {"mu": {"w": jnp.zeros((8, 4))}, "nu": {"w": jnp.zeros((8, 4))}}
    opt_sh = sharding.tree_shardings(opt, {"mu": ("embed", "mlp"), "nu": ("embed", "mlp")}, mesh, "train")
    assert opt_sh["nu"]["w"].spec == P("fsdp", "tensor")
    with pytest.raises(ValueError, match=r"\['mu'\]\['w'\]: dim 0 \(size 3"):
        sharding.tree_shardings({"mu": {"w": jnp.zeros((3, 4))}}, {"mu": ("embed", "mlp")}, mesh, "train")


def _params(mesh, rules):
    state = nnx.state(Tiny(), nnx.Param)
    return sharding.shard_state(state, mesh, rules)


def test_reshard_fsdp_to_tensor_moves_only_changed_leaves(mesh):
    train = _params(mesh, "train")
    target = sharding.state_shardings(train, mesh, "rollout")
    out, stats = sharding.reshard_with_stats(train, target)
    for name in ("embedding", "w_in", "w_out"):
        assert out[name].get_value().sharding.spec == target[name].spec
        np.testing.assert_array_equal(out[name].get_value(), train[name].get_value())
    # bias is replicated in both layouts: not copied, same object
    assert out["bias"].get_value() is train["bias"].get_value()
    f32 = 4
    moved = (24 * 16 + 2 * 16 * 32 * 2) * f32
    assert stats == {"bytes_moved": moved, "bytes_total": moved + 16 * f32, "num_copied": 3}


def test_reshard_matching_layout_is_zero_copy(mesh):
    train = _params(mesh, "train")
    out, stats = sharding.reshard_with_stats(train, sharding.state_shardings(train, mesh, "train"))
    assert stats["bytes_moved"] == 0 and stats["num_copied"] == 0
    for a, b in zip(jax.tree.leaves(train), jax.tree.leaves(out)):
        assert a is b
        assert a.addressable_shards[0].data.unsafe_buffer_pointer() == \
            b.addressable_shards[0].data.unsafe_buffer_pointer()


def test_reshard_casts_dtype_fused(mesh):
    train = _params(mesh, "train")
    target = sharding.state_shardings(train, mesh, "rollout")
    out, stats = sharding.reshard_with_stats(train, target, dtype=jnp.bfloat16)
    w = out["w_in"].get_value()
    assert w.dtype == jnp.bfloat16 and w.sharding.spec == P(None, None, "tensor")
    np.testing.assert_array_equal(w, train["w_in"].get_value().astype(jnp.bfloat16))
    # same layout but new dtype still counts as a copy, at the target's byte size
    assert out["bias"].get_value().dtype == jnp.bfloat16
    assert stats["num_copied"] == 4
    assert stats["bytes_moved"] == stats["bytes_total"] == (24 * 16 + 2 * 16 * 32 * 2 + 16) * 2


def test_reshard_leaves_integer_leaves_uncast(mesh):
    s = NamedSharding(mesh, P())
    ints = jax.device_put(jnp.arange(8, dtype=jnp.int32), s)
    out = sharding.reshard({"i": ints}, {"i": s}, dtype=jnp.bfloat16)
    assert out["i"] is ints


def test_reshard_donation_frees_copied_inputs(mesh):
    x = jax.device_put(jnp.arange(64.0).reshape(8, 8), NamedSharding(mesh, P("fsdp", None)))
    keep = jax.device_put(jnp.ones((8,)), NamedSharding(mesh, P()))
    expected = np.asarray(x)
    target = {"x": NamedSharding(mesh, P(None, "tensor")), "keep": keep.sharding}
    out = sharding.reshard({"x": x, "keep": keep}, target, donate=True)
    assert x.is_deleted()
    assert not keep.is_deleted() and out["keep"] is keep
    np.testing.assert_array_equal(out["x"], expected)
    y = jax.device_put(jnp.arange(64.0).reshape(8, 8), NamedSharding(mesh, P("fsdp", None)))
    out = sharding.reshard(y, NamedSharding(mesh, P("tensor", None)), dtype=jnp.bfloat16, donate=True)
    assert y.is_deleted() and out.dtype == jnp.bfloat16


def test_reshard_without_donation_keeps_inputs(mesh):
    x = jax.device_put(jnp.arange(64.0).reshape(8, 8), NamedSharding(mesh, P("fsdp", None)))
    sharding.reshard(x, NamedSharding(mesh, P(None, "tensor")))
    assert not x.is_deleted()


def test_reshard_across_device_sets_for_disaggregated_rollout():
    train_mesh = sharding.make_mesh((1, 4, 1), devices=jax.devices()[:4])
    roll_mesh = sharding.make_mesh((1, 1, 4), devices=jax.devices()[4:])
    x = jax.device_put(jnp.arange(32.0).reshape(4, 8), NamedSharding(train_mesh, P("fsdp", None)))
    out = sharding.reshard(x, NamedSharding(roll_mesh, P(None, "tensor")), dtype=jnp.bfloat16)
    assert out.sharding.device_set == set(jax.devices()[4:])
    np.testing.assert_array_equal(out, np.arange(32.0).reshape(4, 8).astype(jnp.bfloat16))


def test_reshard_structure_mismatch_is_a_clear_error(mesh):
    s = NamedSharding(mesh, P())
    with pytest.raises(ValueError, match="target_shardings must match"):
        sharding.reshard({"a": jnp.ones(2)}, {"b": s})


def test_transfer_to_disjoint_replicas_sends_every_shard_and_casts():
    """sharding.transfer (the multi-host weight sync): 2 training devices -> 3 replicas of
    tensor=2 on the other 6 (more targets than sources: several ppermute rounds); each replica
    gets the exact values, cast, in its own layout, without sharing the source's devices."""
    devices = jax.devices()
    train = sharding.make_mesh((1, 2, 1), devices=devices[:2])
    replicas = [sharding.make_mesh((1, 1, 2), devices=devices[2 + 2 * i:4 + 2 * i]) for i in range(3)]
    rmesh = sharding.replica_mesh(replicas)
    assert dict(rmesh.shape) == {sharding.REPLICA_AXIS: 3, "data": 1, "fsdp": 1, "context": 1, "tensor": 2}
    values = {"w": np.arange(4 * 6 * 8, dtype=np.float32).reshape(4, 6, 8) / 7,
              "b": np.arange(8, dtype=np.float32)}
    src = {"w": jax.device_put(values["w"], NamedSharding(train, P(None, "fsdp"))),
           "b": jax.device_put(values["b"], NamedSharding(train, P()))}
    specs = {"w": P(None, None, "tensor"), "b": P("tensor")}
    moved = sharding.transfer(src, {k: NamedSharding(rmesh, s) for k, s in specs.items()}, dtype=jnp.bfloat16)
    for mesh in replicas:
        local = {k: sharding.local_replica(moved[k], NamedSharding(mesh, s)) for k, s in specs.items()}
        for k, x in local.items():
            assert x.dtype == jnp.bfloat16 and x.sharding.mesh == mesh
            assert x.sharding.device_set == set(mesh.devices.flat)
            np.testing.assert_array_equal(np.asarray(x, np.float32),
                                          values[k].astype(jnp.bfloat16).astype(np.float32))
    with pytest.raises(ValueError, match="disjoint devices"):
        sharding.transfer(src, {k: NamedSharding(train, P()) for k in src})
