"""Device time of an MLP's SwiGLU and down projection for one row (a decode step of one
sequence): MLX's two ops against kiviq's one launch (kernels/swiglu_down.py).

    python3 benchmarks/swiglu_down.py --shape 9728:2560 1536:576 --dtype bf16 fp16

A shape is F:N, the MLP's intermediate and hidden sizes (9728:2560 Qwen3-4B, 1536:576
SmolLM2-135M). The outputs are compared bit for bit before anything is timed. Each call
is evaluated on its own, inside a torch.profiler trace (CUPTI): the figures are device
time per call (every op the call ran, summed), not the host's launch cost. The arms are
interleaved, the first arm rotating, over distinct inputs. What the weights' bytes cost
is the floor: F x N x 2 bytes at the copy bandwidth. CUDA only (needs PyTorch).
"""

from __future__ import annotations

import argparse
import os
import sys

import mlx.core as mx
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import command, interleaved_device_us, machine, table  # noqa: E402
from kiviq.kernels.cuda_device import num_sms  # noqa: E402
from kiviq.kernels.swiglu_down import rows_per_block, supported, swiglu_down, swiglu_down_reference  # noqa: E402

ARMS = {"stock (SwiGLU, gemv)": swiglu_down_reference, "kiviq swiglu_down": swiglu_down}
DTYPES = {"bf16": mx.bfloat16, "fp16": mx.float16}


def shape(text: str) -> tuple[int, int]:
    try:
        hidden, out_size = (int(v) for v in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give F:N, e.g. 9728:2560") from None
    return hidden, out_size


def operands(hidden: int, out_size: int, dtype, count: int) -> list[tuple[mx.array, mx.array]]:
    """``count`` distinct gate/up rows [1, 1, 2F], each with the one weight [N, F]."""
    keys = iter(mx.random.split(mx.random.key(hidden * 7919 + out_size), count + 1))
    weight = (mx.random.normal((out_size, hidden), key=next(keys)) / hidden ** 0.5).astype(dtype)
    rows = [(2.0 * mx.random.normal((1, 1, 2 * hidden), key=next(keys))).astype(dtype) for _ in range(count)]
    mx.eval(weight, rows)
    return [(gate_up, weight) for gate_up in rows]


def same_bits(pairs) -> bool:
    return all(np.array_equal(np.array(swiglu_down(*p).view(mx.uint16)),
                              np.array(swiglu_down_reference(*p).view(mx.uint16))) for p in pairs)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", type=shape, nargs="+", default=[(9728, 2560), (1536, 576)],
                   help="F:N, the MLP's intermediate and hidden sizes")
    p.add_argument("--dtype", nargs="+", default=["bf16"], choices=sorted(DTYPES))
    p.add_argument("--repeats", type=int, default=7, help="timed blocks per arm")
    p.add_argument("--calls", type=int, default=50, help="calls per timed block")
    a = p.parse_args()
    if mx.default_device() != mx.gpu or not mx.cuda.is_available():
        raise SystemExit("swiglu_down.py needs MLX's CUDA backend (an NVIDIA GPU): the kernel runs nowhere else")
    print(f"# {command()}\n# {machine()}, {num_sms()} SMs\n")
    rows_out = []
    for dtype_name in a.dtype:
        dtype = DTYPES[dtype_name]
        for hidden, out_size in a.shape:
            if not supported(hidden, dtype):
                raise SystemExit(f"--shape {hidden}:{out_size}: the kernel's SwiGLU row must fit 48 KB of "
                                 "shared memory")
            pairs = operands(hidden, out_size, dtype, 4)
            if not same_bits(pairs):
                raise SystemExit(f"{dtype_name} {hidden}:{out_size}: the kernel's bits differ from the stock ops; "
                                 "nothing timed")
            rows = rows_per_block(out_size, num_sms())
            for name, (us, ops) in interleaved_device_us(ARMS, pairs, a.repeats, a.calls).items():
                rows_out.append([dtype_name, f"{hidden}:{out_size}", rows, name, f"{ops:g}",
                                 f"{min(us):.2f} / {np.median(us):.2f} / {max(us):.2f}"])
    print(table(["dtype", "F:N", "kiviq's rows per block", "arm", "device ops per call", "device us per call min / median / max"],
                rows_out))
    print("\nbits: the kernel's output equals the stock ops' at every shape above")


if __name__ == "__main__":
    main()
