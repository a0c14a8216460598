"""An MLP's SwiGLU and its down projection for one row, in one CUDA launch.

The llama / qwen MLP is ``down(silu(gate) * up)``. In a decode step of one sequence MLX
runs the SwiGLU (one compiled elementwise kernel) and then the down projection
(``gemv_single``): two launches per layer, each mostly MLX's host work (~10 us), in a
step where host and device each need about as long as the other. ``swiglu_down`` does
both in one launch (kernels/cuda/swiglu_down.cu) with the same bits, so the tokens do
not change; ``swiglu_down_reference`` is the same computation with the stock ops: what
runs where the kernel does not, and what it is tested against. Batches of several rows
run the stock ops: their down projection is a cuBLAS matmul, whose sums this kernel
does not reproduce.
"""

from __future__ import annotations

import functools

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from kiviq.kernels.cuda_device import cuda_available, num_sms
from kiviq.kernels.cuda_source import cuda_kernel

DTYPES = (mx.float16, mx.bfloat16)
MAX_ROWS_PER_BLOCK = 32  # warps (output rows) per thread block: 1,024 threads
MAX_SHARED_BYTES = 48 * 1024  # a kernel's static shared memory: the SwiGLU of one row


@functools.cache
def _kernel(rows: int):
    """The kernel for blocks of ``rows`` warps, compiled to fit one such block per SM
    (`launch_bounds`: without it nvcc takes more registers than 1,024 threads have)."""
    return cuda_kernel("swiglu_down.cu", name="kivi_swiglu_down", input_names=["gu", "w"], output_names=["out"],
                       bounds=(32 * rows, 1), mlx_headers=("unary_ops.cuh", "binary_ops.cuh"))


def values_per_lane(hidden: int) -> int:
    """The values a lane reads per step for rows of ``hidden`` values: MLX 0.32's gemv
    n_per_thread (for aligned operands, which MLX's own arrays are). The lanes' sums,
    so the bits, depend on it."""
    return 4 if hidden % 128 == 0 else 2 if hidden % 64 == 0 else 1


def rows_per_block(out_size: int, sms: int) -> int:
    """Output rows (warps) per thread block: enough that the grid is one block per SM
    where the rows allow (each block makes the whole SwiGLU row once, and a second wave
    would run alone), at most 32."""
    return max(1, min(MAX_ROWS_PER_BLOCK, -(-out_size // sms)))


def loads_ahead(rows: int) -> int:
    """W's chunks (NPT values) a lane keeps loading ahead of its sums: 16, or 8 where a
    block has more than 20 warps (at 1,024 threads a thread has 64 registers)."""
    return 8 if rows > 20 else 16


def supported(hidden: int, dtype: mx.Dtype) -> bool:
    """Whether the kernel runs here for an MLP of ``hidden`` intermediate values."""
    return (cuda_available() and dtype in DTYPES and hidden % 8 == 0
            and hidden * dtype.size <= MAX_SHARED_BYTES)


def swiglu_down(gate_up: mx.array, weight: mx.array) -> mx.array:
    """``down(silu(gate) * up)`` for one row in one CUDA launch. gate_up: [..., 2F], the
    gate's F columns then the up's (the fused gate/up projection's output), one row in
    all; weight: the down projection's [N, F]. Operands it does not take (several rows,
    dtypes that differ, shapes that do not fit) get the stock ops."""
    out_size, hidden = weight.shape
    if (gate_up.size != 2 * hidden or gate_up.shape[-1] != 2 * hidden or gate_up.dtype != weight.dtype
            or not supported(hidden, weight.dtype)):
        return swiglu_down_reference(gate_up, weight)
    rows = rows_per_block(out_size, num_sms())
    blocks = -(-out_size // rows)
    return _kernel(rows)(
        inputs=[gate_up, weight],
        template=[("T", weight.dtype), ("F", hidden), ("N", out_size), ("ROWS", rows),
                  ("NPT", values_per_lane(hidden)), ("LOADS_AHEAD", loads_ahead(rows))],
        grid=(blocks * 32 * rows, 1, 1), threadgroup=(32 * rows, 1, 1),
        output_shapes=[(*gate_up.shape[:-1], out_size)], output_dtypes=[weight.dtype])[0]


def swiglu_down_reference(gate_up: mx.array, weight: mx.array) -> mx.array:
    """`swiglu_down` with the stock ops, as mlx-lm's MLP computes it (any backend)."""
    hidden = weight.shape[1]
    return (nn.silu(gate_up[..., :hidden]) * gate_up[..., hidden:]) @ weight.T


def check(hidden: int, out_size: int, dtype: mx.Dtype) -> str | None:
    """Run the kernel once on a random row against the stock ops: None when every bit
    agrees, else a one-line reason (a mismatch, or the error its compile or launch
    raised). A caller that gets a reason keeps the stock ops."""
    rng = np.random.default_rng(hidden + out_size)
    gate_up = rng.standard_normal((1, 1, 2 * hidden)) * 2.0
    weight = rng.standard_normal((out_size, hidden)) / np.sqrt(hidden)
    gate_up, weight = (mx.array(a.astype(np.float32), dtype=dtype) for a in (gate_up, weight))
    try:
        got = swiglu_down(gate_up, weight)
        mx.eval(got)
    except Exception as e:  # noqa: BLE001 - a compile or launch error is the answer
        return f"swiglu_down raised {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    want = swiglu_down_reference(gate_up, weight)
    differ = int(np.count_nonzero(np.array(got.view(mx.uint16)) != np.array(want.view(mx.uint16))))
    if differ:
        return f"swiglu_down differs from the stock ops in {differ} of {got.size} values"
    return None


__all__ = ["check", "loads_ahead", "rows_per_block", "supported", "swiglu_down", "swiglu_down_reference",
           "values_per_lane"]
