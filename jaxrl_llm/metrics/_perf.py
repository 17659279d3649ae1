"""Timing, throughput, MFU and memory metrics (verl's `timing_s/*`, `perf/*` names).

MFU uses the dense-decoder estimate of MaxText / verl: per token, training costs
`6·N` FLOPs for the parameter matmuls (forward + backward) plus `12·L·H·S` for attention
(QKᵀ and AV, forward + backward, with L layers, hidden H, sequence length S), so

    mfu = (6·N + 12·L·H·S) · tokens / (time_s · num_devices · peak_flops_per_device).

For forward-only passes (log-probs, generation) the true cost is a third of that; callers that
want it should scale `tokens` accordingly.
"""
from __future__ import annotations

from collections.abc import Mapping

import jax

# Peak dense half-precision (bf16 / fp16) FLOP/s per device (per chip for TPUs).
_PEAK_BF16 = (  # (lowercase substring of jax Device.device_kind, flops); first match wins
    ("h200", 989e12),
    ("h100", 989e12),
    ("a100", 312e12),
    ("tpu v4", 275e12),
    ("tpu v5 lite", 197e12),
    ("tpu v5e", 197e12),
    ("tpu v5p", 459e12),
    ("tpu v5", 459e12),  # v5p reports device_kind "TPU v5"
    ("tpu v6 lite", 918e12),
    ("tpu v6e", 918e12),
)
# CPU has no meaningful peak; this nominal 1 TFLOP/s only keeps MFU finite in CPU tests.
_CPU_NOMINAL_FLOPS = 1e12
_HALF_DTYPES = ("bfloat16", "bf16", "float16", "fp16", "half")

# verl normalises generation by response tokens and the other stages by all tokens.
_RESPONSE_TOKEN_STAGES = ("gen",)
_ALL_TOKEN_STAGES = ("ref", "old_log_prob", "values", "adv", "update_critic", "update_actor")


def compute_timing_metrics(timing_s: Mapping[str, float], *, num_prompt_tokens: int,
                           num_response_tokens: int) -> dict[str, float]:
    """`timing_s/<name>` for every stage and `timing_per_token_ms/<name>` for known stages.

    "gen" is divided by response tokens; ref/old_log_prob/values/adv/update_* by prompt +
    response tokens (verl). Stages with zero tokens get no per-token entry.
    """
    overall = num_prompt_tokens + num_response_tokens
    tokens = {**{s: num_response_tokens for s in _RESPONSE_TOKEN_STAGES},
              **{s: overall for s in _ALL_TOKEN_STAGES}}
    out = {f"timing_s/{name}": float(sec) for name, sec in timing_s.items()}
    for name, sec in timing_s.items():
        if tokens.get(name, 0) > 0:
            out[f"timing_per_token_ms/{name}"] = float(sec) * 1000.0 / tokens[name]
    return out


def _check_positive(fn: str, **values: float) -> None:
    for name, value in values.items():
        if not value > 0:
            raise ValueError(f"{fn}: {name} must be > 0, got {value}.")


def compute_throughput_metrics(*, total_tokens: int, step_time_s: float,
                               num_devices: int) -> dict[str, float]:
    """verl's perf metrics; throughput is tokens / second / device."""
    _check_positive("compute_throughput_metrics", step_time_s=step_time_s, num_devices=num_devices)
    return {
        "perf/total_num_tokens": int(total_tokens),
        "perf/time_per_step": float(step_time_s),
        "perf/throughput": total_tokens / (step_time_s * num_devices),
    }


def compute_mfu(*, num_params: int, num_layers: int, hidden: int, seq_len: int, tokens: int,
                time_s: float, num_devices: int, peak_flops_per_device: float) -> float:
    """Model FLOPs utilisation in [0, 1]: `(6N + 12·L·H·S)·tokens / (time·devices·peak)`."""
    _check_positive("compute_mfu", time_s=time_s, num_devices=num_devices,
                    peak_flops_per_device=peak_flops_per_device)
    flops_per_token = 6.0 * num_params + 12.0 * num_layers * hidden * seq_len
    return flops_per_token * tokens / (time_s * num_devices * peak_flops_per_device)


def peak_flops(device_kind: str, dtype: str = "bfloat16") -> float:
    """Peak dense FLOP/s of one device for half-precision matmuls.

    `device_kind` is `jax.devices()[0].device_kind` (e.g. "NVIDIA H100 80GB HBM3", "TPU v4").
    CPU returns a nominal 1e12 that is not meaningful (it only keeps MFU finite in tests).
    """
    if str(dtype).lower() not in _HALF_DTYPES:
        raise ValueError(f"peak_flops: dtype {dtype!r} is not in the table (only {_HALF_DTYPES}); "
                         "pass peak_flops_per_device to compute_mfu yourself.")
    kind = device_kind.lower()
    if kind == "cpu" or kind.startswith("cpu"):
        return _CPU_NOMINAL_FLOPS
    for pattern, flops in _PEAK_BF16:
        if pattern in kind:
            return flops
    known = ", ".join(p for p, _ in _PEAK_BF16)
    raise ValueError(f"peak_flops: unknown device kind {device_kind!r} (known: {known}); "
                     "pass peak_flops_per_device to compute_mfu yourself.")


def max_memory_allocated_gb() -> float | None:
    """Peak memory in use on the first local device, GiB; None where the backend reports none
    (CPU): callers omit the metric there rather than report 0."""
    stats = jax.local_devices()[0].memory_stats() or {}
    if "peak_bytes_in_use" not in stats:
        return None
    return float(stats["peak_bytes_in_use"]) / 1024**3


def cpu_memory_used_gb() -> float:
    """Peak resident memory (RSS) of this process, GiB (verl's `perf/cpu_memory_used_gb`)."""
    import resource
    import sys

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return float(peak) / (1024**3 if sys.platform == "darwin" else 1024**2)
