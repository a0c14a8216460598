"""KIVI tail flush on CUDA: the oldest k*G tail tokens of some slots become k blocks.

Same contract as `kernels.kivi_reference.flush_tails` (codes, scales and zeros bit
for bit): float32 subtract, correctly rounded division (`__fsub_rn`, `__fdiv_rn`),
`rintf` (half to even), zero and scale rounded to the storage dtype first and codes
computed from the stored values. Both kernels share `kivi_flush_block` (kivi.cuh), so
they quantize alike by construction.

* `step_flush` (the engine's flush in a decode step, all layers) and `flush_layers`
  (the same evaluated on its own): `kivi_flush_fused` (flush_fused.cu), one in-place
  launch for up to MAX_FLUSH_LAYERS layers that reads the tails through the flushing
  slots, writes the new blocks and shifts the tails; no graph node besides.
* `kivi_flush` (one pool, `dispatch.flush`) and the Metal backend: the gather path,
  `kivi_flush_quantize` (flush_quantize.cu) over gathered tail rows, its small
  outputs scattered into the pool with mlx ops (`kivi_reference.write_flushed`).
"""

from __future__ import annotations

import functools

import mlx.core as mx

from kiviq.kernels.cuda_source import cuda_kernel
from kiviq.kernels.kivi_reference import check_flush_args, finish, shifted_tail, write_flushed
from kiviq.kernels.launch import HEAD_DIMS, POOL_NAMES, const, flush_template, packed_views
from kiviq.kernels.layout import KiviPool

FLUSH_INPUTS = ["rows_k", "rows_v", "params"]
FLUSH_OUTPUTS = list(POOL_NAMES[:6])
# Layers per fused flush launch: each brings its eight pool pointers as kernel parameters
# (48 layers: 3 KiB of CUDA's classic 4 KiB limit); more layers take more launches. Every
# decode step launches them (step_flush): one launch for the 28-40 layers of common
# models (an op less per step than at 32, ~12 us of MLX's host time).
MAX_FLUSH_LAYERS = 48
_C_TYPES = {"k_codes": "uint8_t", "v_codes": "uint8_t"}  # the rest are in the pool dtype, SD

FLUSH_KERNEL = cuda_kernel("flush_quantize.cu", name="kivi_flush_quantize", input_names=FLUSH_INPUTS,
                           output_names=FLUSH_OUTPUTS)
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
    # Every read of the pool (the gathers, the kernel) is finished, and its buffers
    # released, before any write, so the scatters below update the pool's buffers in
    # place instead of copying.
    finish([*quantized, *shifted])
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


# Thread blocks per kv head and layer of a decode step's flush (step_flush): each takes
# every 4th of the batch's slots up to the first that does not flush (flush_fused.cu).
STEP_FLUSH_SLOTS = 4


def flush_params(pool: KiviPool, blocks_per_slot: int) -> tuple[int, int, int]:
    """The fused flush's params (flush_fused.cu) but the last: tail rows, kv heads, blocks
    per slot; the entries of its slots array (flushing slots, then -1 padding) follow."""
    _, h_kv, rg, _ = pool.tail_k.shape
    return rg, h_kv, blocks_per_slot


def flush_meta(pool: KiviPool, slots: mx.array, ids: mx.array, blocks_per_slot: int = 1) -> tuple:
    """(slots, ids, params) of the fused flush for every layer of a flush, as views of
    one device array (`kernels.launch.packed_views`): read once per flush, not per layer."""
    params = const((*flush_params(pool, blocks_per_slot), slots.shape[0]), mx.int32)
    return tuple(packed_views([slots, ids, params]))


def layer_prologue(layers: int) -> str:
    """The fused flush kernel's generated first lines: k_codes .. tail_v point at layer
    blockIdx.y's arrays, inputs k_codes_0 .. tail_v_{layers - 1}."""
    text = "".join(f"const {_C_TYPES.get(n, 'SD')}* {n} = nullptr;\n" for n in POOL_NAMES)
    cases = "".join(f"case {layer}: " + " ".join(f"{n} = {n}_{layer};" for n in POOL_NAMES) + " break;\n"
                    for layer in range(layers))
    return text + "switch (blockIdx.y) {\n" + cases + "}\n"


def flush_input_names(layers: int) -> list[str]:
    return [*(f"{n}_{layer}" for layer in range(layers) for n in POOL_NAMES), "slots", "ids", "params"]


@functools.lru_cache(maxsize=None)
def fused_flush_kernel(layers: int):
    """The fused flush kernel over `layers` pools (None without MLX's CUDA backend): its
    inputs are each layer's eight pool arrays, then slots, ids and params
    (`flush_input_names`). MLX compiles one module per layer count."""
    # ensure_row_contiguous off: MLX must pass the pools' own buffers, never a copy.
    return cuda_kernel("flush_fused.cu", name=f"kivi_flush_fused_{layers}",
                       input_names=flush_input_names(layers), output_names=["done"],
                       ensure_row_contiguous=False, prologue=layer_prologue(layers))


def fused_flush(pools: list[KiviPool], meta: tuple, *, bits, group_size, blocks: int | None = None) -> mx.array:
    """The in-place fused flush of `pools` (of one shape and dtype) in one launch
    (flush_fused.cu says which ordering the caller owns). `meta`: `flush_meta`'s
    result, made once for all layers; `blocks` thread blocks per kv head and layer
    (default: one per entry of the slots). Returns the launch's `done` array;
    evaluating it writes the pools."""
    _, h_kv, _, d = pools[0].tail_k.shape
    blocks = meta[0].shape[0] if blocks is None else blocks
    return fused_flush_kernel(len(pools))(
        inputs=[*(a for pool in pools for a in pool), *meta],
        template=flush_template(pools[0], bits=bits, group_size=group_size),
        grid=(blocks * h_kv * d, len(pools), 1), threadgroup=(d, 1, 1),
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
                 blocks_per_slot: int = 1) -> None:
    """The fused flush of every pool (checked arguments: `dispatch.flush_layers`).

    The launches write the pools behind MLX's graph, so they are evaluated on their
    own: every earlier reader of the pools is already enqueued, and no reader is built
    before they are done. They are finished (and the device has released the pools)
    when this returns.
    """
    meta = flush_meta(pools[0], slots, ids, blocks_per_slot)  # one device copy for all layers
    finish(_launch_layers(pools, meta, bits=bits, group_size=group_size))


def step_flush(pools: list[KiviPool], slots: mx.array, ids: mx.array, params: mx.array, *, bits: int,
               group_size: int) -> list[mx.array]:
    """A decode step's flush of every pool as ops of the step's own graph: no
    evaluation of its own (`flush_layers` costs one, ~0.3 ms of host time a step on the
    GPU host), and inside a compiled step it is replayed with the rest.

    ``slots`` int32 [B] (the flushing slots first, -1 for the others: one shape for
    every step of a batch, whoever flushes), ``ids`` int32 [B * k] (k new blocks per
    flushing slot), ``params`` int32 (`flush_params`, then B): device arrays,
    such as views of the step's metadata. Returns the launches' ``done`` arrays: every
    reader of the pools in the same graph must depend on them (the attention plan's
    metadata is made after them: ``AttendPlan(after=)``), and every earlier one be
    enqueued already."""
    return _launch_layers(pools, (slots, ids, params), bits=bits, group_size=group_size,
                          blocks=min(slots.shape[0], STEP_FLUSH_SLOTS))


def _launch_layers(pools: list[KiviPool], meta: tuple, *, bits: int, group_size: int,
                   blocks: int | None = None) -> list[mx.array]:
    launches = -(-len(pools) // MAX_FLUSH_LAYERS)
    per = -(-len(pools) // launches)  # launches of (nearly) one size: few compiled modules
    return [fused_flush(pools[i:i + per], meta, bits=bits, group_size=group_size, blocks=blocks)
            for i in range(0, len(pools), per)]


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


__all__ = ["flush_layers", "flush_params", "fused_flush", "fused_flush_kernel", "gather_flush", "kernel_quantize",
           "kivi_flush", "layer_prologue", "step_flush"]
