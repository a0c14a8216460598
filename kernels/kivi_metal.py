"""KIVI decode attention and tail flush as Metal kernels (`mx.fast.metal_kernel`):
the Metal backend as `kernels.dispatch` sees it (same names as `kernels.kivi_cuda`).

UNTESTED on hardware: this is the CUDA-core algorithm of `kernels.cuda_attend` and
the gather flush of `kernels.cuda_flush` transcribed for Metal (same launch plan from
`kernels.launch`, same index math, same numerics); the CUDA version is the one
measured and parity-tested. The GPU tests run it on Apple silicon
(tests/test_kernels_gpu.py) and skip elsewhere. Sources: kernels/metal/. Differences:

  * SIMD groups of 32 (every Apple GPU): `simd_shuffle*`, `simd_max`, `simd_sum` stand
    in for warp shuffles; `simdgroup_barrier` for `__syncwarp`.
  * Threadgroup memory is capped at 32 KiB, so the split kernel uses fewer SIMD
    groups per threadgroup when rep is large (`warps_for`).
  * No tensor-core kernel, the tail is one split, the merge is one thread per
    channel, and no fused flush: `flush_layers` is the gather path
    (`kivi_reference.gather_flush_layers`) with the quantize kernel.
  * Flush numerics: `metal::precise::divide` (plain `/` is not correctly rounded in
    Metal even in safe math mode) and `rint` (Metal `round` is half away from zero,
    `rint` is half to even like `mx.round`); math_mode "safe".
"""

from __future__ import annotations

import mlx.core as mx

from kiviq.kernels.cuda_flush import gather_flush, kernel_quantize
from kiviq.kernels.cuda_source import read
from kiviq.kernels import kivi_reference
from kiviq.kernels.kivi_reference import gather_flush_layers
from kiviq.kernels.launch import (
    HEAD_DIMS,
    POOL_DTYPES,
    POOL_NAMES,
    STEP_TOKENS,
    attend_launch,
    attend_templates,
    flush_supports,
    split_plan,
    supports,
)
from kiviq.kernels.layout import KiviPool
from kiviq.kernels.rotation import hadamard_rotate

NAME = "metal"

TG_MEMORY = 32768  # bytes of threadgroup memory on Apple GPUs


def _metal_available() -> bool:
    try:
        return bool(mx.metal.is_available())
    except AttributeError:
        return False


def warps_for(d: int, rep: int) -> int:
    """SIMD groups per threadgroup so that qs + ps fit in threadgroup memory."""
    for nw in (4, 2, 1):
        if 4 * (d * rep + nw * rep * STEP_TOKENS) <= TG_MEMORY:
            return nw
    return 1


def _metal_kernel(file: str, **kw):
    """`mx.fast.metal_kernel` of kernels/metal/`file` with kivi.metal as its header;
    None where MLX has no Metal backend."""
    if not _metal_available():
        return None
    return mx.fast.metal_kernel(source=read("metal/" + file), header=read("metal/kivi.metal"),
                                compile_options={"math_mode": "safe"}, **kw)


ATTEND_KERNEL = _metal_kernel(
    "attend_split.metal", name="kivi_attend_split",
    input_names=["q", *POOL_NAMES, "block_tables", "num_blocks", "slots", "tail_lens", "params", "qscale_in"],
    output_names=["part_acc", "part_ml"])
MERGE_KERNEL = _metal_kernel("attend_merge.metal", name="kivi_attend_merge",
                             input_names=["part_acc", "part_ml", "params"], output_names=["out"])
FLUSH_KERNEL = _metal_kernel("flush_quantize.metal", name="kivi_flush_quantize",
                             input_names=["rows_k", "rows_v", "params"], output_names=list(POOL_NAMES[:6]))


def available() -> bool:
    """Whether the Metal kernels are built here."""
    return ATTEND_KERNEL is not None


def kivi_decode_attend(q, pool: KiviPool, block_tables, num_blocks, slots, tail_lens, *,
                       scale: float, bits: int, group_size: int = 32) -> mx.array:
    """Metal twin of `kernels.cuda_attend.kivi_decode_attend` (same contract)."""
    if ATTEND_KERNEL is None:
        raise RuntimeError("MLX's Metal backend is not available")
    if q.shape[0] == 0:
        return mx.zeros(q.shape, dtype=q.dtype)
    b, h_q, d = q.shape
    nw = warps_for(d, h_q // pool.tail_k.shape[1])
    meta, split, _, rep = attend_launch(
        q.shape, q.dtype, pool, block_tables, num_blocks, slots, tail_lens, scale=scale,
        bits=bits, group_size=group_size, warps=nw, tail_rows=None)
    t_split, t_merge = attend_templates(q.dtype, pool, bits=bits, group_size=group_size,
                                        rep=rep, warps=nw)
    part_acc, part_ml = ATTEND_KERNEL(inputs=[q, *pool, *meta], template=t_split, **split)
    # One thread per output channel, looping over the splits (the CUDA merge spreads
    # the splits over warps; not ported: no Apple hardware to measure it on).
    return MERGE_KERNEL(inputs=[part_acc, part_ml, meta[4]], template=t_merge,
                        grid=(b * h_q * d, 1, 1), threadgroup=(d, 1, 1),
                        output_shapes=[(b, h_q, d)], output_dtypes=[q.dtype])[0]


def kivi_flush(pool: KiviPool, slots, new_block_ids, tail_lens, *, bits: int,
               group_size: int = 32) -> KiviPool:
    """Metal twin of `kernels.cuda_flush.kivi_flush` (same contract)."""
    return gather_flush(FLUSH_KERNEL, pool, slots, new_block_ids, tail_lens, bits=bits, group_size=group_size)


def attend_plan(q_shape, q_dtype, pool, block_tables, num_blocks, slots, tail_lens, *, scale: float,
                bits: int, group_size: int, rotate_out: bool = False):
    """`attend(q, pool)` for the layers of one step; q as [B, H_q, D] or [B, H_q, 1, D].
    It reads a tail the new token was already written into. `rotate_out`: the output
    rotated back by one ``hadamard_rotate`` op (``dispatch.attend_plan``)."""
    def attend(q, p):
        flat = q.reshape(q.shape[0], q.shape[1], q.shape[-1])
        out = kivi_decode_attend(flat, p, block_tables, num_blocks, slots, tail_lens, scale=scale, bits=bits,
                                 group_size=group_size).reshape(q.shape)
        return hadamard_rotate(out) if rotate_out else out
    return attend


def flush_layers(pools: list[KiviPool], slots, ids, *, bits: int, group_size: int, blocks_per_slot: int = 1) -> None:
    """The gather flush of every pool with the quantize kernel (checked arguments:
    `dispatch.flush_layers`)."""
    gather_flush_layers(pools, slots, ids, bits=bits, group_size=group_size, blocks_per_slot=blocks_per_slot,
                        quantize=kernel_quantize(FLUSH_KERNEL))


def write_blocks(pool: KiviPool, keys, values, first, ids, *, bits: int, group_size: int) -> None:
    """`kivi_reference.write_blocks` with the quantize kernel (gathers and scatters
    around it: no in-place kernel on Metal); nothing to evaluate besides the pool."""
    kivi_reference.write_blocks(pool, keys, values, first, ids, bits=bits, group_size=group_size,
                                quantize=kernel_quantize(FLUSH_KERNEL))


__all__ = ["HEAD_DIMS", "NAME", "POOL_DTYPES", "attend_plan", "available", "flush_layers", "flush_supports",
           "kivi_decode_attend", "kivi_flush", "split_plan", "supports", "warps_for", "write_blocks"]
