"""Offline instruction count of the MMA split kernel's block loop (no GPU needed).

Compiles `kivi_attend_split_mma` as MLX would (the translation unit of
`kernels.cuda_source.translation_unit`, nvcc for sm_90a, no register limit unless
`--maxrregcount`), disassembles it with cuobjdump and counts the SASS instructions of
the block loop: from the target of the backward branch after the last HMMA to that
branch, i.e. one (block, kv head) tile per trip. A static count (the rare rescale
branch included), the measure of the issue-bound part of a tile.

    python3 benchmarks/kernel_sass.py --bits 4 2 --fold 0 1

Needs nvcc (CUDA 12.4+) and cuobjdump: `pip install nvidia-cuda-cuobjdump` puts one
under site-packages/nvidia/cu13/bin, found automatically, or give --cuobjdump.
"""

from __future__ import annotations

import argparse
import collections
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile

import mlx.core as mx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kiviq.kernels import kivi_cuda  # noqa: E402
from kiviq.kernels.cuda_source import compact, kernel_header, translation_unit  # noqa: E402

DTYPES = {"fp16": mx.float16, "bf16": mx.bfloat16}
_ADDR = re.compile(r"/\*([0-9a-f]{4,})\*/")
_OP = re.compile(r"\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)")


def find_cuobjdump() -> str:
    found = shutil.which("cuobjdump")
    if found:
        return found
    for site in sys.path:
        hits = glob.glob(os.path.join(site, "nvidia", "cu*", "bin", "cuobjdump"))
        if hits:
            return hits[0]
    sys.exit("cuobjdump not found: pip install nvidia-cuda-cuobjdump, or pass --cuobjdump")


def split_mma_unit(sd, bits: int, d: int, rep: int, fold: int) -> str:
    """The MMA split kernel's translation unit for one template (q in the pool dtype)."""
    dtypes = {"q": sd, "k_codes": mx.uint8, "v_codes": mx.uint8, "qscale_in": mx.float32,
              **dict.fromkeys(("block_tables", "num_blocks", "slots", "tail_lens", "params"), mx.int32)}
    inputs = [(n, dtypes.get(n, sd)) for n in kivi_cuda.ATTEND_INPUTS]
    outputs = [(n, mx.float32) for n in kivi_cuda.ATTEND_OUTPUTS]
    template = [("T", sd), ("SD", sd), ("D", d), ("G", 32), ("BITS", bits), ("REP", rep),
                ("NW", kivi_cuda.WARPS), ("FOLD", fold)]
    source = kivi_cuda.ATTEND_MMA_SOURCE
    return translation_unit("kivi_attend_split_mma", kernel_header(kivi_cuda.HEADER, source),
                            compact(source), inputs, outputs, template)


def block_loop(sass: str) -> collections.Counter:
    """Opcode counts of the block loop (see the module docstring)."""
    lines = [ln for ln in sass.splitlines() if _ADDR.search(ln) and _OP.search(ln)]
    addr = [int(_ADDR.search(ln).group(1), 16) for ln in lines]
    mma = [i for i, ln in enumerate(lines) if "HMMA" in ln]
    if not mma:
        raise SystemExit("no HMMA in the kernel")
    for i in range(mma[-1], len(lines)):
        m = re.search(r"BRA\s+(?:`?\(?\.L_x_\d+\)?`?\s*)?(0x[0-9a-f]+)", lines[i])
        if m and int(m.group(1), 16) <= addr[mma[0]]:
            lo, hi = int(m.group(1), 16), addr[i]
            return collections.Counter(_OP.search(ln).group(1) for ln, a in zip(lines, addr) if lo <= a <= hi)
    raise SystemExit("no backward branch after the last HMMA")


def compile_and_count(unit: str, cuobjdump: str, maxrreg: int | None) -> tuple[int, collections.Counter]:
    with tempfile.TemporaryDirectory() as tmp:
        cu, cubin = os.path.join(tmp, "k.cu"), os.path.join(tmp, "k.cubin")
        with open(cu, "w") as f:
            f.write(unit)
        cmd = ["nvcc", "-arch=sm_90a", "-cubin", "-std=c++17", "-o", cubin, cu]
        if maxrreg:
            cmd.insert(1, f"-maxrregcount={maxrreg}")
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode:
            raise SystemExit(r.stderr[-3000:])
        res = subprocess.run([cuobjdump, "-res-usage", cubin], capture_output=True, text=True, check=True).stdout
        sass = subprocess.run([cuobjdump, "-sass", cubin], capture_output=True, text=True, check=True).stdout
    return int(re.search(r"REG:(\d+)", res).group(1)), block_loop(sass)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", nargs="+", default=["fp16", "bf16"], choices=sorted(DTYPES))
    p.add_argument("--bits", type=int, nargs="+", default=[4, 2])
    p.add_argument("--fold", type=int, nargs="+", default=[0, 1], help="FOLD template values (fp16 only)")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--rep", type=int, default=4, help="query heads per kv head")
    p.add_argument("--maxrregcount", type=int, default=None)
    p.add_argument("--cuobjdump", default=None)
    a = p.parse_args()
    if shutil.which("nvcc") is None:
        sys.exit("nvcc not found")
    cuobjdump = a.cuobjdump or find_cuobjdump()
    ops = ("LOP3", "HADD2", "HFMA2", "HMUL2", "HMMA", "LDS", "PRMT", "FMUL", "FFMA")
    print(f"D={a.head_dim}, REP={a.rep}, sm_90a, maxrregcount {a.maxrregcount or 'none'}")
    print("| dtype | bits | FOLD | registers | block-loop instructions | " + " | ".join(ops) + " |")
    print("|---|---|---|---|---|" + "---|" * len(ops))
    for name in a.dtype:
        for bits in a.bits:
            for fold in a.fold:
                if fold and name != "fp16":
                    continue  # FOLD is an fp16 path (the kernel asserts it)
                unit = split_mma_unit(DTYPES[name], bits, a.head_dim, a.rep, fold)
                regs, loop = compile_and_count(unit, cuobjdump, a.maxrregcount)
                print(f"| {name} | {bits} | {fold} | {regs} | {sum(loop.values())} | "
                      + " | ".join(str(loop.get(o, 0)) for o in ops) + " |", flush=True)


if __name__ == "__main__":
    main()
