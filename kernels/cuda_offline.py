"""The CUDA kernels compiled offline with nvcc, as MLX would compile them (no GPU needed).

`translation_unit` (kernels.cuda_source) writes the file MLX's `cuda_kernel` compiles
for one kernel instance; this module compiles such files (nvcc for sm_90a), to PTX for
comparing two texts of a kernel, or to a cubin whose SASS cuobjdump disassembles, to
count the instructions of the MMA split kernel's block loop: the shortest range from a
backward branch's target to that branch that holds an HMMA, i.e. one (block, kv head)
tile per trip. A static count (the rare rescale branch included), the measure of the
issue-bound part of a tile.
"""

from __future__ import annotations

import collections
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile

import mlx.core as mx

from kiviq.kernels.cuda_attend import ATTEND_INPUTS, ATTEND_OUTPUTS
from kiviq.kernels.cuda_source import HEADER, compact, kernel_header, launch_bounds, read, translation_unit
from kiviq.kernels.launch import WARPS

ARCH = "sm_90a"
_ADDR = re.compile(r"/\*([0-9a-f]{4,})\*/")
_OP = re.compile(r"\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)")


def find_cuobjdump() -> str | None:
    """cuobjdump on PATH, else the one `pip install nvidia-cuda-cuobjdump` puts under
    site-packages/nvidia/cu*/bin; None if neither exists."""
    found = shutil.which("cuobjdump")
    if found:
        return found
    for site in sys.path:
        hits = glob.glob(os.path.join(site, "nvidia", "cu*", "bin", "cuobjdump"))
        if hits:
            return hits[0]
    return None


def split_mma_unit(sd, bits: int, d: int, rep: int, min_blocks: int | None = None, *,
                   prologue: bool = False) -> str:
    """The MMA split kernel's translation unit for one template (q in the pool dtype);
    with `min_blocks`, under `__launch_bounds__(WARPS * 32, min_blocks)` (`launch_bounds`);
    with `prologue`, the decode prologue in it (PRO = 1, q/k norms and the rotation)."""
    dtypes = {"q": sd, "k_codes": mx.uint8, "v_codes": mx.uint8, "qscale_in": mx.float32, "rope": mx.float32,
              **dict.fromkeys(("block_tables", "num_blocks", "slots", "tail_lens", "params", "offsets"),
                              mx.int32)}
    inputs = [(n, dtypes.get(n, sd)) for n in ATTEND_INPUTS]
    outputs = [(n, mx.float32) for n in ATTEND_OUTPUTS]
    template = [("T", sd), ("SD", sd), ("D", d), ("G", 32), ("BITS", bits), ("REP", rep),
                ("NW", WARPS), ("PRO", int(prologue)), ("NORM", int(prologue)), ("ROT_IN", int(prologue))]
    source = read("cuda/attend_split_mma.cu")
    header = kernel_header(HEADER, source) + (launch_bounds(WARPS * 32, min_blocks) if min_blocks else "")
    return translation_unit("kivi_attend_split_mma", header, compact(source), inputs, outputs, template)


def nvcc(unit: str, out_kind: str, out_dir: str, tag: str = "k", extra: tuple = ()) -> str:
    """Compile `unit` with nvcc to `out_kind` ("ptx" or "cubin") in out_dir; returns the
    output's path. Raises RuntimeError with nvcc's message if it fails."""
    cu, out = os.path.join(out_dir, f"{tag}.cu"), os.path.join(out_dir, f"{tag}.{out_kind}")
    with open(cu, "w") as f:
        f.write(unit)
    cmd = ["nvcc", f"-arch={ARCH}", f"--{out_kind}", "-std=c++17", *extra, "-o", out, cu]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(r.stderr[-3000:])
    return out


def ptx_code(unit: str, out_dir: str, tag: str = "k") -> list[str]:
    """The PTX of `unit` without debug line records (they name source lines)."""
    with open(nvcc(unit, "ptx", out_dir, tag)) as f:
        text = f.read()
    return [ln for ln in text.splitlines()
            if ln.strip() and not ln.strip().startswith((".loc", ".file", "//"))]


def block_loop_lines(sass: str) -> list[str]:
    """The SASS lines of the block loop (see the module docstring): the shortest range from
    a backward branch's target to the branch that holds an HMMA (not the first HMMA to
    the last: a kernel may run MMAs outside its block loop)."""
    lines = [ln for ln in sass.splitlines() if _ADDR.search(ln) and _OP.search(ln)]
    addr = [int(_ADDR.search(ln).group(1), 16) for ln in lines]
    mma = [a for ln, a in zip(lines, addr) if "HMMA" in ln]
    if not mma:
        raise RuntimeError("no HMMA in the kernel")
    best = None
    for ln, a in zip(lines, addr):
        m = re.search(r"BRA\s+(?:`?\(?\.L_x_\d+\)?`?\s*)?(0x[0-9a-f]+)", ln)
        if m and int(m.group(1), 16) <= a:
            lo = int(m.group(1), 16)
            if any(lo <= x <= a for x in mma) and (best is None or a - lo < best[1] - best[0]):
                best = (lo, a)
    if best is None:
        raise RuntimeError("no backward branch around an HMMA")
    return [ln for ln, a in zip(lines, addr) if best[0] <= a <= best[1]]


def opcode_counts(lines: list[str]) -> collections.Counter:
    """Opcode counts of SASS lines."""
    return collections.Counter(_OP.search(ln).group(1) for ln in lines)


def compile_and_count(unit: str, cuobjdump: str, maxrreg: int | None,
                      dump: str | None = None) -> tuple[int, collections.Counter]:
    """(registers per thread, block-loop opcode counts) of the kernel in `unit`; with
    `dump`, the block loop's SASS lines written to that file."""
    extra = (f"-maxrregcount={maxrreg}",) if maxrreg else ()
    with tempfile.TemporaryDirectory() as tmp:
        cubin = nvcc(unit, "cubin", tmp, extra=extra)
        res = subprocess.run([cuobjdump, "-res-usage", cubin], capture_output=True, text=True, check=True).stdout
        sass = subprocess.run([cuobjdump, "-sass", cubin], capture_output=True, text=True, check=True).stdout
    loop = block_loop_lines(sass)
    if dump:
        with open(dump, "w") as f:
            f.write("\n".join(ln.strip() for ln in loop) + "\n")
    return int(re.search(r"REG:(\d+)", res).group(1)), opcode_counts(loop)
