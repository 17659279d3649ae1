"""Training metrics: verl-named calculators and a console + jsonl + TensorBoard logger.

Calculators are pure functions over host numpy batches (`compute_data_metrics`, timing,
throughput, MFU); `MetricsLogger` writes what the trainer hands it; `plot_curves` turns a run's
`metrics.jsonl` into a PNG; `JsonReport` and `perfetto_trace` serve
the benchmark scripts. Computing the actor/critic loss metrics is left to `algos`/`workers`.
"""
from jaxrl_llm.metrics._data import compute_data_metrics, reduce_metrics
from jaxrl_llm.metrics._logger import MetricsLogger, read_jsonl
from jaxrl_llm.metrics._perf import (
    compute_mfu,
    compute_throughput_metrics,
    compute_timing_metrics,
    max_memory_allocated_gb,
    peak_flops,
)
from jaxrl_llm.metrics._plot import plot_curves
from jaxrl_llm.metrics._report import JsonReport, perfetto_trace

__all__ = [
    "JsonReport",
    "MetricsLogger",
    "compute_data_metrics",
    "compute_mfu",
    "compute_throughput_metrics",
    "compute_timing_metrics",
    "max_memory_allocated_gb",
    "peak_flops",
    "perfetto_trace",
    "plot_curves",
    "read_jsonl",
    "reduce_metrics",
]
