"""A few calls of the dispatched KIVI decode attention on one shape, for a
profiler to attach to (nothing is timed here).

    ncu --clock-control none --kernel-name regex:kivi_attend --launch-skip 4 \
        --launch-count 2 --set full python3 benchmarks/kernel_profile.py --shape 32:8192

Inputs come from benchmarks/kernel_attend.py (H_q 32, H_kv 8, D 128, G 32, R 128,
blocks scattered over the pool). Each bit width is called `--calls` times, so
with the default 3 calls and 2 launches per call, `--launch-skip 4
--launch-count 2` profiles the third call's split kernel and merge.
"""

from __future__ import annotations

import argparse
import os
import sys

import mlx.core as mx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.kernel_attend import kernel_fn, make_input  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="32:8192", help="B:S")
    p.add_argument("--bits", type=int, nargs="+", default=[4, 2])
    p.add_argument("--calls", type=int, default=3)
    p.add_argument("--variant", default="auto", help="a kernel_attend.VARIANT_ENV key")
    args = p.parse_args()
    b, s = (int(v) for v in args.shape.split(":"))
    for bits in args.bits:
        inputs, dense, _, _ = make_input(b, s, bits, seed=0)
        del dense
        for _ in range(args.calls):
            mx.eval(kernel_fn(inputs, bits, args.variant))
        mx.synchronize()
        print(f"B={b} S={s} {bits}-bit: {args.calls} calls done", flush=True)


if __name__ == "__main__":
    main()
