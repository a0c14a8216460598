"""The device memory MLX holds in the worker, as one gauge family read at each
scrape: ``kiviq:device_memory_bytes{kind}``. Against ``limit`` (MLX's memory limit,
``--memory-limit``) the other kinds say how close the worker runs to an
out-of-memory error, and ``peak`` what its largest steps needed."""

from __future__ import annotations

from typing import Any

from prometheus_client import Gauge

from kiviq.worker.metrics import PREFIX, WorkerMetrics

# kind -> the mlx.core function that reads it (each takes MLX's allocator lock:
# safe from the metrics server's thread while the engine's thread evaluates)
KINDS = {"active": "get_active_memory", "cache": "get_cache_memory", "peak": "get_peak_memory",
         "limit": "get_memory_limit"}


def add_device_memory(metrics: WorkerMetrics, mx: Any = None) -> None:
    """Add the gauge family to ``metrics``' registry (``mx``: mlx.core, or a stand-in)."""
    if mx is None:
        import mlx.core as mx
    gauge = Gauge(PREFIX + "device_memory_bytes",
                  "Device memory MLX holds in this worker, by kind: active (its arrays: model, KV store, a "
                  "step's buffers), cache (freed buffers MLX keeps for reuse), peak (the most active since "
                  "the worker started), limit (MLX's memory limit: --memory-limit).",
                  ("model_name", "kind"), registry=metrics.registry)
    for kind, name in KINDS.items():
        gauge.labels(metrics.model_name, kind).set_function(getattr(mx, name))
