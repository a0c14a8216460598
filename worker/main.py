"""Start a worker process: load the model once, then serve until stopped."""

from __future__ import annotations

import logging

from redis import Redis
from redis.exceptions import RedisError

from kiviq.jobs.settings import redact_url, redis_url_from_env
from kiviq.worker.device_metrics import add_device_memory
from kiviq.worker.metrics import WorkerMetrics
from kiviq.worker.metrics_http import serve_metrics
from kiviq.worker.service import BatchWorker
from kiviq.worker.stats import StatsPublisher

log = logging.getLogger("kiviq.worker")


OUT_OF_MEMORY_ADVICE = ("another process may be holding this GPU's memory (free it), or lower --kv-memory "
                        "or --max-batch-tokens")


def out_of_memory(e: BaseException) -> bool:
    """Whether ``e`` is a failed device allocation (CUDA: "cudaMallocAsync(...) failed:
    out of memory"; Metal: "Insufficient Memory")."""
    text = str(e).lower().replace(" ", "")
    return "outofmemory" in text or "insufficientmemory" in text


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.1f} GiB"


class StartupError(RuntimeError):
    """The worker cannot start; the message says why and what to do.
    ``status``: 2 for a bad flag value (``--model``), 1 otherwise."""

    def __init__(self, message: str, status: int = 1):
        super().__init__(message)
        self.status = status


def run_worker(model: str | None = None, redis_url: str | None = None, *, config=None, burst: bool = False,
               name: str | None = None, log_level: str = "INFO", dequantize: bool | None = None,
               cache_dir: str | None = None, max_queued: int | None = None, grace_s: float = 30.0,
               metrics_port: int | None = None, metrics_host: str = "127.0.0.1",
               warm_up: bool | None = None) -> int:
    """Load ``model`` (default: SmolLM2-135M-Instruct) and serve jobs.

    ``config``: the engine's EngineConfig (worker/cli.py builds it from the flags;
    default: EngineConfig()); its ``max_sequences`` is the worker's ``--max-active``
    (None: chosen for the device, ``engine.setup.default_max_sequences``).
    ``dequantize``, ``cache_dir``: as in ``engine.load``.

    ``warm_up``: before taking jobs, run a short synthetic workload so the first
    jobs pay no kernel compiles (engine.warmup; None: where MLX runs on a GPU).

    ``metrics_port``: serve Prometheus metrics on http://127.0.0.1:PORT/metrics
    (0 picks a free port). Metrics are collected (and published to Redis for
    ``kiviq top``) either way.

    Returns:
        The number of jobs that ended.

    Raises:
        StartupError: Redis does not answer, the metrics port is taken, the
            model cannot be loaded, the KV flags do not fit it, or the device's
            memory does not hold the KV store or the warm-up's steps.
    """
    logging.basicConfig(level=log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from kiviq.engine import build_engine, load  # heavy: mlx, mlx-lm
    from kiviq.engine.config import EngineConfig
    from kiviq.engine.model_loading import weights_summary

    config = config if config is not None else EngineConfig()

    url = redis_url_from_env(redis_url)
    connection = Redis.from_url(url)
    try:
        connection.ping()  # fail fast with a clear error before the slow model load
    except RedisError as e:
        raise StartupError(f"cannot reach Redis at {redact_url(url)}: {str(e).rstrip('.')}; "
                           "start one or pass --redis-url") from e
    metrics = WorkerMetrics(model_name=model or "SmolLM2-135M-Instruct")
    add_device_memory(metrics)
    if metrics_port is not None:  # bind before the slow model load: a taken port fails fast
        try:
            serve_metrics(metrics, metrics_port, host=metrics_host)
        except OSError as e:
            raise StartupError(f"--metrics-port {metrics_port} on {metrics_host}: {e.strerror or e}; "
                               "pick another port (0: a free one)") from e
    log.info("loading model %s", model or "(default SmolLM2-135M-Instruct)")
    try:
        lm, tokenizer = load(model, dequantize=dequantize, cache_dir=cache_dir)
    except (FileNotFoundError, ValueError) as e:  # the path is wrong, or not a model
        raise StartupError(f"--model: {e}; give a local MLX/HF model dir, a GGUF file or a HF repo id",
                           status=2) from e
    except RuntimeError as e:  # a repo id that would not load: network, or no such repo
        raise StartupError(f"--model: {e}") from e
    log.info("model weights: %s", weights_summary(lm))
    try:
        engine = build_engine(lm, tokenizer, config)
    except ValueError as e:  # the flags do not fit this model: G or 2r vs its head_dim, the KV budget
        raise StartupError(f"{e}; check --kv-bits / --kv-group-size / --kv-memory for this model", status=2) from e
    except RuntimeError as e:
        if not out_of_memory(e):
            raise
        from kiviq.engine.device_memory import default_kv_memory

        budget = (f"--kv-memory {_gib(config.kv_memory)}" if config.kv_memory is not None
                  else f"{_gib(default_kv_memory())}, the default for this device (--kv-memory)")
        raise StartupError(f"out of device memory setting up the engine (its KV store: {budget}): "
                           f"{OUT_OF_MEMORY_ADVICE}") from e
    c = getattr(engine, "config", None) or config  # the serial engine keeps none
    compiled = getattr(getattr(engine, "runner", None), "compiled", None) is not None  # on a GPU by default
    rotated = " with K and V Hadamard-rotated (2r)" if c.kv_rotate else ""
    log.info("KV cache: %s", "fp16" if c.kv_bits == 16 else
             f"KIVI {c.kv_bits}-bit{rotated}, G={c.kv_group_size}, R={c.kv_residual}, {c.kv_flush_blocks} block(s) per flush, "
             + ("reference attention" if c.use_kernel is False else "kernels where they run")
             + (", decode steps compiled" if compiled else "") + (", decode steps pipelined" if c.pipeline else "")
             + (f", {c.max_batch_tokens} tokens per step" if c.max_batch_tokens else "")
             + (f" ({c.prefill_while_decoding} prompt tokens at most while generating)"
                if c.prefill_while_decoding else ""))
    if c.memory_limit and hasattr(engine, "kv_store"):
        log.info("device memory: at most %s for this worker (MLX's limit; --memory-limit), %s of it for the KV store",
                 _gib(c.memory_limit), _gib(engine.kv_store.budget_bytes()))
    import mlx.core as mx  # loaded with the engine

    if warm_up is None:
        warm_up = mx.default_device() == mx.gpu
    if warm_up and hasattr(engine, "kv_store"):  # the batching engine (the serial one compiles nothing)
        from kiviq.engine.warmup import warm_up as run_warm_up

        log.info("warming up (compiling kernels before taking jobs)")
        try:
            took = run_warm_up(engine, lm.args.vocab_size)
            # The warm-up's steps are the largest the worker runs: its peak is what the worker needs.
            log.info("warm-up took %.1f s; MLX's arrays peaked at %s (limit %s)", took,
                     _gib(mx.get_peak_memory()), _gib(mx.get_memory_limit()))
        except RuntimeError as e:
            if not out_of_memory(e):
                raise
            raise StartupError(f"out of device memory in the warm-up (steps of up to {c.max_batch_tokens} tokens, "
                               f"--max-batch-tokens; a KV store of {_gib(engine.kv_store.budget_bytes())}): "
                               f"{OUT_OF_MEMORY_ADVICE}") from e
    # The engine's config has --max-active resolved (engine.setup.default_max_sequences);
    # the serial engine keeps none and holds its own capacity.
    max_active = c.max_sequences if c.max_sequences is not None else engine.capacity
    log.info("at most %d sequences at once", max_active)
    worker = BatchWorker(engine, connection, max_active=max_active, name=name, max_queued=max_queued,
                         grace_s=grace_s, metrics=metrics)
    stats = StatsPublisher(connection, worker.name, metrics).start()  # for `kiviq top`
    try:
        return worker.serve(burst=burst, logging_level=log_level)
    finally:
        stats.stop()

