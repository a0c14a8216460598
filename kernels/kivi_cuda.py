"""The CUDA backend as `kernels.dispatch` sees it (Linux + NVIDIA, MLX's CUDA backend).

Every backend module (this one, `kernels.kivi_metal`) offers the same names:
NAME, `available`, `supports` / `attend_plan` (decode attention), `flush_supports` /
`kivi_flush` / `flush_layers` (tail flush), `write_blocks` (a forward's new blocks).
This one also flushes inside a decode step's graph (`step_flush`, `flush_params`) and
runs a decode step's attention prologue inside its split kernels (`prologue_supports`,
`attend_plan(..., prologue=)`). The kernels themselves: attention in
`kernels.cuda_attend`, the flush and the block writes in `kernels.cuda_flush`, launch
planning shared with Metal in `kernels.launch`.
"""

from __future__ import annotations

from kiviq.kernels.cuda_attend import ATTEND_KERNEL, MERGE_KERNEL, AttendPlan, kivi_decode_attend, prologue_supports
from kiviq.kernels.cuda_flush import (WRITE_BLOCKS_KERNEL, flush_layers, flush_params, fused_flush_kernel, kivi_flush,
                                      step_flush, write_blocks)
from kiviq.kernels.launch import HEAD_DIMS, POOL_DTYPES, flush_supports, split_plan, supports

NAME = "cuda"


def available() -> bool:
    """Whether the CUDA kernels are built here."""
    return ATTEND_KERNEL is not None and fused_flush_kernel(1) is not None and WRITE_BLOCKS_KERNEL is not None


def attend_plan(q_shape, q_dtype, pool, block_tables, num_blocks, slots, tail_lens, *, scale: float,
                bits: int, group_size: int, rotate_out: bool = False, prologue=None, after=()) -> AttendPlan:
    """The step's launches (`AttendPlan`): q as [B, H_q, D] or [B, H_q, 1, D]; the plan
    takes the new token (`plan(q, pool, k_new, v_new)`) and writes it into the tail;
    with `rotate_out` its merge rotates the output back (a 2r pool). With a `prologue`
    (`kernels.qk_rope.Prologue`, where `prologue_supports`) it takes the fused q/k/v
    row instead (`plan.with_prologue`). Its launches run after the arrays `after`
    (the step's `step_flush`)."""
    return AttendPlan(q_shape, q_dtype, pool, block_tables, num_blocks, slots, tail_lens, scale=scale, bits=bits,
                      group_size=group_size, rotate_out=rotate_out, prologue=prologue, after=after)


__all__ = ["ATTEND_KERNEL", "HEAD_DIMS", "MERGE_KERNEL", "NAME", "POOL_DTYPES", "AttendPlan", "attend_plan",
           "available", "flush_layers", "flush_params", "flush_supports", "kivi_decode_attend", "kivi_flush",
           "split_plan", "prologue_supports", "step_flush", "supports", "write_blocks"]
