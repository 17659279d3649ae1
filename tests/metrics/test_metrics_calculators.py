"""Golden values for the pure metric calculators on small hand-made batches."""
import numpy as np
import pytest

from jaxrl_llm import metrics as M


def _batch():
    """b=3, prompt p=3 (left-padded), response t=4; row 2 is an aborted (empty) response."""
    prompt_mask = np.array([[0, 1, 1], [1, 1, 1], [0, 0, 1]])  # lengths 2, 3, 1
    response_mask = np.array([[1, 1, 1, 1], [1, 1, 0, 0], [0, 0, 0, 0]])  # lengths 4, 2, 0
    return {
        "prompts": np.zeros((3, 3), np.int32),
        "responses": np.zeros((3, 4), np.int32),
        "attention_mask": np.concatenate([prompt_mask, response_mask], axis=1),
        "response_mask": response_mask,
        # row sums 1.0, 0.5 and 9.0 (the aborted row must not count)
        "token_level_scores": np.array([[0, 0, 0, 1], [0, .5, 0, 0], [0, 0, 0, 9.]]),
        "token_level_rewards": np.array([[-.1, 0, 0, 1], [0, .5, -.2, 0], [0, 0, 0, 9.]]),
        "advantages": np.array([[1, 2, 3, 4], [5, 6, 100, 100], [100] * 4], np.float32),
        "returns": np.array([[1, 1, 2, 2], [3, 3, 50, 50], [50] * 4], np.float32),
        "values": np.array([[1, 1, 1, 2], [3, 2, -50, -50], [-50] * 4], np.float32),
    }


def test_data_metrics_scores_rewards_skip_aborted_rows():
    m = M.compute_data_metrics(_batch(), use_critic=False)
    assert m["critic/score/mean"] == pytest.approx(0.75)
    assert m["critic/score/max"] == pytest.approx(1.0)
    assert m["critic/score/min"] == pytest.approx(0.5)
    assert m["critic/rewards/mean"] == pytest.approx(0.6)
    assert m["critic/rewards/max"] == pytest.approx(0.9)
    assert m["critic/rewards/min"] == pytest.approx(0.3)
    assert m["response/aborted_ratio"] == pytest.approx(1 / 3)


def test_data_metrics_token_stats_use_response_mask():
    m = M.compute_data_metrics(_batch(), use_critic=False)
    assert (m["critic/advantages/mean"], m["critic/advantages/max"],
            m["critic/advantages/min"]) == pytest.approx((3.5, 6.0, 1.0))
    assert (m["critic/returns/mean"], m["critic/returns/max"],
            m["critic/returns/min"]) == pytest.approx((2.0, 3.0, 1.0))
    assert "critic/values/mean" not in m and "critic/vf_explained_var" not in m


def test_data_metrics_values_and_explained_variance_with_critic():
    m = M.compute_data_metrics(_batch(), use_critic=True)
    assert (m["critic/values/mean"], m["critic/values/max"],
            m["critic/values/min"]) == pytest.approx((10 / 6, 3.0, 1.0))
    # valid returns [1,1,2,2,3,3], values [1,1,1,2,3,2]: unbiased var(ret - val) = 4/15,
    # var(ret) = 4/5
    assert m["critic/vf_explained_var"] == pytest.approx(1 - (4 / 15) / (0.8 + 1e-5))


def test_data_metrics_lengths_and_clip_ratios():
    m = M.compute_data_metrics(_batch(), use_critic=False)
    assert (m["response_length/mean"], m["response_length/max"], m["response_length/min"],
            m["response_length/clip_ratio"]) == pytest.approx((2.0, 4.0, 0.0, 1 / 3))
    assert (m["prompt_length/mean"], m["prompt_length/max"], m["prompt_length/min"],
            m["prompt_length/clip_ratio"]) == pytest.approx((2.0, 3.0, 1.0, 1 / 3))


def test_data_metrics_missing_field_names_it():
    batch = _batch()
    del batch["returns"]
    with pytest.raises(KeyError, match="returns"):
        M.compute_data_metrics(batch, use_critic=False)
    with pytest.raises(KeyError, match="values"):
        M.compute_data_metrics({k: v for k, v in _batch().items() if k != "values"},
                               use_critic=True)


def test_timing_metrics_per_token_like_verl():
    m = M.compute_timing_metrics({"gen": 2.0, "update_actor": 3.0, "step": 6.0},
                                 num_prompt_tokens=600, num_response_tokens=400)
    assert m == pytest.approx({
        "timing_s/gen": 2.0, "timing_s/update_actor": 3.0, "timing_s/step": 6.0,
        "timing_per_token_ms/gen": 5.0,  # 2000 ms / 400 response tokens
        "timing_per_token_ms/update_actor": 3.0,  # 3000 ms / 1000 tokens
    })


def test_throughput_metrics():
    m = M.compute_throughput_metrics(total_tokens=1000, step_time_s=2.0, num_devices=4)
    assert m == {"perf/total_num_tokens": 1000, "perf/time_per_step": 2.0,
                 "perf/throughput": 125.0}
    with pytest.raises(ValueError, match="step_time_s"):
        M.compute_throughput_metrics(total_tokens=1, step_time_s=0.0, num_devices=1)


def test_mfu_formula():
    mfu = M.compute_mfu(num_params=10**9, num_layers=2, hidden=4, seq_len=8, tokens=1000,
                        time_s=1.0, num_devices=2, peak_flops_per_device=1e15)
    # (6e9 + 12*2*4*8) * 1000 / (1 * 2 * 1e15)
    assert mfu == pytest.approx(6_000_000_768 * 1000 / 2e15, rel=1e-12)


@pytest.mark.parametrize("kind, expected", [
    ("NVIDIA H100 80GB HBM3", 989e12), ("NVIDIA H200", 989e12), ("NVIDIA A100-SXM4-80GB", 312e12),
    ("TPU v4", 275e12), ("TPU v5 lite", 197e12), ("TPU v5", 459e12), ("TPU v5p", 459e12),
    ("TPU v6 lite", 918e12), ("cpu", 1e12),
])
def test_peak_flops_table(kind, expected):
    assert M.peak_flops(kind, "bfloat16") == expected


def test_peak_flops_unknown_device_or_dtype_raises():
    with pytest.raises(ValueError, match="unknown device kind 'Voodoo 5'"):
        M.peak_flops("Voodoo 5", "bf16")
    with pytest.raises(ValueError, match="dtype 'float32'"):
        M.peak_flops("NVIDIA H100", "float32")


def test_max_memory_allocated_gb(monkeypatch):
    class _Dev:
        def __init__(self, stats):
            self._stats = stats

        def memory_stats(self):
            return self._stats

    monkeypatch.setattr(M._perf.jax, "local_devices", lambda: [_Dev(None)])
    assert M.max_memory_allocated_gb() is None  # CPU: no device stats, so no (zero) metric
    monkeypatch.setattr(M._perf.jax, "local_devices", lambda: [_Dev({})])
    assert M.max_memory_allocated_gb() is None
    monkeypatch.setattr(M._perf.jax, "local_devices",
                        lambda: [_Dev({"peak_bytes_in_use": 3 * 1024**3})])
    assert M.max_memory_allocated_gb() == pytest.approx(3.0)


def test_cpu_memory_used_gb_is_this_process_peak_rss():
    block = np.ones(64 * 1024**2 // 8)  # 64 MiB touched: the peak is at least that
    assert M.cpu_memory_used_gb() >= 64 / 1024
    del block


def test_reduce_metrics_means_per_key():
    out = M.reduce_metrics([{"a": 1.0, "b": np.float32(2.0)}, {"a": 3}, {"a": np.array(5.0)}])
    assert out == {"a": 3.0, "b": 2.0}
