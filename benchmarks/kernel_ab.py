"""A/B of the CUDA decode-attention kernels against another revision, in one process.

The base revision's `kernels/kivi_cuda.py` (`git show REV:...`) is loaded as a second
module whose kernels are renamed (`base_kivi_*`, so MLX compiles both), and both
modules' launch plans (`AttendPlan`) run on the same inputs (benchmarks/kernel_attend.py's
`make_input`: H_q 32, H_kv 8, D 128, G 32, R 128, scattered blocks). Per shape:

1. outputs first: whether they are bit-identical (`mx.array_equal`) and the largest
   difference; a change meant to keep the numerics must print identical=True;
2. timing: arms `new` (the working tree), `base` and `new_again` (a second plan of
   the working tree: the noise floor) interleaved with the first arm rotating,
   rotating 3-12 distinct inputs (`kernel_attend.time_variants`); min / median / max ms
   per call, base / new and new_again / new of the medians.

Run on the GPU (needs git and the repository):

    MLX_ENABLE_TF32=0 python3 benchmarks/kernel_ab.py --base HEAD --shapes 32:8192 64:16384 1:4096
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile

import mlx.core as mx

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.common import command, machine, table  # noqa: E402
from benchmarks.kernel_attend import SCALE, make_input, time_variants  # noqa: E402
from kiviq.kernels import kivi_cuda  # noqa: E402


def load_base(rev: str):
    """`kernels/kivi_cuda.py` at `rev` as a module with renamed kernels. `rev` may
    also be a file holding that source (`git show REV:kernels/kivi_cuda.py > FILE`),
    for a machine whose copy of the tree has no git history."""
    if os.path.isfile(rev):
        with open(rev) as f:
            src = f.read()
    else:
        src = subprocess.run(["git", "-C", ROOT, "show", f"{rev}:kernels/kivi_cuda.py"], check=True,
                             capture_output=True, text=True).stdout
    src = src.replace('name="kivi_', 'name="base_kivi_')
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(src)
    spec = importlib.util.spec_from_file_location("kivi_cuda_base", f.name)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    os.unlink(f.name)
    return module


def arm(module, bits: int, plans: dict, tag: str):
    """A call of `module`'s decode attention whose launch plan is made once per input."""
    def call(args):
        key = (id(args), tag)
        if key not in plans:
            q, pool, *meta = args
            plans[key] = module.AttendPlan(q.shape, q.dtype, pool, *meta, scale=SCALE, bits=bits, group_size=32)
        return plans[key](args[0], args[1])
    return call


def ms(ts: list[float]) -> str:
    return f"{min(ts) * 1e3:.3f} / {statistics.median(ts) * 1e3:.3f} / {max(ts) * 1e3:.3f}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", default="HEAD", help="git revision to compare against")
    p.add_argument("--shapes", nargs="+", default=["32:8192", "64:16384", "1:32768", "1:4096", "8:4096"])
    p.add_argument("--bits", type=int, nargs="+", default=[4, 2])
    p.add_argument("--repeats", type=int, default=7)
    args = p.parse_args()
    if kivi_cuda.ATTEND_KERNEL is None:
        raise SystemExit("needs MLX's CUDA backend")
    base = load_base(args.base)
    print(f"# {command()}\n# {machine()}; base {args.base}\n")
    rows = []
    for shape in args.shapes:
        b, s = (int(v) for v in shape.split(":"))
        for bits in args.bits:
            inputs = [make_input(b, s, bits, seed=i)[0] for i in range(3 if b * s >= 65536 else 12)]
            plans: dict = {}
            arms = {"new": arm(kivi_cuda, bits, plans, "new"), "base": arm(base, bits, plans, "base"),
                    "new_again": arm(kivi_cuda, bits, plans, "new_again")}
            new, old = arms["new"](inputs[0]), arms["base"](inputs[0])
            mx.eval(new, old)
            identical = bool(mx.array_equal(new, old).item())
            diff = float(mx.abs(new.astype(mx.float32) - old.astype(mx.float32)).max().item())
            t = time_variants(arms, inputs, args.repeats)
            med = {k: statistics.median(v) for k, v in t.items()}
            rows.append([b, s, bits, identical, f"{diff:.1e}", ms(t["new"]), ms(t["base"]), ms(t["new_again"]),
                         f"{med['base'] / med['new']:.2f}", f"{med['new_again'] / med['new']:.2f}"])
            print(rows[-1], flush=True)
            del inputs, plans
            mx.clear_cache()
    print(table(["B", "S", "bits", "identical", "max diff", "new ms", "base ms", "new again ms",
                 "base / new", "new again / new"], rows))


if __name__ == "__main__":
    main()
