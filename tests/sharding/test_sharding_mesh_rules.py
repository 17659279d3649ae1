"""Mesh construction and logical-axis → PartitionSpec resolution."""
import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import sharding
from sharding import MESH_AXES, MeshConfig


def _shape3(mesh):
    return tuple(mesh.shape[a] for a in ("data", "fsdp", "tensor"))


@pytest.mark.parametrize("shape", [(8, 1, 1), (1, 8, 1), (1, 2, 4), (2, 2, 2)])
def test_make_mesh_has_requested_shape_over_all_devices(shape):
    mesh = sharding.make_mesh(shape)
    assert mesh.axis_names == MESH_AXES
    assert _shape3(mesh) == shape and mesh.shape["context"] == 1  # 3 entries: context 1
    assert sorted(d.id for d in mesh.devices.flat) == sorted(d.id for d in jax.devices())


def test_make_mesh_single_device_subset():
    mesh = sharding.make_mesh(MeshConfig(1, 1, 1), devices=jax.devices()[:1])
    assert mesh.devices.shape == (1, 1, 1, 1)
    assert mesh.devices.flat[0] == jax.devices()[0]


def test_make_mesh_explicit_device_subset_for_disaggregation():
    rollout_devices = jax.devices()[4:]
    mesh = sharding.make_mesh({"data": 1, "fsdp": 1, "tensor": -1}, devices=rollout_devices)
    assert mesh.shape["tensor"] == 4
    assert {d.id for d in mesh.devices.flat} == {d.id for d in rollout_devices}


@pytest.mark.parametrize("config, expected", [
    (MeshConfig(), (1, 8, 1)),
    (MeshConfig(data=2, fsdp=-1, tensor=2), (2, 2, 2)),
    (MeshConfig(data=-1, fsdp=1, tensor=4), (2, 1, 4)),
    ({"tensor": 8, "fsdp": 1}, (1, 1, 8)),
])
def test_minus_one_fills_the_remaining_devices(config, expected):
    mesh = sharding.make_mesh(config)
    assert _shape3(mesh) == expected


def test_mesh_product_mismatch_names_shape_and_device_count():
    with pytest.raises(ValueError, match=r"\(data=2, fsdp=2, tensor=4\) needs 16 devices but 8"):
        sharding.make_mesh((2, 2, 4))


def test_mesh_fill_that_does_not_divide_is_an_error():
    with pytest.raises(ValueError, match=r"cannot fill fsdp=-1, 8 devices are not divisible .*3"):
        sharding.make_mesh((3, -1, 1))


@pytest.mark.parametrize("kwargs, match", [
    ({"data": -1, "fsdp": -1}, "at most one axis may be -1"),
    ({"tensor": 0}, "MeshConfig.tensor must be a positive int or -1"),
    ({"data": -3}, "MeshConfig.data"),
])
def test_mesh_config_rejects_bad_sizes(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MeshConfig(**kwargs)


def test_mesh_config_from_dict_rejects_unknown_field():
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['model'\]"):
        MeshConfig.from_dict({"data": 1, "model": 2})
    assert MeshConfig.from_dict({"data": 2, "tensor": 4}) == MeshConfig(2, -1, 4)


@pytest.mark.parametrize("axes, expected", [
    (("vocab", "embed"), P("tensor", "fsdp")),
    (("embed", "mlp"), P("fsdp", "tensor")),
    (("layers", "embed", "heads", "head_dim"), P(None, "fsdp", "tensor", None)),
    (("layers", "mlp", "embed"), P(None, "tensor", "fsdp")),
    (("batch", "length", "embed"), P(("data", "fsdp"), None, None)),  # fsdp already used
    (("batch", "length", "heads", "head_dim"), P(("data", "fsdp"), None, "tensor", None)),
    (("batch", "length", "vocab"), P(("data", "fsdp"), None, "tensor")),
    (("cache_batch", "cache_length", "kv_heads", "head_dim"), P(("data", "fsdp"), None, "tensor", None)),
    (("embed", None), P("fsdp", None)),
])
def test_train_rules_resolve_to_fsdp_plus_tensor_specs(axes, expected):
    # on a mesh with context 1 (the default) the context axis is left out of every spec
    assert sharding.logical_to_spec(axes, sharding.TRAIN_RULES, sharding.make_mesh((1, 8, 1))) == expected


@pytest.mark.parametrize("axes, expected", [
    (("vocab", "embed"), P("tensor", None)),
    (("embed", "mlp"), P(None, "tensor")),
    (("layers", "kv_heads", "head_dim"), P(None, "tensor", None)),
    (("batch", "length", "embed"), P(("data", "fsdp"), None, None)),
    (("cache_batch", "cache_length", "kv_heads", "head_dim"), P(("data", "fsdp"), None, "tensor", None)),
])
def test_rollout_rules_replicate_params_over_data_and_fsdp(axes, expected):
    assert sharding.logical_to_spec(axes, sharding.get_rules("rollout")) == expected


def test_duplicate_mesh_axis_leaves_later_dim_unsharded():
    rules = (("a", "tensor"), ("b", ("fsdp", "tensor")), ("c", "fsdp"))
    assert sharding.logical_to_spec(("a", "b", "c"), rules) == P("tensor", None, "fsdp")


def test_unknown_logical_axis_lists_known_names():
    with pytest.raises(ValueError, match=r"unknown logical axis 'hidden'.*'embed'"):
        sharding.logical_to_spec(("hidden",), "train")


def test_unknown_rule_set_and_bad_mesh_axis_raise():
    with pytest.raises(ValueError, match=r"unknown sharding rules 'serve'.*\['rollout', 'train'\]"):
        sharding.get_rules("serve")
    with pytest.raises(ValueError, match=r"unknown mesh axes \['model'\]"):
        sharding.logical_to_spec(("x",), (("x", "model"),))


def test_rules_dict_holds_both_tables():
    assert sharding.RULES["train"] is sharding.TRAIN_RULES
    assert sharding.RULES["rollout"] is sharding.ROLLOUT_RULES
    assert dict(sharding.TRAIN_RULES)["layers"] is None


def test_logical_sharding_checks_divisibility_with_name():
    mesh = sharding.make_mesh((1, 2, 4))
    ok = sharding.logical_sharding(mesh, ("embed", "mlp"), "train", shape=(8, 12))
    assert ok.spec == P("fsdp", "tensor") and ok.mesh is mesh
    with pytest.raises(ValueError, match=r"layer0.w: dim 1 \(size 6, logical axis 'mlp'\) is not "
                       r"divisible by mesh axes \('tensor',\) of total size 4"):
        sharding.logical_sharding(mesh, ("embed", "mlp"), "train", shape=(8, 6), name="layer0.w")
    with pytest.raises(ValueError, match=r"have 2 entries but the array has shape \(8,\)"):
        sharding.logical_sharding(mesh, ("embed", "mlp"), "train", shape=(8,))


def test_logical_sharding_places_data():
    mesh = sharding.make_mesh((2, 2, 2))
    s = sharding.logical_sharding(mesh, ("batch", "vocab"), "train", shape=(8, 6))
    x = jax.device_put(np.arange(48.0).reshape(8, 6), s)
    assert x.addressable_shards[0].data.shape == (2, 3)


def test_logical_axis_size_counts_the_parts_a_dim_is_split_into():
    mesh = sharding.make_mesh((2, 2, 2))  # data, fsdp, tensor
    assert sharding.logical_axis_size(mesh, "batch", sharding.TRAIN_RULES) == 4  # data x fsdp
    assert sharding.logical_axis_size(mesh, "heads", sharding.TRAIN_RULES) == 2
    assert sharding.logical_axis_size(mesh, "cache_length", "rollout") == 1
    with pytest.raises(ValueError, match="unknown logical axis"):
        sharding.logical_axis_size(mesh, "nope", sharding.TRAIN_RULES)


def test_context_axis_is_a_fourth_entry_placed_between_fsdp_and_tensor():
    mesh = sharding.make_mesh((1, 2, 2, 2))  # (data, fsdp, tensor, context): MeshConfig's field order
    assert mesh.axis_names == ("data", "fsdp", "context", "tensor")
    assert dict(mesh.shape) == {"data": 1, "fsdp": 2, "context": 2, "tensor": 2}
    assert sharding.make_mesh(MeshConfig(fsdp=-1, context=4)).shape["fsdp"] == 2
    with pytest.raises(ValueError, match=r"\(data=1, fsdp=2, tensor=1, context=3\) needs 6 devices but 8"):
        sharding.make_mesh((1, 2, 1, 3))
    with pytest.raises(ValueError, match=r"must have 3 entries \(data, fsdp, tensor\) or 4"):
        sharding.make_mesh((1, 8))
