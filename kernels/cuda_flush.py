"""KIVI tail flush on CUDA: the oldest k*G tail tokens of some slots become k blocks.

Same contract as `kernels.kivi_reference.flush_tails` (codes, scales and zeros bit
for bit): float32 subtract, correctly rounded division (`__fsub_rn`, `__fdiv_rn`),
`rintf` (half to even), zero and scale rounded to the storage dtype first and codes
computed from the stored values. Both kernels share `kivi_flush_block` (kivi.cuh), so
they quantize alike by construction.

* `flush_layers` (the engine's flush, all layers): `kivi_flush_fused`
  (flush_fused.cu), one in-place launch per layer that reads the tails through the
  flushing slots, writes the new blocks and shifts the tails; no graph node besides.
* `kivi_flush` (one pool, `dispatch.flush`) and the Metal backend: the gather path,
  `kivi_flush_quantize` (flush_quantize.cu) over gathered tail rows, its small
  outputs scattered into the pool with mlx ops (`kivi_reference.write_flushed`).
"""

from __future__ import annotations

import mlx.core as mx

from kiviq.kernels.cuda_source import cuda_kernel
from kiviq.kernels.kivi_reference import check_flush_args, finish, shifted_tail, write_flushed
from kiviq.kernels.launch import HEAD_DIMS, POOL_NAMES, const, flush_template, packed_views
from kiviq.kernels.layout import KiviPool

FLUSH_INPUTS = ["rows_k", "rows_v", "params"]
FLUSH_OUTPUTS = list(POOL_NAMES[:6])
FLUSH_FUSED_INPUTS = [*POOL_NAMES, "slots", "ids", "params"]

FLUSH_KERNEL = cuda_kernel("flush_quantize.cu", name="kivi_flush_quantize", input_names=FLUSH_INPUTS,
                           output_names=FLUSH_OUTPUTS)
# ensure_row_contiguous off: MLX must pass the pool's own buffers, never a copy.
FLUSH_FUSED_KERNEL = cuda_kernel("flush_fused.cu", name="kivi_flush_fused", input_names=FLUSH_FUSED_INPUTS,
                                 output_names=["done"], ensure_row_contiguous=False)
WRITE_BLOCKS_KERNEL = cuda_kernel("write_blocks.cu", name="kivi_write_blocks",
                                  input_names=[*POOL_NAMES[:6], "keys", "values", "first", "ids", "params"],
                                  output_names=["done"], ensure_row_contiguous=False)


def flush_prepare(pool: KiviPool, slots, new_block_ids, tail_lens, *, bits: int,
                  group_size: int):
    """Validate like `flush_tails`; returns (slots, ids) as int32 arrays, or None if F=0."""
    d = pool.k_codes.shape[2]
    if d not in HEAD_DIMS:
        raise ValueError(f"flush kernel: head_dim {d} not in {HEAD_DIMS}")
    return check_flush_args(pool, slots, new_block_ids, tail_lens, bits=bits, group_size=group_size)


def flush_apply(pool: KiviPool, slots, ids, rows_k, rows_v, quantized, group_size):
    """Shift the tails and scatter the new blocks, in place (see `flush_tails`)."""
    shifted = [shifted_tail(r, group_size) for r in (rows_k, rows_v)]
    # Every read of the pool (the gathers, the kernel) is finished before any write,
    # so the scatters below update the pool's buffers in place instead of copying.
    mx.eval(*quantized, *shifted)
    write_flushed(pool, slots, ids, *shifted, quantized)
    return pool


def flush_launch(pool: KiviPool, rows_k, *, bits, group_size):
    """(launch, template, params) of the gather flush kernel for n entries of rows,
    rows_k [n, H_kv, T, D] (each entry's first G rows become a new block): one thread
    block per (new block, kv head) of D threads, and the six block arrays as outputs."""
    n = rows_k.shape[0]
    _, h_kv, _, d = pool.tail_k.shape
    g, p = group_size, 8 // bits
    sd = pool.k_scales.dtype
    launch = dict(
        grid=(n * h_kv * d, 1, 1),
        threadgroup=(d, 1, 1),
        output_shapes=[(n, h_kv, d, g // p), (n, h_kv, d), (n, h_kv, d),
                       (n, h_kv, g, d // p), (n, h_kv, d // g, g), (n, h_kv, d // g, g)],
        output_dtypes=[mx.uint8, sd, sd, mx.uint8, sd, sd],
    )
    template = flush_template(pool, bits=bits, group_size=group_size)
    return launch, template, const((rows_k.shape[2],), mx.int32)


def flush_meta(pool: KiviPool, slots: mx.array, ids: mx.array, blocks_per_slot: int = 1) -> tuple:
    """(slots, ids, params) of `fused_flush` for every layer of a flush, as views of one
    device array (`kernels.launch.packed_views`): read once per flush, not per layer."""
    _, h_kv, rg, _ = pool.tail_k.shape
    params = const((rg, h_kv, blocks_per_slot), mx.int32)
    return tuple(packed_views([slots, ids, params]))


def fused_flush(pool: KiviPool, slots: mx.array, ids: mx.array, *, bits, group_size,
                blocks_per_slot: int = 1, meta: tuple | None = None) -> mx.array:
    """The in-place fused flush of one layer (flush_fused.cu says which ordering the
    caller owns): k = blocks_per_slot new blocks per flushing slot at ``ids``, tails
    shifted. `meta`: `flush_meta`'s result, made once for all layers.
    Returns the launch's `done` array; evaluating it writes the pool."""
    f, k = slots.shape[0], blocks_per_slot
    _, h_kv, rg, d = pool.tail_k.shape
    slots, ids, params = meta if meta is not None else flush_meta(pool, slots, ids, k)
    return FLUSH_FUSED_KERNEL(
        inputs=[*pool, slots, ids, params],
        template=flush_template(pool, bits=bits, group_size=group_size),
        grid=(f * h_kv * d, 1, 1), threadgroup=(d, 1, 1),
        output_shapes=[(1,)], output_dtypes=[mx.int32])[0]


def write_blocks(pool: KiviPool, keys: mx.array, values: mx.array, first: mx.array, ids: mx.array, *,
                 bits: int, group_size: int) -> mx.array | None:
    """`kivi_reference.write_blocks` in one in-place launch (write_blocks.cu says which
    ordering the caller owns). Returns the launch's `done` array (evaluating it writes
    the pool), or None when there is no block to write."""
    n = ids.shape[0]
    if n == 0:
        return None
    _, h_kv, length, d = keys.shape
    # Row-contiguous in the tails' dtype (= the scales', flush_supports): MLX passes
    # these buffers as they are, since the pool's own must not be copied.
    keys, values = (mx.contiguous(x.astype(pool.tail_k.dtype)) for x in (keys, values))
    return WRITE_BLOCKS_KERNEL(
        inputs=[*pool[:6], keys, values, first, ids, const((length, h_kv), mx.int32)],
        template=flush_template(pool, bits=bits, group_size=group_size),
        grid=(n * h_kv * d, 1, 1), threadgroup=(d, 1, 1),
        output_shapes=[(1,)], output_dtypes=[mx.int32])[0]


def flush_layers(pools: list[KiviPool], slots: mx.array, ids: mx.array, *, bits: int, group_size: int,
                 blocks_per_slot: int = 1, wait: bool = True) -> None:
    """The fused flush of every pool (checked arguments: `dispatch.flush_layers`).

    The launches write the pools behind MLX's graph, so they are evaluated on their
    own: every earlier reader of the pools is already enqueued (the engine evaluates
    or launches each step before the next one's flush), and no reader is built
    before they are done. With ``wait`` they are finished (and the device has released
    the pools) when this returns; else only started.
    """
    meta = flush_meta(pools[0], slots, ids, blocks_per_slot)  # one device copy for all layers
    done = [fused_flush(pool, slots, ids, bits=bits, group_size=group_size, blocks_per_slot=blocks_per_slot,
                        meta=meta) for pool in pools]
    if wait:
        finish(done)
    else:
        mx.async_eval(done)


def kernel_quantize(kernel):
    """The `quantize` of `kivi_reference.gather_flush_layers` done by a flush quantize
    kernel (this one's `FLUSH_KERNEL` or its Metal twin): (pool, rows_k, rows_v, *,
    bits, group_size) -> the new blocks."""
    def quantize(pool: KiviPool, rows_k, rows_v, *, bits: int, group_size: int):
        launch, template, params = flush_launch(pool, rows_k, bits=bits, group_size=group_size)
        return kernel(inputs=[rows_k, rows_v, params], template=template, **launch)
    return quantize


def gather_flush(kernel, pool: KiviPool, slots, new_block_ids, tail_lens, *, bits: int,
                 group_size: int) -> KiviPool:
    """`flush_tails` of one pool with the flush quantize kernel `kernel`: the flushing
    tails gathered, quantized in one launch, the new blocks and shifted tails scattered
    in place."""
    if kernel is None:
        raise RuntimeError("no flush kernel on this backend")
    prepared = flush_prepare(pool, slots, new_block_ids, tail_lens, bits=bits, group_size=group_size)
    if prepared is None:
        return pool
    slots, ids = prepared
    rows_k, rows_v = pool.tail_k[slots], pool.tail_v[slots]
    quantized = kernel_quantize(kernel)(pool, rows_k, rows_v, bits=bits, group_size=group_size)
    return flush_apply(pool, slots, ids, rows_k, rows_v, quantized, group_size)


def kivi_flush(pool: KiviPool, slots, new_block_ids, tail_lens, *, bits: int, group_size: int = 32) -> KiviPool:
    """`kernels.kivi_reference.flush_tails` (same contract, codes/scales/zeros
    bit-identical) with one quantize launch for every flushing slot, K and V.
    Returns the same pool object, its arrays updated in place."""
    return gather_flush(FLUSH_KERNEL, pool, slots, new_block_ids, tail_lens, bits=bits, group_size=group_size)


__all__ = ["flush_layers", "fused_flush", "gather_flush", "kernel_quantize", "kivi_flush"]
