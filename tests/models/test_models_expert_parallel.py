"""Expert parallelism: the `expert` dim of MoE weights split over the mesh (the `expert` rule), the
dispatch run per expert shard (`_decoder._expert_parallel`), results equal to one device."""
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

import sharding
from jaxrl_llm import models
from jaxrl_llm.models import _decoder
from test_models_hf import fixture, reference

# (data, fsdp, tensor[, context]): experts over fsdp=4 (one of the fixture's 4 experts per device)
# beside data=2; experts over fsdp=2 with their `mlp` dim on tensor=2 and the sequence on context=2
# (the second also in steps of a few pairs: `EP_STEP_PAIRS`, the scan over row blocks)
MESHES = [((2, 4, 1), "none", None), ((1, 2, 2, 2), "dots", 32)]


def _experts(model):
    return model.model.layers.mlp.experts


def _ids():
    return np.concatenate([reference("qwen3_moe")["input_ids"]] * 4)  # batch 8


def _loss_and_grads(model, ids, mesh=None, rules=None):
    graphdef, state = nnx.split(model)

    def loss(s, i):
        logits = nnx.merge(graphdef, s)(i)
        return jnp.mean(jax.nn.log_softmax(logits)[..., 7]), logits

    fn = jax.jit(jax.value_and_grad(loss, has_aux=True))
    if mesh is None:
        (value, logits), grads = fn(state, ids)
        return np.asarray(logits), nnx.to_pure_dict(grads), None
    with sharding.use_rules(mesh, rules):
        x = jax.device_put(ids, NamedSharding(mesh, sharding.logical_to_spec(("batch", "length"), rules)))
        (value, logits), grads = fn(state, x)
        hlo = fn.lower(state, x).as_text()
    return np.asarray(logits), nnx.to_pure_dict(grads), hlo


@pytest.fixture(scope="module")
def one_device():
    return _loss_and_grads(models.from_pretrained(fixture("qwen3_moe")), _ids())


@pytest.mark.parametrize("shape,remat,step_pairs", MESHES)
def test_expert_parallel_logits_and_gradients_equal_one_device(one_device, shape, remat, step_pairs, monkeypatch):
    want_logits, want_grads, _ = one_device
    if step_pairs:
        monkeypatch.setattr(_decoder, "EP_STEP_PAIRS", step_pairs)
    rows = []  # the rows each device runs through its experts in one go
    own = _decoder._own_experts
    monkeypatch.setattr(_decoder, "_own_experts", lambda x, *a: rows.append(x.shape[0]) or own(x, *a))
    mesh = sharding.make_mesh(shape)
    model = models.from_pretrained(fixture("qwen3_moe"), mesh=mesh, rules="train", remat=remat)
    kernel = _experts(model).gate_proj["kernel"][...]  # [layers, experts, embed, mlp]
    assert kernel.sharding.spec == PartitionSpec(None, "fsdp", None, "tensor")
    assert kernel.addressable_shards[0].data.shape[1] == 4 // shape[1]  # each device: 4/fsdp experts
    logits, grads, hlo = _loss_and_grads(model, _ids(), mesh, "train")
    assert "reduce_scatter" in hlo  # the per-shard dispatch, not a gather of the expert weights
    # all rows of the fsdp group at once, or blocks of at most step_pairs / top_k (2) rows
    assert set(rows) == ({step_pairs // 2} if step_pairs else {8 * 16 // shape[0]}), rows
    np.testing.assert_allclose(logits, want_logits, atol=2e-5, rtol=0)
    flat_want = dict(jax.tree_util.tree_flatten_with_path(want_grads)[0])
    flat_got = dict(jax.tree_util.tree_flatten_with_path(grads)[0])
    assert flat_got.keys() == flat_want.keys()
    for path, g in flat_got.items():
        w = np.asarray(flat_want[path])
        assert np.abs(w).max() > 0, path
        np.testing.assert_allclose(np.asarray(g), w, atol=1e-6 + 1e-4 * np.abs(w).max(), rtol=0,
                                   err_msg=jax.tree_util.keystr(path))


# rows over data only, experts over fsdp: each device has all of its data shard's tokens (no gather)
# and the fsdp shards' partial sums are added by a psum
_ROWS_ON_DATA = tuple((n, "data") if n in ("batch", "cache_batch") else (n, a) for n, a in sharding.ROLLOUT_RULES)


@pytest.mark.parametrize("rules", ["rollout", _ROWS_ON_DATA], ids=["rollout", "rows_on_data"])
def test_expert_parallel_pads_token_counts_that_do_not_split(rules):
    """3 tokens over the token shards (a decode step with few slots): padded, same output."""
    rng = np.random.default_rng(0)
    T, e, f, E, k = 3, 8, 6, 4, 2
    x = jnp.asarray(rng.normal(size=(T, e)).astype(np.float32))
    kern = tuple(jnp.asarray(rng.normal(size=s).astype(np.float32)) for s in ((E, e, f), (E, e, f), (E, f, e)))
    w, ids = _decoder.route(jnp.asarray(rng.normal(size=(T, E)).astype(np.float32)), k, True)
    want = np.asarray(_decoder.expert_mix(x, ids, w, kern))
    mesh = sharding.make_mesh((2, 4, 1))
    with sharding.use_rules(mesh, rules):
        plan = _decoder._expert_plan(E)
        assert plan.experts == ("fsdp",) and ("fsdp" in plan.tokens) == (rules == "rollout")
        got = np.asarray(jax.jit(_decoder.expert_mix)(x, ids, w, kern))
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


def test_experts_that_do_not_split_over_the_expert_axis_are_named():
    mesh = sharding.make_mesh((1, 8, 1))
    with sharding.use_rules(mesh, "train"), pytest.raises(ValueError, match=r"num_experts=4 .* 8 expert-parallel"):
        _decoder._expert_plan(4)
    with pytest.raises(ValueError, match=r"logical axis 'expert'.*not divisible.*size must divide num_experts"):
        models.from_pretrained(fixture("qwen3_moe"), mesh=mesh, rules="train")


@pytest.mark.parametrize("layout", ["stacked"])  # "per_layer" passes too (13 s more on CPU)
def test_engine_greedy_on_an_expert_parallel_mesh_and_sync_keeps_the_experts_in_place(layout):
    import rollout

    gen = json.loads(open(os.path.join(fixture("qwen3_moe"), "generate.json")).read())
    mesh = sharding.make_mesh((2, 4, 1))
    engine = rollout.Engine.from_pretrained(fixture("qwen3_moe"), mesh=mesh, max_concurrent_decodes=8,
                                            max_prefill_length=16, max_target_length=32, dtype="float32",
                                            temperature=0.0, layer_layout=layout)

    def generate():
        batch = rollout.RolloutDriver(engine, steps_per_sync=4).generate(
            [c["prompt"] for c in gen["cases"]], n=1, max_new_tokens=gen["max_new_tokens"],
            sampling=rollout.SamplingParams(temperature=0.0), seed=0)
        return [batch.responses[i].tolist() for i in range(len(gen["cases"]))]

    def kernel(params):
        layers = params["model"]["layers"]
        return (layers if layout == "stacked" else layers[1])["mlp"]["experts"]["down_proj"]["kernel"]

    lead = (None,) if layout == "stacked" else ()
    assert kernel(engine.params).sharding.spec == PartitionSpec(*lead, "fsdp", "tensor", None)
    assert generate() == [c["output"] for c in gen["cases"]]
    # the trainer's weights (train rules, same mesh, stacked): synced, still the same generation;
    # stacked, the experts have the engine's layout and are taken without a copy
    trained = nnx.to_pure_dict(nnx.state(models.from_pretrained(fixture("qwen3_moe"), mesh=mesh, rules="train"),
                                         nnx.Param))
    engine.update_params(trained)
    if layout == "stacked":
        assert kernel(engine.params) is kernel(trained)
    assert generate() == [c["output"] for c in gen["cases"]]
