"""Start a worker process: load the model once, then serve until stopped."""

from __future__ import annotations

import logging

from redis import Redis

from kiviq.jobs.settings import redis_url_from_env
from kiviq.worker.metrics import StatsPublisher, WorkerMetrics, serve_metrics
from kiviq.worker.service import BatchWorker

log = logging.getLogger("kiviq.worker")


def run_worker(model: str | None = None, redis_url: str | None = None, *, burst: bool = False,
               max_active: int = 32, name: str | None = None, log_level: str = "INFO",
               kv_bits: int = 4, kv_group_size: int = 32, kv_residual: int = 128, kv_flush_blocks: int = 1,
               kv_memory: int | None = None, compile_decode: bool | None = None, pipeline_decode: bool = True,
               max_queued: int | None = None,
               grace_s: float = 30.0,
               metrics_port: int | None = None, metrics_host: str = "127.0.0.1") -> int:
    """Load ``model`` (default: SmolLM2-135M-Instruct) and serve jobs.

    ``metrics_port``: serve Prometheus metrics on http://127.0.0.1:PORT/metrics
    (0 picks a free port). Metrics are collected (and published to Redis for
    ``kiviq top``) either way.

    Returns:
        The number of jobs that ended.
    """
    logging.basicConfig(level=log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from kiviq.engine import build_engine, load  # heavy: mlx, mlx-lm

    connection = Redis.from_url(redis_url_from_env(redis_url))
    connection.ping()  # fail fast with a clear error before the slow model load
    metrics = WorkerMetrics()
    if metrics_port is not None:  # bind before the slow model load: a taken port fails fast
        serve_metrics(metrics, metrics_port, host=metrics_host)
    log.info("loading model %s", model or "(default SmolLM2-135M-Instruct)")
    lm, tokenizer = load(model)
    engine = build_engine(lm, tokenizer, kv_bits=kv_bits, kv_group_size=kv_group_size,
                          kv_residual=kv_residual, kv_flush_blocks=kv_flush_blocks, kv_memory=kv_memory,
                          max_sequences=max_active, compile_decode=compile_decode, pipeline=pipeline_decode)
    compiled = getattr(getattr(engine, "runner", None), "compiled", None) is not None  # on a GPU by default
    log.info("KV cache: %s", "fp16" if kv_bits == 16 else f"KIVI {kv_bits}-bit, G={kv_group_size}, R={kv_residual}, "
             f"{kv_flush_blocks} block(s) per flush" + (", decode steps compiled" if compiled else "")
             + (", decode steps pipelined" if pipeline_decode else ""))
    worker = BatchWorker(engine, connection, max_active=max_active, name=name, max_queued=max_queued,
                         grace_s=grace_s, metrics=metrics)
    stats = StatsPublisher(connection, worker.name, metrics).start()  # for `kiviq top`
    try:
        return worker.serve(burst=burst, logging_level=log_level)
    finally:
        stats.stop()
