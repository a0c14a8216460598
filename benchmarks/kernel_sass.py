"""Offline instruction count of the MMA split kernel's block loop (no GPU needed).

Compiles `kivi_attend_split_mma` as MLX would (`kernels.cuda_offline`: nvcc for
sm_90a, no register limit unless `--maxrregcount`), disassembles it with cuobjdump and
counts the SASS instructions of the block loop (one (block, kv head) tile per trip).

    python3 benchmarks/kernel_sass.py --dtype fp16 bf16 --bits 4 2 [--prologue]

`--prologue`: the kernel as an engine's decode step runs it, the decode prologue
inside (q/k norms and the 2r rotation compiled in); without it, as a caller that
gives q runs it (`kernels.cuda_attend.kivi_decode_attend`, `kernel_attend.py`).

Needs nvcc (CUDA 12.4+) and cuobjdump: `pip install nvidia-cuda-cuobjdump` puts one
under site-packages/nvidia/cu13/bin, found automatically, or give --cuobjdump.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys

import mlx.core as mx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kiviq.kernels.cuda_offline import compile_and_count, find_cuobjdump, split_mma_unit  # noqa: E402

DTYPES = {"fp16": mx.float16, "bf16": mx.bfloat16}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", nargs="+", default=["fp16", "bf16"], choices=sorted(DTYPES))
    p.add_argument("--bits", type=int, nargs="+", default=[4, 2])
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--rep", type=int, default=4, help="query heads per kv head")
    p.add_argument("--maxrregcount", type=int, default=None)
    p.add_argument("--min-blocks", type=int, nargs="+", default=[0], dest="min_blocks",
                   help="__launch_bounds__ blocks per SM to compile for, one row each (0: no bounds)")
    p.add_argument("--prologue", action="store_true", help="compile the decode prologue in (PRO = 1)")
    p.add_argument("--cuobjdump", default=None)
    p.add_argument("--dump", default=None, metavar="DIR",
                   help="write each row's block-loop SASS to DIR/<dtype>-<bits>-<blocks>.sass")
    a = p.parse_args()
    if a.dump:
        os.makedirs(a.dump, exist_ok=True)
    if shutil.which("nvcc") is None:
        sys.exit("nvcc not found")
    cuobjdump = a.cuobjdump or find_cuobjdump()
    if cuobjdump is None:
        sys.exit("cuobjdump not found: pip install nvidia-cuda-cuobjdump, or pass --cuobjdump")
    ops = ("LOP3", "SHF", "HADD2", "HFMA2", "HMUL2", "HMMA", "LDS", "PRMT", "FMUL", "FFMA", "LDL", "STL")
    print(f"D={a.head_dim}, REP={a.rep}, sm_90a, maxrregcount {a.maxrregcount or 'none'}, "
          f"prologue {'in' if a.prologue else 'out'}")
    print("| dtype | bits | blocks per SM bound | registers | block-loop instructions | " + " | ".join(ops) + " |")
    print("|---|---|---|---|---|" + "---|" * len(ops))
    for name in a.dtype:
        for bits in a.bits:
            for blocks in a.min_blocks:
                unit = split_mma_unit(DTYPES[name], bits, a.head_dim, a.rep, blocks or None, prologue=a.prologue)
                dump = os.path.join(a.dump, f"{name}-{bits}-{blocks}.sass") if a.dump else None
                regs, loop = compile_and_count(unit, cuobjdump, a.maxrregcount, dump)
                print(f"| {name} | {bits} | {blocks or '-'} | {regs} | {sum(loop.values())} | "
                      + " | ".join(str(loop.get(o, 0)) for o in ops) + " |", flush=True)


if __name__ == "__main__":
    main()
