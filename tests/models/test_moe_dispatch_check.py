"""The check behind the warning a MoE model gives on GPU when XLA expands the experts' grouped
matmul (`jax.lax.ragged_dot`) into a dense dot over all experts (models.ragged_dot_expanded)."""
import logging

import jax
import pytest

from jaxrl_llm import models
from jaxrl_llm.models import _decoder
from test_models_hf import fixture, loaded, reference


def test_dispatch_check_tells_a_kept_grouped_matmul_from_xlas_dense_expansion():
    grouped = _decoder._GROUPED_HLO
    kept = ["%ragged-dot.1 = bf16[65536,768]{1,0} ragged-dot(bf16[65536,2048]{1,0} %p0, bf16[128,2048,768]{2,1,0} %p1,",
            '%cc = bf16[64,768]{1,0} custom-call(%x), custom_call_target="__gpu$xla.gpu.triton", api_version=',
            '%cc = bf16[64,768]{1,0} custom-call(%x), custom_call_target="mosaic_gpu_v2"']
    expanded = ["%ragged-dot.1 = bf16[65536,768]{1,0} dot(bf16[65536,128,2048]{2,1,0} %select, %p1)",  # kept name
                '%f = bf16[64,768]{1,0} fusion(%a), kind=kCustom, backend_config={"kind":"__triton_gemm"}',
                'metadata={op_name="jit(<lambda>)/ragged_dot_general"}']
    assert all(grouped.search(t) for t in kept)
    assert not any(grouped.search(t) for t in expanded)


def test_a_moe_model_on_gpu_warns_once_when_the_experts_matmul_is_expanded(monkeypatch, caplog):
    """XLA:CPU expands ragged_dot too (a real compile here says so); off GPU nothing is logged, on
    GPU (the backend check patched) one warning per shape names the experts and the fix."""
    assert models.ragged_dot_expanded(8, 32, 16, rows=16, dtype=jax.numpy.float32)
    models.warn_if_experts_expanded.cache_clear()
    _decoder._expanded_on_gpu.cache_clear()
    with caplog.at_level(logging.WARNING, logger="jaxrl_llm.models._decoder"):
        assert not models.warn_if_experts_expanded(8, 32, 16, 2)
        assert not caplog.records
        models.warn_if_experts_expanded.cache_clear()
        monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
        assert models.warn_if_experts_expanded(8, 32, 16, 2)
        models.warn_if_experts_expanded(8, 32, 16, 2)  # cached: no second warning
    [record] = caplog.records
    assert "dense dot over all 8 experts" in record.getMessage() and "ragged_dot_fusion" in record.getMessage()
    assert "the experts run densely" in record.getMessage()
    models.warn_if_experts_expanded.cache_clear()


def _logits_and_grads(name, ids, mesh_shape=None):
    """A fresh trace (no shared jit cache) of the fixture's logits and the gradient of a scalar."""
    import numpy as np
    from flax import nnx
    from jax.sharding import NamedSharding

    import sharding

    if mesh_shape is None:
        graphdef, state = nnx.split(loaded(name))
        ids = jax.numpy.asarray(ids)
        run = lambda f, *a: jax.jit(f)(*a)  # noqa: E731
    else:
        mesh = sharding.make_mesh(mesh_shape)
        graphdef, state = nnx.split(models.from_pretrained(fixture(name), mesh=mesh, rules=sharding.TRAIN_RULES))
        with sharding.use_rules(mesh, sharding.TRAIN_RULES):
            ids = jax.device_put(ids, NamedSharding(mesh, sharding.logical_to_spec(("batch", "length"),
                                                                                   sharding.TRAIN_RULES)))

        def run(f, *a):
            with sharding.use_rules(mesh, sharding.TRAIN_RULES):
                return jax.jit(f)(*a)
    logits = run(lambda s, i: nnx.merge(graphdef, s)(i), state, ids)
    grads = run(jax.grad(lambda s, i: jax.numpy.mean(nnx.merge(graphdef, s)(i) ** 2)), state, ids)
    return np.asarray(logits), [np.asarray(g) for g in jax.tree.leaves(nnx.to_pure_dict(grads))]


@pytest.mark.parametrize("name,mesh_shape", [("qwen3_moe", None), ("mixtral", None), ("qwen3_moe", (1, 4, 2))])
def test_running_every_expert_densely_equals_the_grouped_dispatch(name, mesh_shape, monkeypatch):
    """`dense_experts` (what a GPU that expands ragged_dot runs): every expert on every token with
    the unchosen ones weighted 0 gives the grouped dispatch's logits and gradients, alone and
    expert-parallel (fsdp=4); and the same logits as transformers."""
    import numpy as np

    ref = reference(name)
    ids = np.concatenate([ref["input_ids"]] * (4 if mesh_shape else 1))
    want, want_grads = _logits_and_grads(name, ids, mesh_shape)
    monkeypatch.setattr(_decoder, "dense_experts", lambda kernels: True)
    got, got_grads = _logits_and_grads(name, ids, mesh_shape)
    assert np.abs(got - want).max() <= 1e-5
    assert np.abs(got[:len(ref["logits"])] - ref["logits"]).max() <= 1e-4
    assert len(got_grads) == len(want_grads)
    for g, w in zip(got_grads, want_grads):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-6)


def test_only_a_gpu_that_expands_ragged_dot_runs_the_experts_densely(monkeypatch):
    kernels = (jax.ShapeDtypeStruct((8, 32, 16), jax.numpy.float32),) * 3
    assert not _decoder.dense_experts(kernels)  # CPU: the sorted ragged_dot dispatch
    monkeypatch.setattr(_decoder._kernels, "target_platform", lambda: "gpu")
    monkeypatch.setattr(_decoder, "_expanded_on_gpu", lambda n, e, f: (n, e, f) == (8, 32, 16))
    assert _decoder.dense_experts(kernels)
    assert not _decoder.dense_experts((jax.ShapeDtypeStruct((4, 32, 16), jax.numpy.float32),) * 3)


def test_the_dense_expert_path_keeps_no_all_experts_activation_for_the_backward(capsys):
    """Under remat=dots the model keeps matmul outputs; the dense path's `[T, E, f]` products
    are recomputed in its backward instead, so nothing of that size is saved."""
    from jax.ad_checkpoint import print_saved_residuals

    T, e, f, E, k = 12, 16, 8, 6, 2
    keys = jax.random.split(jax.random.key(0), 5)
    x = jax.random.normal(keys[0], (T, e))
    kernels = tuple(jax.random.normal(kk, shape) for kk, shape in zip(keys[1:4], ((E, e, f), (E, e, f), (E, f, e))))
    experts = jax.random.randint(keys[4], (T, k), 0, E)
    route = _decoder._route_matrix(experts, jax.numpy.full((T, k), 0.5), E)
    policy = jax.checkpoint_policies.dots_with_no_batch_dims_saveable
    fn = jax.checkpoint(lambda x, ks: (_decoder._dense_swiglu(x, route, ks) ** 2).sum(), policy=policy)
    capsys.readouterr()
    print_saved_residuals(fn, x, kernels)
    saved = capsys.readouterr().out.replace(" ", "")
    assert "argumentx" in saved and f"[{T},{E},{f}]" not in saved, saved
    plain = lambda x, ks: (_decoder._dense_swiglu_impl(x, route, ks) ** 2).sum()  # noqa: E731
    for got, want in zip(jax.tree.leaves(jax.grad(fn, (0, 1))(x, kernels)),
                         jax.tree.leaves(jax.grad(plain, (0, 1))(x, kernels))):
        assert float(jax.numpy.abs(got - want).max()) <= 1e-5
