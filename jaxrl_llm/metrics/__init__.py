"""Training metrics: verl-named calculators and a console + jsonl + TensorBoard logger.

Calculators are pure functions over host numpy batches (`compute_data_metrics`, timing,
throughput, MFU); `MetricsLogger` writes what the trainer hands it; `process_validation_metrics` computes verl's val-core/val-aux metrics; `plot_curves` turns a run's
`metrics.jsonl` into a PNG; `JsonReport` and `perfetto_trace` serve
the benchmark scripts. Computing the actor/critic loss metrics is left to `algos`/`workers`.
"""
from jaxrl_llm.metrics._data import compute_data_metrics, reduce_metrics
from jaxrl_llm.metrics._logger import MetricsLogger, read_jsonl
from jaxrl_llm.metrics._perf import (
    compute_mfu,
    compute_throughput_metrics,
    compute_timing_metrics,
    cpu_memory_used_gb,
    max_memory_allocated_gb,
    peak_flops,
)
from jaxrl_llm.metrics._plot import plot_curves
from jaxrl_llm.metrics._report import JsonReport, perfetto_trace
from jaxrl_llm.metrics._validation import bootstrap_metric, process_validation_metrics

__all__ = [
    "JsonReport",
    "MetricsLogger",
    "bootstrap_metric",
    "compute_data_metrics",
    "compute_mfu",
    "compute_throughput_metrics",
    "compute_timing_metrics",
    "cpu_memory_used_gb",
    "max_memory_allocated_gb",
    "peak_flops",
    "perfetto_trace",
    "plot_curves",
    "process_validation_metrics",
    "read_jsonl",
    "reduce_metrics",
]
