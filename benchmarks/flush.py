"""The flush of a decode step, all layers at once (`dispatch.flush_layers`), on the GPU.

A call is what `KiviStore.begin_decode` runs when F sequences' tails are full: the
flush of every layer, ending synchronized, so its time is the host's and the
device's together (what a decode step waits for). Shapes: Qwen3-4B's attention
(36 layers, H_kv 8, D 128, bf16), G 32, R 128, 64 tail slots, 4-bit.

Arms, interleaved with the first arm rotating, each on its own pools:
- `fused`: this tree's default, one in-place kernel per layer (no scatters);
- `fused_again`: the same, on a second set of pools: the noise floor;
- `fused_hostmeta`: the fused kernel reading its small inputs (slots, ids, params)
  where the host made them, in managed memory (KIVIQ_KIVI_META=host), instead of
  from one device copy per flush;
- `gather`: this tree's KIVIQ_FLUSH_KERNEL=gather (gathers, a quantize launch and
  eight scatters per layer);
- `base` (with --base REV): REV's fused flush, one launch per layer returning the
  new blocks and shifted tails, then eight scatters per layer (REV's kernels,
  renamed, as in benchmarks/kernel_ab.py; the launch-and-scatter calls are written
  here as REV's dispatch made them).

Outputs first: one flush of the same slots on identical pools must leave every
arm's pools bit-identical. Then each timed call flushes other slots into other
blocks (a rotation of distinct inputs). min / median / max ms per call.

    MLX_ENABLE_TF32=0 python3 benchmarks/flush.py --base 6cbc212 --flushing 1 8 32
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from unittest import mock

import mlx.core as mx

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.common import command, machine, table  # noqa: E402
from kiviq.kernels import dispatch, kivi_cuda  # noqa: E402
from kiviq.kernels.kivi_reference import check_flush_args, write_flushed  # noqa: E402
from kiviq.kernels.layout import allocate_pool  # noqa: E402

LAYERS, H_KV, D, G, R, SLOTS, BITS = 36, 8, 128, 32, 128, 64, 4


def make_pools(num_blocks: int, seed: int) -> list:
    key = mx.random.key(seed)
    pools = [allocate_pool(num_blocks, SLOTS, H_KV, D, bits=BITS, group_size=G, residual=R, dtype=mx.bfloat16)
             for _ in range(LAYERS)]
    for layer, pool in enumerate(pools):
        for i, name in enumerate(("tail_k", "tail_v")):
            a = getattr(pool, name)
            a[...] = mx.random.normal(a.shape, key=mx.random.split(key, 2 * LAYERS)[2 * layer + i]).astype(a.dtype)
        mx.eval(*pool)
    return pools


def base_flush(module):
    """REV's `flush_layers` fused branch (launch, then scatters, then the wait)."""
    if getattr(module, "fused_flush_launch", None) is None:
        raise SystemExit("--base: that revision has no fused_flush_launch (the launch-and-scatter flush)")

    def flush(pools, slots, ids, lens):
        slots, ids = check_flush_args(pools[0], slots, ids, lens, bits=BITS, group_size=G)
        launch = module.fused_flush_launch(pools[0], slots, bits=BITS, group_size=G)
        rest = launch.pop("inputs")[2:]
        outs = [module.FLUSH_FUSED_KERNEL(inputs=[p.tail_k, p.tail_v, *rest], **launch) for p in pools]
        reads = [a for out in outs for a in out]
        mx.async_eval(reads)
        for pool, out in zip(pools, outs):
            write_flushed(pool, slots, ids, *out[6:], out[:6])
        mx.eval(reads)
        mx.synchronize()
        mx.eval(pools)  # the scatters: in the engine they run with the next step
        mx.synchronize()
    return flush


def tree_flush(pools, slots, ids, lens):
    """This tree's flush, the kernel chosen by KIVIQ_FLUSH_KERNEL (ENVS)."""
    dispatch.flush_layers(pools, slots, ids, lens, bits=BITS, group_size=G, use_kernel=True)
    mx.eval(pools)  # nothing pending with the fused kernel; the gather path's scatters
    mx.synchronize()


# Each arm's environment, set around its calls outside the timed region.
ENVS = {"fused": {kivi_cuda.FLUSH_KERNEL_ENV: "fused"}, "fused_again": {kivi_cuda.FLUSH_KERNEL_ENV: "fused"},
        "fused_hostmeta": {kivi_cuda.FLUSH_KERNEL_ENV: "fused", kivi_cuda.META_ENV: "host"},
        "gather": {kivi_cuda.FLUSH_KERNEL_ENV: "gather"}, "base": {}}


def ms(ts: list[float]) -> str:
    return f"{min(ts) * 1e3:.3f} / {statistics.median(ts) * 1e3:.3f} / {max(ts) * 1e3:.3f}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", default=None, help="git revision whose fused flush is the `base` arm")
    p.add_argument("--flushing", type=int, nargs="+", default=[1, 8, 32], help="sequences flushing per call")
    p.add_argument("--repeats", type=int, default=20)
    args = p.parse_args()
    if kivi_cuda.FLUSH_FUSED_KERNEL is None:
        raise SystemExit("needs MLX's CUDA backend")
    arms = {"fused": tree_flush, "fused_again": tree_flush, "fused_hostmeta": tree_flush, "gather": tree_flush}
    if args.base:
        from benchmarks.kernel_ab import load_base
        arms["base"] = base_flush(load_base(args.base))
    num_blocks = 2 * SLOTS + max(args.flushing) * (args.repeats + 2) * len(arms)
    pools = {}
    print(f"# {machine()}\n# {command()}\n")
    rows = []
    for f in args.flushing:
        lens = [R + G - 1] * f
        # 1. outputs: the same flush on identical pools.
        for name in arms:
            pools[name] = make_pools(num_blocks, seed=f)
            with mock.patch.dict(os.environ, ENVS[name]):
                arms[name](pools[name], list(range(f)), list(range(f)), lens)
        ref = pools["fused"]
        same = all(mx.array_equal(a, b).item() for name in arms for pa, pb in zip(ref, pools[name])
                   for a, b in zip(pa, pb))
        # 2. timing, arms interleaved, first arm rotating, fresh slots and blocks per call.
        times = {name: [] for name in arms}
        names = list(arms)
        next_block = {name: f for name in arms}
        for rep in range(args.repeats + 1):
            order = names[rep % len(names):] + names[: rep % len(names)]
            for name in order:
                slots = [(rep * 7 + 3 * i) % SLOTS for i in range(f)] if f < SLOTS else list(range(SLOTS))
                slots = list(dict.fromkeys(slots))
                ids = list(range(next_block[name], next_block[name] + len(slots)))
                next_block[name] += len(slots)
                with mock.patch.dict(os.environ, ENVS[name]):
                    mx.synchronize()
                    t0 = time.perf_counter()
                    arms[name](pools[name], slots, ids, lens[: len(slots)])
                    elapsed = time.perf_counter() - t0
                if rep > 0:  # the first round compiles
                    times[name].append(elapsed)
        med = {n: statistics.median(t) for n, t in times.items()}
        for name in names:
            rows.append([f, name, ms(times[name]), f"{med[name] / med['fused']:.2f}", "yes" if same else "NO"])
    print(table(["flushing", "arm", "ms per call min / median / max", "x fused (median)", "bit-identical"], rows))


if __name__ == "__main__":
    main()
