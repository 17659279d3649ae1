"""Checkpointer: sharded save/restore round trips, async saves, pruning, mismatch errors."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxrl_llm.checkpoint import Checkpointer


def _mesh():
    return jax.make_mesh((4, 2), ("data", "model"))


def _state(mesh, hidden=4, seed=0):
    shard = NamedSharding(mesh, P("data", "model"))
    params = {
        "w": jax.device_put(jnp.arange(8.0 * hidden).reshape(8, hidden) + seed, shard),
        "b": jax.device_put(jnp.full((hidden,), 0.5 + seed), NamedSharding(mesh, P("model"))),
    }
    with jax.set_mesh(mesh):
        opt_state = _adam_after_one_step(params)
    keys = jax.device_put(jax.random.split(jax.random.key(seed), 4), NamedSharding(mesh, P("data")))
    return {"params": params, "opt_state": opt_state, "rng": jax.random.key(seed + 7),
            "rngs": keys}


@jax.jit
def _adam_after_one_step(params):
    """Adam state after one update: non-trivial mu / nu / count (one compile per shape)."""
    tx = optax.adam(1e-2)
    _, opt_state = tx.update(jax.tree.map(jnp.ones_like, params), tx.init(params), params)
    return opt_state


def _abstract(state):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                        state)


def _assert_trees_equal(a, b):
    a = jax.tree.map(lambda x: jax.random.key_data(x) if jax.dtypes.issubdtype(
        x.dtype, jax.dtypes.prng_key) else x, a)
    b = jax.tree.map(lambda x: jax.random.key_data(x) if jax.dtypes.issubdtype(
        x.dtype, jax.dtypes.prng_key) else x, b)
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_checkpoint_sharded_roundtrip_keeps_values_shardings_keys_and_meta(tmp_path):
    mesh = _mesh()
    state = _state(mesh)
    meta = {"data_iter": {"epoch": 1, "index": 17}, "kl_coef": 0.001, "config": {"lr": 1e-6}}
    with Checkpointer(tmp_path / "ckpt", async_save=False) as ckpt:
        assert ckpt.save(5, state, meta)
    restored, restored_meta = Checkpointer(tmp_path / "ckpt").restore(target=_abstract(state))
    _assert_trees_equal(restored, state)
    assert restored_meta == meta
    assert restored["params"]["w"].sharding == state["params"]["w"].sharding
    assert restored["params"]["b"].sharding == state["params"]["b"].sharding
    assert jax.dtypes.issubdtype(restored["rng"].dtype, jax.dtypes.prng_key)
    assert restored["rngs"].sharding.spec == P("data")
    assert isinstance(restored["opt_state"][0], optax.ScaleByAdamState)
    assert int(restored["opt_state"][0].count) == 1
    # the restored key draws the same numbers as the original
    np.testing.assert_array_equal(jax.random.uniform(restored["rng"], (3,)),
                                  jax.random.uniform(state["rng"], (3,)))


def test_checkpoint_restore_uses_target_sharding_and_dtype(tmp_path):
    mesh = _mesh()
    state = _state(mesh)
    with Checkpointer(tmp_path, async_save=False) as ckpt:
        ckpt.save(1, state, {})
    target = _abstract(state)
    new_sharding = NamedSharding(mesh, P(None, "data"))
    target["params"]["w"] = jax.ShapeDtypeStruct((8, 4), jnp.bfloat16, sharding=new_sharding)
    restored, _ = Checkpointer(tmp_path).restore(1, target=target)
    assert restored["params"]["w"].dtype == jnp.bfloat16
    assert restored["params"]["w"].sharding == new_sharding
    np.testing.assert_allclose(np.asarray(restored["params"]["w"], np.float32),
                               np.asarray(state["params"]["w"]))


def test_checkpoint_concrete_arrays_as_target(tmp_path):
    mesh = _mesh()
    state = _state(mesh)
    with Checkpointer(tmp_path, async_save=False) as ckpt:
        ckpt.save(3, state, {"a": 1})
    fresh = _state(mesh, seed=1)  # same structure, different values
    restored, meta = Checkpointer(tmp_path).restore(target=fresh)
    _assert_trees_equal(restored, state)
    assert meta == {"a": 1}


def test_checkpoint_async_save_then_wait_is_readable(tmp_path):
    mesh = _mesh()
    state = _state(mesh)
    ckpt = Checkpointer(tmp_path, async_save=True)
    assert ckpt.save(10, state, {"step": 10})
    ckpt.wait()
    assert ckpt.latest_step() == 10
    restored, meta = ckpt.restore(10, target=_abstract(state))
    _assert_trees_equal(restored, state)
    assert meta == {"step": 10}
    ckpt.close()


def test_checkpoint_max_to_keep_prunes_oldest(tmp_path):
    state = {"x": jnp.arange(4.0)}
    with Checkpointer(tmp_path, max_to_keep=2, async_save=False) as ckpt:
        for step in (1, 2, 3, 4):
            ckpt.save(step, state, {"s": step})
        assert ckpt.all_steps() == [3, 4]
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.isdigit()) == ["3", "4"]


def test_checkpoint_disabled_writes_nothing(tmp_path):
    ckpt = Checkpointer(tmp_path / "off", enable=False)
    assert ckpt.save(1, {"x": jnp.ones(2)}, {}) is False
    assert ckpt.latest_step() is None
    assert not (tmp_path / "off").exists()


def test_checkpoint_shape_mismatch_names_key(tmp_path):
    mesh = _mesh()
    with Checkpointer(tmp_path, async_save=False) as ckpt:
        ckpt.save(1, _state(mesh, hidden=4), {})
    bigger = _abstract(_state(mesh, hidden=8))
    # dict keys flatten sorted, so the first mismatch is the Adam moment of params/b
    expected = r"shape mismatch at 'opt_state/0/mu/b': checkpoint has \(4,\), target has \(8,\)"
    with pytest.raises(ValueError, match=expected):
        Checkpointer(tmp_path).restore(target=bigger)


def test_checkpoint_structure_mismatch_names_key(tmp_path):
    mesh = _mesh()
    state = _state(mesh)
    with Checkpointer(tmp_path, async_save=False) as ckpt:
        ckpt.save(1, state, {})
    target = _abstract(state)
    target["params"]["extra"] = jax.ShapeDtypeStruct((2,), jnp.float32)
    with pytest.raises(ValueError, match=r"'params/extra' is not in the checkpoint"):
        Checkpointer(tmp_path).restore(target=target)
    del target["params"]["extra"], target["params"]["b"]
    with pytest.raises(ValueError, match=r"checkpoint key 'params/b' is missing from the target"):
        Checkpointer(tmp_path).restore(target=target)


def test_checkpoint_restore_missing_step_or_empty_dir_raises(tmp_path):
    with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
        Checkpointer(tmp_path / "empty").restore()
    with Checkpointer(tmp_path / "c", async_save=False) as ckpt:
        ckpt.save(2, {"x": jnp.ones(2)}, {})
    with pytest.raises(FileNotFoundError, match=r"step 9 not found .* \[2\]"):
        Checkpointer(tmp_path / "c").restore(9)


def test_checkpoint_meta_must_be_json(tmp_path):
    with Checkpointer(tmp_path, async_save=False) as ckpt:
        with pytest.raises(TypeError, match="meta is not JSON-serialisable"):
            ckpt.save(1, {"x": jnp.ones(2)}, {"bad": object()})


def test_checkpoint_restore_without_target_keeps_saved_layout_and_host_leaves(tmp_path):
    mesh = _mesh()
    sharded = jax.device_put(jnp.arange(32.0).reshape(8, 4), NamedSharding(mesh, P("data")))
    state = {"w": sharded, "rng": jax.random.key(3), "host": np.arange(3), "count": 7}
    with Checkpointer(tmp_path, async_save=False) as ckpt:
        ckpt.save(1, state, {})
    restored, _ = Checkpointer(tmp_path).restore()
    assert restored["w"].sharding.spec == P("data")
    np.testing.assert_array_equal(np.asarray(restored["w"]), np.asarray(sharded))
    np.testing.assert_array_equal(jax.random.key_data(restored["rng"]),
                                  jax.random.key_data(state["rng"]))
    assert isinstance(restored["host"], np.ndarray) and restored["host"].tolist() == [0, 1, 2]
    assert restored["count"] == 7
