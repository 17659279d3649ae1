"""The check behind the warning a MoE model gives on GPU when XLA expands the experts' grouped
matmul (`jax.lax.ragged_dot`) into a dense dot over all experts (models.ragged_dot_expanded)."""
import logging

import jax

from jaxrl_llm import models
from jaxrl_llm.models import _decoder


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
    with caplog.at_level(logging.WARNING, logger="jaxrl_llm.models._decoder"):
        assert not models.warn_if_experts_expanded(8, 32, 16, 2)
        assert not caplog.records
        models.warn_if_experts_expanded.cache_clear()
        monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
        assert models.warn_if_experts_expanded(8, 32, 16, 2)
        models.warn_if_experts_expanded(8, 32, 16, 2)  # cached: no second warning
    [record] = caplog.records
    assert "dense dot over all 8 experts" in record.getMessage() and "ragged_dot_fusion" in record.getMessage()
    models.warn_if_experts_expanded.cache_clear()
