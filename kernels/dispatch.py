"""Kernel or reference: one entry point per operation.

`decode_attend` (or `attend_plan`, its launch prepared once for a step's layers),
`flush` and `flush_layers` run the kernels of the backend that runs here
(`kernel_module`: `kernels.kivi_cuda` where MLX has a CUDA backend, `kernels.kivi_metal`
on Apple silicon, with a GPU default device), and the plain-ops reference
(`kernels.kivi_reference`) everywhere else: on CPU and for shapes the kernels do not
cover. `use_kernel` decides nothing else: None picks as above, False forces the
reference, True requires a kernel and raises where none can run. Whether a kernel
is correct on this machine is `kernels.self_check`'s question.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import mlx.core as mx

from kiviq.kernels import cuda_attend, kivi_cuda, kivi_metal
from kiviq.kernels import kivi_reference
from kiviq.kernels.kivi_reference import check_flush_args, decode_attention, flush_tails, gather_flush_layers
from kiviq.kernels.layout import KiviPool
from kiviq.kernels.qk_rope import Prologue
from kiviq.kernels.rotation import hadamard_rotate


def _built_module():
    for mod in (kivi_cuda, kivi_metal):
        if mod.available():
            return mod
    return None


def kernel_available() -> bool:
    """True where a KIVI kernel backend (CUDA or Metal) is built on this machine."""
    return _built_module() is not None


def kernel_module():
    """The backend module whose kernels run here (see `kernels.kivi_cuda` for the names
    it offers), or None: none is built, or the default device is not the GPU."""
    mod = _built_module()
    return mod if mod is not None and mx.default_device() == mx.gpu else None


def _chosen(use_kernel: bool | None):
    """The backend module a call with `use_kernel` runs, or None for the reference."""
    if use_kernel is False:
        return None
    mod = kernel_module()
    if mod is None and use_kernel:
        raise RuntimeError(
            "use_kernel=True, but no KIVI kernel can run here: needs MLX's CUDA "
            "backend (Linux + NVIDIA) or Metal (Apple silicon) and a GPU default device")
    return mod


def backend(use_kernel: bool | None = None) -> str:
    """Which implementation a call would use: "cuda", "metal" or "reference".

    Shape support is checked per call on top of this (see `decode_attend`).
    """
    mod = _chosen(use_kernel)
    return "reference" if mod is None else mod.NAME


def attend_plan(q_shape: tuple[int, ...], q_dtype: mx.Dtype, pool: KiviPool, block_tables: mx.array,
                num_blocks: mx.array, slots: mx.array, tail_lens: mx.array, *, scale: float, bits: int,
                group_size: int = 32, use_kernel: bool | None = None,
                rotate_out: bool = False, after: Sequence[mx.array] = ()) -> Callable[..., mx.array]:
    """`decode_attend` prepared once for many calls with the same metadata: the
    layers of one decode step. Returns `attend(q, pool)`; every pool it is called
    with must have `pool`'s shapes and dtypes (a model's layers do). Where
    `writes_tail(attend)`, it is called as `attend(q, pool, k_new, v_new)` instead and
    writes the step's new token into the tail itself.

    The choice of backend, the support checks and the kernel launch plan are made
    here, once, instead of in every layer (~30 us of Python per call on the H200).

    `q_shape` may also be the model's [B, H_q, 1, D] (one query per sequence, with
    its length axis): then `attend` takes and returns that shape.

    `rotate_out`: the pool's rows live in the Hadamard basis (``--kv-bits 2r``) and the
    output is rotated back (``kernels.rotation.hadamard_rotate``, the same bits
    everywhere): by the CUDA merge kernel in its launch, elsewhere by one more op.

    `after`: arrays the launches must follow (a decode step's `step_flush`); only the
    CUDA plan takes them.
    """
    flat = tuple(q_shape)
    if len(flat) == 4:
        if flat[2] != 1:
            raise ValueError(f"decode attention takes one query per sequence, got q of shape {flat}")
        flat = (flat[0], flat[1], flat[3])
    mod = _chosen(use_kernel)
    if mod is not None:
        reason = mod.supports(flat, q_dtype, pool, bits, group_size)
        if reason is None:
            if flat[0] == 0:
                return lambda q, _pool: mx.zeros(q.shape, dtype=q.dtype)
            extra = {"after": after} if after else {}  # the CUDA plan's alone
            return mod.attend_plan(q_shape, q_dtype, pool, block_tables, num_blocks, slots, tail_lens,
                                   scale=scale, bits=bits, group_size=group_size, rotate_out=rotate_out, **extra)
        if use_kernel:
            raise ValueError(f"use_kernel=True, but the kernel does not support {reason}")
    if after:
        raise ValueError("only the CUDA attention plan follows a step's in-graph flush (after=)")

    def attend(q, p):
        out = decode_attention(q.reshape(flat), p, block_tables, num_blocks, slots, tail_lens, scale=scale,
                               bits=bits, group_size=group_size).reshape(q.shape)
        return hadamard_rotate(out) if rotate_out else out
    return attend


def prologue_plan(q_shape: tuple[int, ...], q_dtype: mx.Dtype, pool: KiviPool, block_tables: mx.array,
                  num_blocks: mx.array, slots: mx.array, tail_lens: mx.array, *, scale: float, bits: int,
                  group_size: int, prologue: Prologue, use_kernel: bool | None = None,
                  rotate_out: bool = False, after: Sequence[mx.array] = ()):
    """`attend_plan` with the decode step's attention prologue (``prologue``) run inside
    its kernels: a plan called as ``plan.with_prologue(qkv, pool, offsets, q_norm,
    k_norm)`` that also writes the new token into the tail. None where no kernel here
    runs it (another backend, or a shape it does not cover): then the caller runs
    ``prologue.reference`` and `attend_plan`'s path, which give the same bits.
    `after` as in `attend_plan`."""
    mod = _chosen(use_kernel)
    check = getattr(mod, "prologue_supports", None)
    flat = (q_shape[0], q_shape[1], q_shape[-1])
    if check is None or flat[0] == 0 or mod.supports(flat, q_dtype, pool, bits, group_size) is not None \
            or check(flat, q_dtype, pool, prologue) is not None:
        return None
    return mod.attend_plan(q_shape, q_dtype, pool, block_tables, num_blocks, slots, tail_lens, scale=scale,
                           bits=bits, group_size=group_size, rotate_out=rotate_out, prologue=prologue, after=after)


def decode_attend(q: mx.array, pool: KiviPool, block_tables: mx.array, num_blocks: mx.array, slots: mx.array,
                  tail_lens: mx.array, *, scale: float, bits: int, group_size: int = 32,
                  use_kernel: bool | None = None) -> mx.array:
    """Decode attention over the KIVI pool (contract: `kivi_reference.decode_attention`).

    Args:
        q, pool, block_tables, num_blocks, slots, tail_lens, scale, bits, group_size:
            as in `kernels.kivi_reference.decode_attention`.
        use_kernel: None picks (the kernel where it runs and supports the shape);
            True requires the kernel; False the reference.

    Returns:
        [B, H_q, D] in q's dtype.
    """
    return attend_plan(q.shape, q.dtype, pool, block_tables, num_blocks, slots, tail_lens, scale=scale,
                       bits=bits, group_size=group_size, use_kernel=use_kernel)(q, pool)


def writes_tail(plan) -> bool:
    """Whether an `attend_plan` result takes the step's new token (`plan(q, pool,
    k_new, v_new)`) and writes it into the tail itself: the CUDA plan does; the
    others read a tail already written (`KiviStore.write_decode`'s scatters)."""
    return isinstance(plan, cuda_attend.AttendPlan)


def _flush_module(pool: KiviPool, use_kernel: bool | None):
    mod = _chosen(use_kernel)
    if mod is None:
        return None
    reason = mod.flush_supports(pool)
    if reason is None:
        return mod
    if use_kernel:
        raise ValueError(f"use_kernel=True, but the flush kernel does not support {reason}")
    return None


def flush(pool: KiviPool, slots: mx.array, new_block_ids: mx.array, tail_lens: mx.array, *, bits: int,
          group_size: int = 32, use_kernel: bool | None = None) -> KiviPool:
    """Quantize the oldest G tail tokens of some slots into blocks and shift the tails.

    Contract: `kernels.kivi_reference.flush_tails` (bit-identical pool contents).
    `use_kernel` as in `decode_attend`.

    Returns:
        The same pool object, updated in place.
    """
    mod = _flush_module(pool, use_kernel)
    run = flush_tails if mod is None else mod.kivi_flush
    return run(pool, slots, new_block_ids, tail_lens, bits=bits, group_size=group_size)


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
) -> None:
    """`flush` of the same slots into the same block ids of several pools (a
    model's layers), with one host sync for all of them instead of one per pool.

    With ``blocks_per_slot`` = k each slot's oldest k*G tokens become k blocks
    (`new_block_ids`: k per slot, slot by slot) and its tail shifts by k*G, in
    one pass: the same launches and scatters as a one-block flush.

    The pools end bit-identical to calling `flush` on each. On CUDA one fused kernel
    per pool quantizes, writes the new blocks and shifts the tails in place
    (`kernels.cuda_flush.flush_layers`); elsewhere the gather path runs
    (`kivi_reference.gather_flush_layers`: gathers, the quantize kernel or ops,
    scatters left lazy). Either way the device has released the pools' buffers when
    this returns, so the next step's tail writes happen in place (a decode step whose
    attention kernel writes the tails flushes inside its own graph instead:
    `step_flush`). `use_kernel` as in `decode_attend`.
    """
    if not pools:
        return
    checked = check_flush_args(pools[0], slots, new_block_ids, tail_lens, bits=bits, group_size=group_size,
                               blocks_per_slot=blocks_per_slot)
    if checked is None:
        return
    slots, ids = checked
    mod = _flush_module(pools[0], use_kernel)
    if mod is None:
        gather_flush_layers(pools, slots, ids, bits=bits, group_size=group_size, blocks_per_slot=blocks_per_slot)
    else:
        mod.flush_layers(pools, slots, ids, bits=bits, group_size=group_size, blocks_per_slot=blocks_per_slot)


def step_flush_params(pool: KiviPool, blocks_per_slot: int,
                      use_kernel: bool | None = None) -> tuple[int, ...] | None:
    """The int32 params `step_flush` takes for pools like ``pool`` but the last (the
    batch size, which follows them), or None where a decode step cannot flush inside
    its own graph (no in-place flush kernel here)."""
    return kivi_cuda.flush_params(pool, blocks_per_slot) if blocks_written_in_place(pool, use_kernel) else None


def step_flush(pools: list[KiviPool], slots: mx.array, new_block_ids: mx.array, params: mx.array, *, bits: int,
               group_size: int = 32, use_kernel: bool | None = None) -> list[mx.array]:
    """`flush_layers` as ops of a decode step's graph (CUDA: `kernels.cuda_flush.step_flush`):
    ``slots`` int32 [B], the flushing slots first and -1 for the rest; ``new_block_ids``
    int32 [B * blocks_per_slot]; ``params`` `step_flush_params` then B, a device array.
    Returns arrays the step's attention must follow (`attend_plan(after=)`)."""
    if not blocks_written_in_place(pools[0], use_kernel):
        raise ValueError("a decode step flushes inside its graph only with the CUDA flush kernel")
    return kivi_cuda.step_flush(pools, slots, new_block_ids, params, bits=bits, group_size=group_size)


def blocks_written_in_place(pool: KiviPool, use_kernel: bool | None = None) -> bool:
    """Whether `write_blocks` into pools like ``pool`` is an in-place launch (CUDA)
    rather than scatters into the pool's block arrays."""
    return _flush_module(pool, use_kernel) is kivi_cuda


def write_blocks(pool: KiviPool, keys: mx.array, values: mx.array, first: mx.array, ids: mx.array, *,
                 bits: int, group_size: int = 32, use_kernel: bool | None = None) -> mx.array | None:
    """Quantize G-token blocks of a forward's keys and values [B, H_kv, L, D] into the
    pool at block ids ``ids`` (contract: `kivi_reference.write_blocks`, bit-identical
    pool contents; ``first`` and ``ids`` int32 [N]).

    On CUDA one launch writes the pool in place and this returns its ``done`` array:
    the caller evaluates it before anything reads those blocks, and scatters nothing
    into the pool's block arrays until then. Elsewhere the writes are scatters into the
    pool (lazy, evaluated with it) and this returns None. `use_kernel` as in
    `decode_attend`.
    """
    mod = _flush_module(pool, use_kernel)
    if mod is None:
        kivi_reference.write_blocks(pool, keys, values, first, ids, bits=bits, group_size=group_size)
        return None
    return mod.write_blocks(pool, keys, values, first, ids, bits=bits, group_size=group_size)


__all__ = ["attend_plan", "backend", "blocks_written_in_place", "decode_attend", "flush", "flush_layers",
           "kernel_available", "kernel_module", "step_flush", "step_flush_params", "write_blocks", "writes_tail"]
