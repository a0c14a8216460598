"""What a new attention shape costs: MLX's fused causal attention timed at its first
call for a shape and at the calls after it.

On a GPU MLX builds a cuDNN graph for every attention shape it meets (and keeps the
last 256), on the host, while the device waits; a prefill of a new (rows, length)
shape pays for it once per process. That is why the engine runs prefill attention on
shapes from a small set (engine.model_runner, kivi_cache.causal_attention). Each
``--shapes`` entry is ``rows:length`` (a group of first chunks, attending to
themselves) or ``rows:length:keys`` (a later chunk of ``length`` tokens over
``keys`` keys, its past included); every call is timed with ``mx.synchronize()`` at
its edges, on random inputs made beforehand.

    python3 benchmarks/attention_shapes.py
    python3 benchmarks/attention_shapes.py --shapes 12:1344 16:1344 1:845:1300 --heads 32 --kv-heads 8
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402

from benchmarks.common import command, machine, table  # noqa: E402

# Groups of ~1,200-token prompts as a 16k-token prefill step packs them, then later
# chunks of such prompts over their pasts.
SHAPES = ["12:1344", "16:1344", "9:1344", "2:1152", "13:1216", "1:1088", "1:512",
          "1:219:1200", "1:845:1300", "1:91:1250", "1:256:1280", "1:256:1536"]


def timed(fn) -> float:
    mx.synchronize()
    start = time.perf_counter()
    mx.eval(fn())
    mx.synchronize()
    return (time.perf_counter() - start) * 1e3


def shape_times(spec: str, args, dtype) -> list[float]:
    """ms of each of ``args.calls`` calls at one ``rows:length[:keys]`` shape."""
    b, length, *keys = (int(x) for x in spec.split(":"))
    keys = keys[0] if keys else length
    if keys < length:
        raise SystemExit(f"{spec}: a chunk attends to at least its own {length} keys")
    q = mx.random.normal((b, args.heads, length, args.head_dim)).astype(dtype)
    k = mx.random.normal((b, args.kv_heads, keys, args.head_dim)).astype(dtype)
    v = mx.random.normal((b, args.kv_heads, keys, args.head_dim)).astype(dtype)
    mx.eval(q, k, v)
    return [timed(lambda: mx.fast.scaled_dot_product_attention(q, k, v, scale=args.head_dim ** -0.5,
                                                                mask="causal"))
            for _ in range(args.calls)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", nargs="+", default=SHAPES, help="rows:length or rows:length:keys")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8, dest="kv_heads")
    p.add_argument("--head-dim", type=int, default=128, dest="head_dim")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--calls", type=int, default=3, help="calls per shape (the first meets it new)")
    args = p.parse_args()
    print(f"# {command()}\n# {machine()}\n")
    dtype = getattr(mx, args.dtype)
    shape_times("1:64", args, dtype)  # untimed: pays MLX's and cuDNN's start-up
    rows = []
    for spec in args.shapes:
        times = shape_times(spec, args, dtype)
        rows.append([spec, f"{times[0]:.1f}", " / ".join(f"{t:.1f}" for t in times[1:])])
        print(f"{spec}: first call {times[0]:.1f} ms", file=sys.stderr, flush=True)  # progress
    print(table(["rows:length[:keys]", "first call ms", "later calls ms"], rows))


if __name__ == "__main__":
    main()
