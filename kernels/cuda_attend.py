"""KIVI decode attention on CUDA: two launches per layer for all sequences.

Same contract as `kernels.kivi_reference.decode_attention`; storage layout in
`kernels.layout`, the split-K plan in `kernels.launch`, kernel sources in
kernels/cuda/. The kernels are built once at import and are None where MLX has no
CUDA backend (the MMA kernel once per launch bound, when first used).

1. A split kernel, one warp per (sequence b, kv head h, split s), chosen by the call's
   layout, not by a switch:
   a. `kivi_attend_split_mma` (attend_split_mma.cu) wherever `mma_supports`: bits 2/4,
      G = 32, D 64/128. Tensor cores: a warp double-buffers its blocks in shared
      memory with cp.async and never dequantizes: scales folded into q and p, zeros
      (and bf16's code offsets) in small MMAs of their own, a code pair one LOP3 into
      m16n8k16 fragments (`kivi_codes4`), float32 accumulation, online softmax in
      base 2. Where `launch.MMA_BLOCKS_PER_SM` names the pool's (dtype, bits) it is
      compiled under `__launch_bounds__` for that many blocks per SM (`mma_split_kernel`).
   b. `kivi_attend_split` (attend_split.cu) for the rest: 8-bit, G != 32, D 32/256.
      CUDA cores, float32 throughout; 4 warps per thread block share (b, h) and stage
      its query rows once; a warp step covers 256 tokens.
   Both: splits 0..S-1 cut the sequence's quantized blocks into chunks (split-K);
   splits S, S+1, ... are the fp16 tail in chunks of TAIL_ROWS rows, on the CUDA
   cores. Every warp computes all H_q / H_kv query heads of its kv head, so the codes
   are read once per group, and writes (m, l, acc) per query head. Only real positions
   are read: block ids up to num_blocks, tail rows up to tail_len. No mask, no
   padding, no fp16 K/V in global memory.
2. `kivi_attend_merge` (attend_merge.cu): one thread block per (b, query head), exact
   log-sum-exp merge of the splits, output cast to q's dtype; for a 2r pool
   (`rotate_out`) the output row is then rotated back out of the Hadamard basis.

A decode step builds the launches once for all layers (`AttendPlan`); each layer then
only launches. The plan may also take the step's new token and have the tail split
that holds its row write it into the pool (KIVI_TAIL_CHUNK in kivi.cuh): the engine
then builds no scatter per layer.

Numerics (vs the float32 reference; tests/test_kernels_gpu.py states the contracts):
  * CUDA-core kernel: `q * scale + zero` contracted to one FMA, softmax in base 2 with
    log2(e) folded into the query scale, sums in another order: about 1e-6 relative
    before the final cast.
  * MMA kernel: K_hat and V_hat never rounded; q, q * scale, p and p * scale rounded
    once each to the pool dtype, float32 sums.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import mlx.core as mx
import numpy as np

from kiviq.kernels.cuda_source import cuda_kernel
from kiviq.kernels.launch import (
    MMA_BLOCKS_PER_SM,
    MMA_STEP_TOKENS,
    POOL_NAMES,
    STEP_TOKENS,
    WARPS,
    attend_launch,
    attend_templates,
    const,
    const_values,
    packed_views,
)
from kiviq.kernels.layout import KiviPool, lane_order
from kiviq.kernels.qk_rope import PROLOGUE_DTYPES, PROLOGUE_HEAD_DIMS, Prologue

ATTEND_INPUTS = ["q", *POOL_NAMES, "block_tables", "num_blocks", "slots", "tail_lens",
                 "params", "qscale_in", "k_new", "v_new", "q_norm", "k_norm", "offsets", "rope"]
ATTEND_OUTPUTS = ["part_acc", "part_ml"]
MERGE_INPUTS = ["part_acc", "part_ml", "params"]
MERGE_WARPS = 16  # most warps of a merge block (its shared memory is sized for them)

ATTEND_KERNEL = cuda_kernel("attend_split.cu", name="kivi_attend_split", input_names=ATTEND_INPUTS,
                            output_names=ATTEND_OUTPUTS)


@functools.lru_cache(maxsize=None)
def mma_split_kernel(blocks_per_sm: int):
    """The MMA split kernel compiled for `blocks_per_sm` thread blocks per SM (its
    `__launch_bounds__`; 0: none). One kernel object per bound: MLX keys its compiled
    modules by the whole source's hash, so each bound is its own module."""
    return cuda_kernel("attend_split_mma.cu", name="kivi_attend_split_mma", input_names=ATTEND_INPUTS,
                       output_names=ATTEND_OUTPUTS,
                       bounds=(WARPS * 32, blocks_per_sm) if blocks_per_sm else None)


MERGE_KERNEL = cuda_kernel("attend_merge.cu", name="kivi_attend_merge", input_names=MERGE_INPUTS,
                           output_names=["out"])


def mma_supports(q_shape, pool: KiviPool, bits: int, group_size: int) -> str | None:
    """None when the tensor-core split kernel handles this call (on top of
    `kernels.launch.supports`), else why not; the CUDA-core kernel covers the rest."""
    d = q_shape[-1]
    if not lane_order(bits, group_size, d):  # the layouts it reads (kernels.layout)
        return f"bits={bits}, G={group_size}, D={d} (MMA kernel: bits 2/4, G=32, D 64/128)"
    return None


def device_meta(meta: list, params_new: mx.array, rope: tuple = (0.0, 0.0, 0.0),
                after: Sequence[mx.array] = ()) -> tuple[list, list, mx.array]:
    """`meta` and its new-token twin as views of one device array (`packed_views`),
    and the prologue's float32 constants `rope` (`qk_rope.Prologue.constants`) from it.
    That array is made after the arrays `after` (int32; one more element each, never
    read): so is every launch that reads it.

    The launch constants (both params, the query scale four times over and `rope`, as
    float32 bits) travel in one host array made for this plan. MLX keeps small
    host-made arrays in shared managed pages the host keeps writing, so every
    separate constant cost a page migration per step when the GPU read it
    (measured: ~250 us of device time each, ~1.6 ms per B=32 step in all)."""
    block_tables, num_blocks, slots, tail_lens, params, qscale = meta
    scale_bits = np.array(const_values(qscale), dtype=np.float32).view(np.int32)
    rope_bits = np.array([*rope, 0.0], dtype=np.float32).view(np.int32)
    extra = mx.array(np.concatenate([np.array(const_values(params), dtype=np.int32),
                                     np.array(const_values(params_new), dtype=np.int32),
                                     np.repeat(scale_bits, 4), rope_bits]))
    views = packed_views([block_tables, num_blocks, slots, tail_lens, extra, *after])
    params_d, params_new_d, scales = views[4][:6], views[4][6:12], views[4][12:16].view(mx.float32)
    rope_d = views[4][16:20].view(mx.float32)
    return views[:4] + [params_d, scales], views[:4] + [params_new_d, scales], rope_d


def merge_warps(num_splits: int) -> int:
    """Warps per merge block: about 8 splits per warp, 1 .. MERGE_WARPS."""
    return max(1, min(MERGE_WARPS, -(-num_splits // 8)))


class AttendPlan:
    """The launches of one decode step's attention, for every layer of a model.

    Built once per step from the shapes and the step's small int arrays (block
    tables, lengths: the same in every layer); calling it with a layer's q and pool
    only launches the split kernel and the merge (~45 us of Python per layer saved).
    `q_shape` is [B, H_q, D] or the model's [B, H_q, 1, D] (the same memory): the
    output has that shape. `after`: arrays its launches must follow (a decode step's
    in-place flush, `cuda_flush.step_flush`: its writes are no input of theirs).
    """

    __slots__ = ("split", "split_kw", "merge_kw", "meta", "meta_new", "params", "rope", "prologue")

    def __init__(self, q_shape, q_dtype, pool: KiviPool, block_tables, num_blocks, slots,
                 tail_lens, *, scale: float, bits: int, group_size: int, rotate_out: bool = False,
                 prologue: Prologue | None = None, after: Sequence[mx.array] = ()):
        out_shape = tuple(q_shape)
        q_shape = (q_shape[0], q_shape[1], q_shape[-1])
        b, h_q, d = q_shape
        if prologue is not None:
            reason = prologue_supports(q_shape, q_dtype, pool, prologue)
            if reason:
                raise ValueError(f"the decode prologue cannot run in the split kernel: {reason}")
        self.prologue = prologue
        mma = mma_supports(q_shape, pool, bits, group_size) is None
        meta, self.split_kw, nsu, rep = attend_launch(
            q_shape, q_dtype, pool, block_tables, num_blocks, slots, tail_lens, scale=scale,
            bits=bits, group_size=group_size, step_tokens=MMA_STEP_TOKENS if mma else STEP_TOKENS)
        # The same launch with params[5] = 1: the new token comes with the call.
        params_new = const(const_values(meta[4])[:5] + (1,), mx.int32)
        self.meta, self.meta_new, self.rope = device_meta(
            meta, params_new, prologue.constants() if prologue is not None else (0.0, 0.0, 0.0), after)
        self.params = self.meta[4]
        template, merge_template = attend_templates(q_dtype, pool, bits=bits,
                                                    group_size=group_size, rep=rep)
        if mma:
            self.split = mma_split_kernel(MMA_BLOCKS_PER_SM.get((pool.k_scales.dtype, bits), 0))
        else:
            self.split = ATTEND_KERNEL
        pro = prologue is not None
        self.split_kw["template"] = template + [("PRO", int(pro)), ("NORM", int(pro and prologue.norm)),
                                                ("ROT_IN", int(pro and prologue.rotate))]
        mw = merge_warps(nsu)
        self.merge_kw = dict(
            template=merge_template + [("MERGE_WARPS", MERGE_WARPS), ("ROTATE", int(rotate_out))],
            grid=(b * h_q * mw * 32, 1, 1),
            threadgroup=(mw * 32, 1, 1),
            output_shapes=[out_shape],
            output_dtypes=[q_dtype],
        )

    def __call__(self, q: mx.array, pool: KiviPool, k_new: mx.array | None = None,
                 v_new: mx.array | None = None) -> mx.array:
        """Attention of q over `pool` (a plan made without a prologue). With `k_new`,
        `v_new` ([B, H_kv, D] or the model's [B, H_kv, 1, D], the step's new token, in
        the pool's dtype) the tail's last row (tail_lens - 1) is read from them and
        written into the pool by the kernel: the caller writes no tail. Without them
        that row must already hold the token."""
        if self.prologue is not None:
            raise ValueError("this plan runs the decode prologue: call it with_prologue(qkv, ...)")
        # The prologue's inputs are never read (PRO = 0): arrays already at hand stand in.
        unused = [q, q, self.meta[1], self.rope]
        if k_new is None:
            inputs = [q, *pool, *self.meta, pool.tail_k, pool.tail_v, *unused]  # never read: params[5] = 0
        else:
            inputs = [q, *pool, *self.meta_new, k_new, v_new, *unused]
        return self._launch(inputs)

    def with_prologue(self, qkv: mx.array, pool: KiviPool, offsets: mx.array, q_norm: mx.array | None = None,
                      k_norm: mx.array | None = None) -> mx.array:
        """Attention of the step's fused q/k/v projection `qkv` ([B, 1, (H_q + 2 H_kv) D])
        over `pool`, the decode prologue (`prologue`: q/k norm with `q_norm`, `k_norm`,
        RoPE at `offsets` [B] int32, the 2r rotation) run inside the split kernel; the new
        token's k and v go into the tail as `__call__` writes `k_new`, `v_new`. Bits
        equal to `kernels.qk_rope.Prologue.reference` followed by `__call__`."""
        if self.prologue is None:
            raise ValueError("this plan was made without a prologue")
        if self.prologue.norm and (q_norm is None or k_norm is None):
            raise ValueError("the prologue normalizes q and k: give q_norm and k_norm")
        norms = [q_norm, k_norm] if self.prologue.norm else [qkv, qkv]  # never read: NORM = 0
        inputs = [qkv, *pool, *self.meta_new, pool.tail_k, pool.tail_v, *norms, offsets, self.rope]
        return self._launch(inputs)

    def _launch(self, inputs: list) -> mx.array:
        part_acc, part_ml = self.split(inputs=inputs, **self.split_kw)
        return MERGE_KERNEL(inputs=[part_acc, part_ml, self.params], **self.merge_kw)[0]


def prologue_supports(q_shape, q_dtype, pool: KiviPool, prologue: Prologue) -> str | None:
    """None when the split kernels can run `prologue` for attention of this shape
    over `pool` (`AttendPlan.with_prologue`), else why not."""
    h_q, d = q_shape[1], q_shape[-1]
    if (prologue.n_heads, prologue.n_kv_heads) != (h_q, pool.tail_k.shape[1]):
        return f"heads {prologue.n_heads}/{prologue.n_kv_heads} against q {h_q} and the pool's {pool.tail_k.shape[1]}"
    if d not in PROLOGUE_HEAD_DIMS or q_dtype not in PROLOGUE_DTYPES:
        return f"head_dim {d}, {q_dtype} (the prologue: head_dim 64 or 128, fp16 or bf16)"
    if q_dtype != pool.tail_k.dtype:
        return f"the model's {q_dtype} is not the pool's {pool.tail_k.dtype}"
    return None


def kivi_decode_attend(q: mx.array, pool: KiviPool, block_tables, num_blocks, slots, tail_lens, *,
                       scale: float, bits: int, group_size: int = 32) -> mx.array:
    """One decode step of attention over the KIVI pool: 2 CUDA launches, with the
    contract and arguments of `kernels.kivi_reference.decode_attention` (q [B, H_q, D];
    the pool's scales and tails fp16 or bf16). A caller that attends several layers
    with the same metadata builds one `AttendPlan` and calls it per layer instead."""
    if ATTEND_KERNEL is None:
        raise RuntimeError("MLX's CUDA backend is not available")
    if q.shape[0] == 0:
        return mx.zeros(q.shape, dtype=q.dtype)
    plan = AttendPlan(q.shape, q.dtype, pool, block_tables, num_blocks, slots, tail_lens,
                      scale=scale, bits=bits, group_size=group_size)
    return plan(q, pool)


__all__ = ["AttendPlan", "kivi_decode_attend", "mma_supports", "prologue_supports"]
