"""Kernel or reference: one entry point per operation.

`decode_attend` (or `attend_plan`, its launch prepared once for a step's layers) and `flush` run the CUDA kernels (`kernels.kivi_cuda`) where MLX has
a CUDA backend, the Metal kernels (`kernels.kivi_metal`) on Apple silicon, and the
plain-ops reference (`kernels.kivi_reference`) everywhere else: on CPU, for shapes the
kernels do not cover, and whenever it is forced for an A/B run, by
`KIVIQ_KERNELS=reference` in the environment or `use_kernel=False`.
`use_kernel=True` demands a kernel and raises where none can run.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import mlx.core as mx

from kiviq.kernels import kivi_cuda, kivi_metal
from kiviq.kernels.kivi_reference import (
    check_flush_args,
    decode_attention,
    flush_tails,
    quantize_flushed,
    shifted_tail,
    write_flushed,
)
from kiviq.kernels.layout import KiviPool

ENV = "KIVIQ_KERNELS"  # "reference" forces the reference; "auto" (default) picks


def _backend_module():
    if kivi_cuda.ATTEND_KERNEL is not None:
        return kivi_cuda
    if kivi_metal.ATTEND_KERNEL is not None:
        return kivi_metal
    return None


def kernel_available() -> bool:
    """True where a KIVI kernel backend (CUDA or Metal) is built on this machine."""
    return _backend_module() is not None


def backend(use_kernel: bool | None = None) -> str:
    """Which implementation a call would use: "cuda", "metal" or "reference".

    Shape support is checked per call on top of this (see `decode_attend`).
    """
    mod = _backend_module()
    if use_kernel is False:
        return "reference"
    if use_kernel is None and os.environ.get(ENV, "auto").lower() == "reference":
        return "reference"
    if mod is None or mx.default_device() != mx.gpu:
        if use_kernel:
            raise RuntimeError(
                "use_kernel=True, but no KIVI kernel can run here: needs MLX's CUDA "
                "backend (Linux + NVIDIA) or Metal (Apple silicon) and a GPU default device"
            )
        return "reference"
    return "cuda" if mod is kivi_cuda else "metal"


def _module(name: str):
    return {"cuda": kivi_cuda, "metal": kivi_metal}.get(name)


def attend_plan(
    q_shape: tuple[int, ...],
    q_dtype: mx.Dtype,
    pool: KiviPool,
    block_tables: mx.array,
    num_blocks: mx.array,
    slots: mx.array,
    tail_lens: mx.array,
    *,
    scale: float,
    bits: int,
    group_size: int = 32,
    use_kernel: bool | None = None,
) -> Callable[[mx.array, KiviPool], mx.array]:
    """`decode_attend` prepared once for many calls with the same metadata: the
    layers of one decode step. Returns `attend(q, pool)`; every pool it is called
    with must have `pool`'s shapes and dtypes (a model's layers do).

    The choice of backend, the support checks and the kernel launch plan are made
    here, once, instead of in every layer (~30 us of Python per call on the H200).

    `q_shape` may also be the model's [B, H_q, 1, D] (one query per sequence, with
    its length axis): then `attend` takes and returns that shape. The CUDA plan
    reads and writes it as is (same memory as [B, H_q, D]); dropping and restoring
    the axis around the call were 3 graph nodes per layer and step.
    """
    flat = tuple(q_shape)
    if len(flat) == 4:
        if flat[2] != 1:
            raise ValueError(f"decode attention takes one query per sequence, got q of shape {flat}")
        flat = (flat[0], flat[1], flat[3])
    mod = _module(backend(use_kernel))
    attend = None
    if mod is not None:
        reason = mod.supports(flat, q_dtype, pool, bits, group_size)
        if reason is None:
            plan = getattr(mod, "AttendPlan", None)
            if flat[0] == 0:
                return lambda q, _pool: mx.zeros(q.shape, dtype=q.dtype)
            if plan is not None:  # takes either shape
                return plan(q_shape, q_dtype, pool, block_tables, num_blocks, slots, tail_lens,
                            scale=scale, bits=bits, group_size=group_size)
            attend = lambda q, p: mod.kivi_decode_attend(  # noqa: E731
                q, p, block_tables, num_blocks, slots, tail_lens, scale=scale, bits=bits, group_size=group_size)
        elif use_kernel:
            raise ValueError(f"use_kernel=True, but the kernel does not support {reason}")
    if attend is None:
        attend = lambda q, p: decode_attention(q, p, block_tables, num_blocks, slots, tail_lens,  # noqa: E731
                                               scale=scale, bits=bits, group_size=group_size)
    if len(q_shape) == 3:
        return attend
    return lambda q, p: attend(q.reshape(flat), p).reshape(q.shape)


def decode_attend(
    q: mx.array,
    pool: KiviPool,
    block_tables: mx.array,
    num_blocks: mx.array,
    slots: mx.array,
    tail_lens: mx.array,
    *,
    scale: float,
    bits: int,
    group_size: int = 32,
    use_kernel: bool | None = None,
) -> mx.array:
    """Decode attention over the KIVI pool (contract: `kivi_reference.decode_attention`).

    Args:
        q, pool, block_tables, num_blocks, slots, tail_lens, scale, bits, group_size:
            as in `kernels.kivi_reference.decode_attention`.
        use_kernel: None picks (kernel where it runs and supports the shape, unless
            KIVIQ_KERNELS=reference); True requires the kernel; False the reference.

    Returns:
        [B, H_q, D] in q's dtype.
    """
    return attend_plan(q.shape, q.dtype, pool, block_tables, num_blocks, slots, tail_lens, scale=scale,
                       bits=bits, group_size=group_size, use_kernel=use_kernel)(q, pool)


def flush(
    pool: KiviPool,
    slots: mx.array,
    new_block_ids: mx.array,
    tail_lens: mx.array,
    *,
    bits: int,
    group_size: int = 32,
    use_kernel: bool | None = None,
) -> KiviPool:
    """Quantize the oldest G tail tokens of some slots into blocks and shift the tails.

    Contract: `kernels.kivi_reference.flush_tails` (bit-identical pool contents).
    `use_kernel` as in `decode_attend`.

    Returns:
        The same pool object, updated in place.
    """
    mod = _module(backend(use_kernel))
    d = pool.k_codes.shape[2]
    if mod is not None and d in mod.HEAD_DIMS and pool.k_scales.dtype in mod.POOL_DTYPES:
        return mod.kivi_flush(pool, slots, new_block_ids, tail_lens, bits=bits,
                              group_size=group_size)
    if use_kernel and mod is not None:
        raise ValueError(f"use_kernel=True, but the flush kernel does not support D={d}")
    return flush_tails(pool, slots, new_block_ids, tail_lens, bits=bits,
                       group_size=group_size)


def flush_layers(
    pools: list[KiviPool],
    slots: list[int] | mx.array,
    new_block_ids: list[int] | mx.array,
    tail_lens: list[int] | mx.array,
    *,
    bits: int,
    group_size: int = 32,
    use_kernel: bool | None = None,
    blocks_per_slot: int = 1,
    wait: bool = True,
) -> None:
    """`flush` of the same slots into the same block ids of several pools (a
    model's layers), with one host sync for all of them instead of one per pool.

    With ``blocks_per_slot`` = k each slot's oldest k*G tokens become k blocks
    (`new_block_ids`: k per slot, slot by slot) and its tail shifts by k*G, in
    one pass: the same launches and scatters as a one-block flush.

    The pools end bit-identical to calling `flush` on each. On CUDA (the default,
    KIVIQ_FLUSH_KERNEL=fused) one kernel per pool quantizes, writes the new blocks
    and shifts the tails in place; nothing is left lazy. Elsewhere (and with
    KIVIQ_FLUSH_KERNEL=gather) every read of the pools (the flushed tails' rows,
    gathered) is started at once (`mx.async_eval`), the writes (scatters) are built
    meanwhile and stay lazy: a scatter updates a pool in place only if, when it is
    evaluated (with the caller's next graph, a decode step), no read of that buffer
    is pending on the device; MLX copies the whole array otherwise. Either way the
    device has released the pools' buffers when this returns (`_finish`), so the
    next step's tail writes happen in place. With ``wait=False`` the in-place
    kernels are only started (their own graph, ahead of anything built later);
    for a caller whose next step scatters nothing into the pools (its attention
    writes the tails: `writes_tail`) and who waits (`mx.synchronize`) before any
    other scatter into them. The gather path always waits.
    `use_kernel` as in `decode_attend`.
    """
    if not pools:
        return
    g, kb = group_size, blocks_per_slot
    checked = check_flush_args(pools[0], slots, new_block_ids, tail_lens, bits=bits, group_size=g,
                               blocks_per_slot=kb)
    if checked is None:
        return
    slots, ids = checked
    mod = _module(backend(use_kernel))
    d = pools[0].k_codes.shape[2]
    kernel = mod is not None and d in mod.HEAD_DIMS and pools[0].k_scales.dtype in mod.POOL_DTYPES
    if use_kernel and mod is not None and not kernel:
        raise ValueError(f"use_kernel=True, but the flush kernel does not support D={d}")
    flush_kernel = os.environ.get(kivi_cuda.FLUSH_KERNEL_ENV, "fused")
    if flush_kernel not in ("fused", "gather"):
        raise ValueError(f"{kivi_cuda.FLUSH_KERNEL_ENV}={flush_kernel!r}: expected 'fused' or 'gather'")
    if kernel and mod is kivi_cuda and flush_kernel == "fused":
        # One in-place launch per pool, no scatters (kivi_cuda.FLUSH_FUSED_SOURCE).
        # The launches write the pools behind MLX's graph, so they are evaluated on
        # their own: every earlier reader of the pools is already enqueued (the
        # engine evaluates or launches each step before the next one's flush), and
        # no reader is built before they are done.
        meta = kivi_cuda.flush_meta(pools[0], slots, ids, kb)  # one device copy for all layers
        done = [kivi_cuda.fused_flush(pool, slots, ids, bits=bits, group_size=g, blocks_per_slot=kb, meta=meta)
                for pool in pools]
        if wait:
            _finish(done)
        else:
            mx.async_eval(done)
        return
    # rows: [F, H_kv, R + k*G, D] per pool and tail.
    rows = [(pool.tail_k[slots], pool.tail_v[slots]) for pool in pools]
    reads = [a for pair in rows for a in pair]
    mx.async_eval(reads)
    for pool, (rows_k, rows_v) in zip(pools, rows):
        # Each new block quantizes the first G rows of one entry: the slot's rows
        # themselves when k = 1, else its oldest k*G rows cut into k entries of G.
        blocks_k, blocks_v = (rows_k, rows_v) if kb == 1 else (_entries(rows_k, kb, g), _entries(rows_v, kb, g))
        if kernel:  # the kernel's launch, without kivi_flush's own gathers and eval
            launch, template, params = mod.flush_launch(pool, blocks_k, bits=bits, group_size=g)
            quantized = mod.FLUSH_KERNEL(inputs=[blocks_k, blocks_v, params], template=template, **launch)
        else:
            quantized = quantize_flushed(pool, blocks_k, blocks_v, bits=bits, group_size=g)
        write_flushed(pool, slots, ids, shifted_tail(rows_k, kb * g), shifted_tail(rows_v, kb * g), quantized)
    _finish(reads)


TAIL_WRITE_ENV = "KIVIQ_TAIL_WRITE"  # "kernel" (default): see writes_tail; "scatter": never


def writes_tail(plan) -> bool:
    """Whether an `attend_plan` result takes the step's new token (`plan(q, pool,
    k_new, v_new)`) and writes it into the tail itself: the CUDA plan does, unless
    KIVIQ_TAIL_WRITE=scatter (for A/B runs); the others read a tail already written
    (`KiviStore.write_decode`'s scatters)."""
    mode = os.environ.get(TAIL_WRITE_ENV, "kernel")
    if mode not in ("kernel", "scatter"):
        raise ValueError(f"{TAIL_WRITE_ENV}={mode!r}: expected 'kernel' or 'scatter'")
    return mode == "kernel" and isinstance(plan, kivi_cuda.AttendPlan)


def _finish(arrays: list[mx.array]) -> None:
    """Wait until ``arrays`` are computed and the device has released every
    buffer their kernels used, so that scatters into those buffers, evaluated
    after this, happen in place.

    `mx.eval` alone is not enough: the CUDA backend keeps a kernel's inputs
    alive until a completion handler runs on another thread, which can come
    after `eval` returns; `mx.synchronize` waits for the handlers too.
    """
    if arrays:
        mx.eval(arrays)
        mx.synchronize()


def _entries(rows: mx.array, k: int, g: int) -> mx.array:
    """[F, H_kv, T, D] tail rows -> [F * k, H_kv, G, D]: the oldest k*G rows as k
    blocks' worth of rows per slot, slot by slot (the order of new_block_ids)."""
    f, h, _, d = rows.shape
    return rows[:, :, : k * g].reshape(f, h, k, g, d).transpose(0, 2, 1, 3, 4).reshape(f * k, h, g, d)


__all__ = ["attend_plan", "backend", "decode_attend", "flush", "flush_layers", "kernel_available", "writes_tail"]
