"""``kiviq worker`` (also ``python -m kiviq.worker``): parse the flags, load
the model once, then serve until stopped."""

from __future__ import annotations

import argparse
import os
import sys

from kiviq.worker.blas import reexec_with_openblas


def parse_bytes(text: str) -> int:
    """'2GiB', '512MiB', '1e9' -> bytes."""
    units = {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "kb": 10**3, "mb": 10**6, "gb": 10**9, "b": 1}
    t = text.strip().lower()
    for suffix, factor in units.items():
        if t.endswith(suffix):
            return int(float(t[: -len(suffix)]) * factor)
    return int(float(t))


def build_parser() -> argparse.ArgumentParser:
    w = argparse.ArgumentParser(prog="kiviq worker", description="Serve generation jobs from Redis with a model.")
    w.add_argument("--model", default=None, help="local MLX/HF dir, GGUF file, or HF repo id (default: SmolLM2)")
    w.add_argument("--redis-url", default=None, help="default: $REDIS_URL or redis://127.0.0.1:6379/0")
    w.add_argument("--max-active", type=int, default=32, help="most sequences in the engine at once")
    w.add_argument("--burst", action="store_true", help="exit when the queues are empty")
    w.add_argument("--max-queued", type=int, default=None,
                   help="queue limit clients must respect (submit raises QueueFull beyond it)")
    w.add_argument("--grace", type=float, default=30.0,
                   help="on SIGTERM, seconds running sequences may finish before being requeued")
    w.add_argument("--kv-bits", type=int, choices=(2, 4, 8, 16), default=4,
                   help="KIVI KV-cache bits (16: plain fp16 cache)")
    w.add_argument("--kv-group-size", type=int, default=32, help="KIVI group size G")
    w.add_argument("--kv-residual", type=int, default=128, help="KIVI fp16 window R (multiple of G)")
    w.add_argument("--kv-flush-blocks", type=int, default=1,
                   help="KIVI blocks quantized per flush k: a tail flushes at R + k*G tokens, so each "
                        "sequence flushes k times less often (tails hold (k-1)*G more tokens)")
    w.add_argument("--kv-memory", type=parse_bytes, default=None,
                   help="KV store budget, e.g. 2GiB (default: a quarter of device memory)")
    w.add_argument("--compile-decode", action=argparse.BooleanOptionalAction, default=None,
                   help="replay decode steps through mx.compile (less host work per step; same tokens; "
                        "default: on where MLX runs on a GPU)")
    w.add_argument("--pipeline-decode", action=argparse.BooleanOptionalAction, default=True,
                   help="build each decode step while the previous one runs on the device (same tokens; "
                        "events one step later; default on)")
    w.add_argument("--max-batch-tokens", type=int, default=1024,
                   help="tokens fed to the model per engine step (decode + prefill chunks)")
    w.add_argument("--dequantize", action=argparse.BooleanOptionalAction, default=None,
                   help="dequantize the model's quantized layers to float32 (default: only on CPU)")
    w.add_argument("--metrics-port", type=int, default=None,
                   help="serve Prometheus metrics on http://HOST:PORT/metrics (0: a free port)")
    w.add_argument("--metrics-host", default="127.0.0.1",
                   help="address the metrics endpoint binds (0.0.0.0 inside a container)")
    w.add_argument("--log-level", default="INFO")
    return w


def engine_config(args: argparse.Namespace, environ=os.environ):
    """The EngineConfig of the parsed flags. ``KIVIQ_KERNELS=reference`` (the
    debugging escape hatch) runs the plain-ops reference instead of the kernels."""
    from kiviq.engine.config import EngineConfig  # loads mlx: after the re-exec

    kernels = environ.get("KIVIQ_KERNELS", "auto").strip().lower()
    if kernels not in ("auto", "reference", ""):
        raise SystemExit(f"KIVIQ_KERNELS must be 'reference' or unset, got {kernels!r}")
    try:
        return EngineConfig(
            kv_bits=args.kv_bits, kv_group_size=args.kv_group_size, kv_residual=args.kv_residual,
            kv_flush_blocks=args.kv_flush_blocks, kv_memory=args.kv_memory, max_sequences=args.max_active,
            max_batch_tokens=args.max_batch_tokens, compile_decode=args.compile_decode,
            pipeline=args.pipeline_decode,
            use_kernel=False if kernels == "reference" else None)
    except ValueError as e:
        raise SystemExit(f"kiviq worker: {e}") from e


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    reexec_with_openblas(argv)
    from kiviq.worker.main import run_worker  # after the re-exec: loads mlx

    config = engine_config(args)
    try:
        run_worker(args.model, args.redis_url, config=config, burst=args.burst, log_level=args.log_level,
                   dequantize=args.dequantize, cache_dir=os.environ.get("KIVIQ_CACHE_DIR") or None,
                   max_queued=args.max_queued, grace_s=args.grace,
                   metrics_port=args.metrics_port, metrics_host=args.metrics_host)
    except KeyboardInterrupt:
        return 130
    return 0
