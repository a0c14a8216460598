"""``kiviq worker`` (also ``python -m kiviq.worker``): parse the flags, load
the model once, then serve until stopped."""

from __future__ import annotations

import argparse
import os
import re
import sys
import traceback
from urllib.parse import urlsplit

from redis.exceptions import RedisError

from kiviq.jobs.cli_help import HelpFormatter
from kiviq.jobs.settings import DEFAULT_REDIS_URL, redact_url, redis_url_from_env
from kiviq.worker.blas import reexec_with_openblas

# EngineConfig fields -> the flags that set them, so a config error names the flag
CONFIG_FLAGS = {"kv_bits": "--kv-bits", "kv_rotate": "--kv-bits", "kv_group_size": "--kv-group-size", "kv_residual": "--kv-residual",
                "kv_flush_blocks": "--kv-flush-blocks", "kv_memory": "--kv-memory",
                "memory_limit": "--memory-limit",
                "max_sequences": "--max-active", "max_batch_tokens": "--max-batch-tokens",
                "prefill_while_decoding": "--prefill-while-decoding"}


class UsageError(SystemExit):
    """A bad flag value: ``main`` exits with status 2. A SystemExit, so a caller
    of ``engine_config`` that does not catch it still stops with its message."""


def parse_bytes(text: str) -> int:
    """'2GiB', '512MiB', '1e9' -> bytes."""
    units = {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "kb": 10**3, "mb": 10**6, "gb": 10**9, "b": 1}
    t = text.strip().lower()
    try:
        for suffix, factor in units.items():
            if t.endswith(suffix):
                return int(float(t[: -len(suffix)]) * factor)
        return int(float(t))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size: give bytes, e.g. 2GiB, 512MiB or 1e9") from None


def build_parser() -> argparse.ArgumentParser:
    w = argparse.ArgumentParser(prog="kiviq worker", description="Serve generation jobs from Redis with a model.",
                                formatter_class=HelpFormatter)
    w.add_argument("--model", default=None,
                   help="local MLX/HF dir, GGUF file, or HF repo id (default: SmolLM2-135M-Instruct, shipped)")
    w.add_argument("--redis-url", default=None, help=f"Redis to serve (default: $REDIS_URL or {DEFAULT_REDIS_URL})")
    w.add_argument("--max-active", type=int, default=None,
                   help="most sequences in the engine at once (default: on a GPU, as many 4k-token sequences as "
                        "the KV budget holds, 32-128; 32 on a CPU)")
    w.add_argument("--burst", action="store_true", help="exit when the queues are empty")
    w.add_argument("--max-queued", type=int, default=None,
                   help="queue limit in jobs, all priorities, that clients must respect (submit raises QueueFull "
                        "beyond it; default: none)")
    w.add_argument("--grace", type=float, default=30.0,
                   help="on SIGTERM, seconds running sequences may finish before being requeued")
    w.add_argument("--kv-bits", default="4", metavar="{2,2r,4,8,16}",
                   help="KIVI KV-cache bits (16: plain fp16 cache; 2r: 2-bit with K and V Hadamard-rotated, "
                        "much better quality than 2 at the same memory)")
    w.add_argument("--kv-group-size", type=int, default=32, help="KIVI group size G, in tokens")
    w.add_argument("--kv-residual", type=int, default=128, help="KIVI fp16 window R, in tokens (a multiple of G)")
    w.add_argument("--kv-flush-blocks", type=int, default=1,
                   help="KIVI blocks quantized per flush k: a tail flushes at R + k*G tokens, so each "
                        "sequence flushes k times less often (tails hold (k-1)*G more tokens)")
    w.add_argument("--kv-memory", type=parse_bytes, default=None,
                   help="KV store budget in bytes, e.g. 2GiB, 512MiB, 1e9 (default: a quarter of device memory, of "
                        "the worker's share of it under --memory-limit, at most 64GiB)")
    w.add_argument("--memory-limit", type=parse_bytes, default=None,
                   help="device memory this worker may hold, in bytes, e.g. 40GiB: model, KV store, working "
                        "buffers and MLX's cache (default: on a GPU, what is free when it starts, at most MLX's "
                        "80%% of the device; the default KV budget and --max-active shrink with it)")
    w.add_argument("--compile-decode", action=argparse.BooleanOptionalAction, default=None,
                   help="replay decode steps through mx.compile (less host work per step; same tokens; "
                        "default: on where MLX runs on a GPU)")
    w.add_argument("--pipeline-decode", action=argparse.BooleanOptionalAction, default=True,
                   help="build each decode step while the previous one runs on the device (same tokens; "
                        "events one step later; default on)")
    w.add_argument("--max-batch-tokens", type=int, default=None,
                   help="most tokens fed to the model per engine step (decode + prefill chunks; "
                        "default: for the device, e.g. 16384 for a 4B model on an H200, 1024 on a CPU)")
    w.add_argument("--prefill-while-decoding", type=int, default=None, metavar="N",
                   help="prompt tokens an engine step prefills at most while sequences are generating: "
                        "running sequences then wait for at most N prompt tokens per token during a burst of "
                        "long prompts, and the burst prefills in more, smaller steps (default: no cap)")
    w.add_argument("--warm-up", action=argparse.BooleanOptionalAction, default=None,
                   help="before taking jobs, run a short synthetic workload so that the first jobs pay no "
                        "kernel compiles (default: on where MLX runs on a GPU; the log says how long it took)")
    w.add_argument("--dequantize", action=argparse.BooleanOptionalAction, default=None,
                   help="run the model's quantized layers dequantized (default: on a CPU; on a CUDA GPU when "
                        "their float16 weights take at most a quarter of its memory)")
    w.add_argument("--metrics-port", type=int, default=None,
                   help="serve Prometheus metrics on http://HOST:PORT/metrics (0: a free port; "
                        "default: none, not served)")
    w.add_argument("--metrics-host", default="127.0.0.1",
                   help="address the metrics endpoint binds (0.0.0.0 inside a container)")
    w.add_argument("--log-level", default="INFO", type=str.upper, choices=("DEBUG", "INFO", "WARNING", "ERROR"),
                   help="logging level (logs go to stderr)")
    w.add_argument("--debug", action="store_true", default=os.environ.get("KIVIQ_DEBUG") == "1",
                   help="on an error, print the traceback too (default: off, on with KIVIQ_DEBUG=1)")
    return w


def engine_config(args: argparse.Namespace, environ=os.environ):
    """The EngineConfig of the parsed flags. ``KIVIQ_KERNELS=reference`` (the
    debugging escape hatch) runs the plain-ops reference instead of the kernels."""
    from kiviq.engine.config import KV_BITS_NAMES, EngineConfig, parse_kv_bits  # loads mlx: after the re-exec

    kernels = environ.get("KIVIQ_KERNELS", "auto").strip().lower()
    if kernels not in ("auto", "reference", ""):
        raise UsageError(f"KIVIQ_KERNELS must be 'reference' or unset, got {kernels!r}")
    try:
        kv_bits, kv_rotate = parse_kv_bits(args.kv_bits)
    except ValueError:
        raise UsageError(f"--kv-bits {args.kv_bits}: must be one of {', '.join(KV_BITS_NAMES)} "
                         "(2r: 2-bit with K and V Hadamard-rotated)") from None
    try:
        return EngineConfig(
            kv_bits=kv_bits, kv_rotate=kv_rotate, kv_group_size=args.kv_group_size, kv_residual=args.kv_residual,
            kv_flush_blocks=args.kv_flush_blocks, kv_memory=args.kv_memory, memory_limit=args.memory_limit,
            max_sequences=args.max_active,
            max_batch_tokens=args.max_batch_tokens, prefill_while_decoding=args.prefill_while_decoding,
            compile_decode=args.compile_decode,
            pipeline=args.pipeline_decode,
            use_kernel=False if kernels == "reference" else None)
    except ValueError as e:
        words = re.findall(r"\w+", str(e))
        flags = list(dict.fromkeys(CONFIG_FLAGS[w] for w in words if w in CONFIG_FLAGS))  # in the message's order
        raise UsageError(f"{e}" + (f"; set {' / '.join(flags)}" if flags else "")) from e


def check_redis_url(args: argparse.Namespace) -> str:
    """The Redis URL the worker serves; a malformed one is a usage error."""
    url = redis_url_from_env(args.redis_url)
    if urlsplit(url).scheme not in ("redis", "rediss", "unix"):
        source = "--redis-url" if args.redis_url else "$REDIS_URL"
        raise UsageError(f"{source} {url!r}: the URL must start with redis://, rediss:// or unix:// "
                         f"(e.g. redis://{url if '://' not in url else 'localhost:6379'}/0)")
    return url


def main(argv: list[str] | None = None) -> int:
    """Run the worker; an error ends as one line ``kiviq worker: error: ...``
    (exit 2: a bad flag value; 1: a start-up or runtime failure), with the
    traceback before it under ``--debug`` or ``KIVIQ_DEBUG=1``."""
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    redis_url = args.redis_url or ""
    try:
        redis_url = check_redis_url(args)  # before the re-exec and the mlx import: fails in a blink
        reexec_with_openblas(argv)
        from kiviq.worker.main import run_worker  # after the re-exec: loads mlx

        config = engine_config(args)
        run_worker(args.model, redis_url, config=config, burst=args.burst, log_level=args.log_level,
                   dequantize=args.dequantize, cache_dir=os.environ.get("KIVIQ_CACHE_DIR") or None,
                   max_queued=args.max_queued, grace_s=args.grace,
                   metrics_port=args.metrics_port, metrics_host=args.metrics_host, warm_up=args.warm_up)
    except KeyboardInterrupt:
        return 130
    except (UsageError, Exception) as e:  # noqa: BLE001 - every error ends as one line (traceback with --debug)
        if args.debug:
            traceback.print_exc()
        started = sys.modules.get("kiviq.worker.main")  # imported only after the re-exec
        if isinstance(e, UsageError):
            message, status = str(e), 2
        elif started is not None and isinstance(e, started.StartupError):
            message, status = str(e), e.status
        elif isinstance(e, RedisError):  # Redis went away while serving
            message, status = f"Redis at {redact_url(redis_url)}: {type(e).__name__}: {e}", 1
        else:  # a crash while serving may not come back: keep its traceback
            if not args.debug:
                traceback.print_exc()
            message, status = f"{type(e).__name__}: {e}", 1
        print(f"kiviq worker: error: {message}", file=sys.stderr, flush=True)
        return status
    return 0
