"""Device time of a residual add and the RMSNorm after it: MLX's two ops against
kiviq's one launch (kernels/add_rms_norm.py), at decode-step shapes.

    python3 benchmarks/add_rms_norm.py --rows 1 32 128 --size 2560 576

The outputs are compared bit for bit before anything is timed. Each call is evaluated
on its own, inside a torch.profiler trace (CUPTI): the figures are device time per call
(every op the call ran, summed), not the host's launch cost. The arms are interleaved,
the first arm rotating, over distinct inputs. CUDA only (needs PyTorch for the trace).
"""

from __future__ import annotations

import argparse
import os
import sys

import mlx.core as mx
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import command, interleaved_device_us, machine, table  # noqa: E402
from kiviq.kernels.add_rms_norm import add_rms_norm, add_rms_norm_reference, supported  # noqa: E402

ARMS = {"stock (add, rms_norm)": add_rms_norm_reference, "kiviq add_rms_norm": add_rms_norm}
DTYPES = {"bf16": mx.bfloat16, "fp16": mx.float16}
EPS = 1e-6


def inputs(rows: int, size: int, dtype, count: int) -> tuple[list, mx.array]:
    """``count`` distinct (x, r) pairs of [rows, 1, size] and one weight, as a decode
    step has them (one token per sequence)."""
    keys = iter(mx.random.split(mx.random.key(rows * 7919 + size), 2 * count + 1))
    pairs = [(mx.random.normal((rows, 1, size), key=next(keys)).astype(dtype),
              (0.5 * mx.random.normal((rows, 1, size), key=next(keys))).astype(dtype)) for _ in range(count)]
    w = mx.random.uniform(0.2, 2.0, (size,), key=next(keys)).astype(dtype)
    mx.eval(pairs, w)
    return pairs, w


def same_bits(pairs, w) -> bool:
    for x, r in pairs:
        got, want = add_rms_norm(x, r, w, EPS), add_rms_norm_reference(x, r, w, EPS)
        for g, e in zip(got, want):
            if not np.array_equal(np.array(g.view(mx.uint16)), np.array(e.view(mx.uint16))):
                return False
    return True


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 32, 128], help="sequences in the decode step")
    p.add_argument("--size", type=int, nargs="+", default=[2560, 576], help="hidden size (2560: Qwen3-4B, 576: SmolLM2-135M)")
    p.add_argument("--dtype", nargs="+", default=["bf16"], choices=sorted(DTYPES))
    p.add_argument("--repeats", type=int, default=7, help="timed blocks per arm")
    p.add_argument("--calls", type=int, default=50, help="calls per timed block")
    a = p.parse_args()
    if mx.default_device() != mx.gpu or not mx.cuda.is_available():
        raise SystemExit("add_rms_norm.py needs MLX's CUDA backend (an NVIDIA GPU): the kernel runs nowhere else")
    print(f"# {command()}\n# {machine()}\n")
    rows_out = []
    for dtype_name in a.dtype:
        dtype = DTYPES[dtype_name]
        for size in a.size:
            if not supported(size, dtype):
                raise SystemExit(f"--size {size}: the kernel takes multiples of 8 up to 8192")
            for rows in a.rows:
                pairs, w = inputs(rows, size, dtype, 4)
                if not same_bits(pairs, w):
                    raise SystemExit(f"{dtype_name} {rows}x{size}: the kernel's bits differ from the stock ops; "
                                     "nothing timed")
                operands = [(x, r, w, EPS) for x, r in pairs]
                for name, (us, ops) in interleaved_device_us(ARMS, operands, a.repeats, a.calls).items():
                    rows_out.append([dtype_name, rows, size, name, f"{ops:g}",
                                     f"{min(us):.2f} / {np.median(us):.2f} / {max(us):.2f}"])
    print(table(["dtype", "rows", "size", "arm", "device ops per call", "device us per call min / median / max"],
                rows_out))
    print("\nbits: the kernel's h and y equal the stock ops' at every shape above")


if __name__ == "__main__":
    main()
