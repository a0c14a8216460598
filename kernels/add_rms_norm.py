"""A residual add and the RMSNorm that follows it, in one CUDA launch.

Every decoder layer of the llama / qwen families runs ``h = x + r`` then an RMSNorm of
``h`` twice (after attention, and after the MLP where the norm is the next layer's or
the model's final one). In a decode step each of those is a launch whose time is
mostly MLX's host work per op (~10 us); ``add_rms_norm`` does both in one launch
(kernels/cuda/add_rms_norm.cu) with the same bits as MLX's add and ``rms_norm``, so
the tokens do not change. ``add_rms_norm_reference`` is the same computation with the
stock ops: what runs where the kernel does not, and what the kernel is tested against.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from kiviq.kernels.cuda_source import cuda_kernel

DTYPES = (mx.float16, mx.bfloat16)
VALUES_PER_THREAD = 8  # one 16-byte load of fp16 / bf16, as MLX's rms_norm reads them
MAX_SIZE = VALUES_PER_THREAD * 128 * 8  # MLX's rms_norm_small covers rows up to this

ADD_RMS_NORM_KERNEL = cuda_kernel("add_rms_norm.cu", name="kivi_add_rms_norm",
                                  input_names=["x", "r", "w"], output_names=["h", "y"])


def norm_plan(size: int) -> tuple[int, int]:
    """(threads per row, 8-value chunks per thread) that MLX 0.32's CUDA rms_norm picks
    for rows of ``size`` fp16 / bf16 values (``dispatch_num_chunks``): the kernel must
    add the squares in the same groups to give the same bits."""
    vectors = -(-size // VALUES_PER_THREAD)
    if size <= VALUES_PER_THREAD * 64:
        return 64, 1
    if vectors % 128 == 0 and vectors // 128 <= 8:
        return 128, vectors // 128
    if vectors % 64 == 0 and vectors // 64 <= 8:
        return 64, vectors // 64
    return 128, min(-(-vectors // 128), 8)


def float32_bits(value: float) -> int:
    """The bits of ``value`` as a float32, as a signed int: how eps reaches the kernel
    (a template argument; the kernel reads it back with ``__int_as_float``)."""
    return int(np.array(value, dtype=np.float32).view(np.int32))


def supported(size: int, dtype: mx.Dtype) -> bool:
    """Whether the kernel runs here for rows of ``size`` values of ``dtype``."""
    return (ADD_RMS_NORM_KERNEL is not None and dtype in DTYPES and size % VALUES_PER_THREAD == 0
            and size <= MAX_SIZE)


def add_rms_norm(x: mx.array, r: mx.array, weight: mx.array, eps: float) -> tuple[mx.array, mx.array]:
    """(h, y): h = x + r and y = ``mx.fast.rms_norm(h, weight, eps)``, in one CUDA launch.
    x, r: [..., N] of one dtype; weight: [N]. `supported` says where it runs; operands
    it does not take (shapes or dtypes that differ) get the stock ops."""
    size = x.shape[-1]
    if r.shape != x.shape or r.dtype != x.dtype or weight.dtype != x.dtype or weight.shape != (size,):
        return add_rms_norm_reference(x, r, weight, eps)
    threads, chunks = norm_plan(size)
    rows = x.size // size
    return tuple(ADD_RMS_NORM_KERNEL(
        inputs=[x, r, weight],
        template=[("T", x.dtype), ("N", size), ("BLOCK", threads), ("CHUNKS", chunks),
                  ("EPS_BITS", float32_bits(eps))],
        grid=(rows * threads, 1, 1), threadgroup=(threads, 1, 1),
        output_shapes=[x.shape, x.shape], output_dtypes=[x.dtype, x.dtype]))


def add_rms_norm_reference(x: mx.array, r: mx.array, weight: mx.array,
                           eps: float) -> tuple[mx.array, mx.array]:
    """`add_rms_norm` with the stock ops (any backend)."""
    h = x + r
    return h, mx.fast.rms_norm(h, weight, eps)


def check(size: int, dtype: mx.Dtype, eps: float = 1e-6) -> str | None:
    """Run the kernel once on random rows of ``size`` values against the stock ops: None
    when every bit agrees, else a one-line reason (a mismatch, or the error its compile
    or launch raised). A caller that gets a reason keeps the stock ops."""
    rng = np.random.default_rng(size)
    x = rng.standard_normal((5, 1, size)) * rng.uniform(0.05, 8.0, size)
    r = rng.standard_normal((5, 1, size)) * 0.5
    w = rng.uniform(0.2, 2.0, size)
    x, r, w = (mx.array(a.astype(np.float32), dtype=dtype) for a in (x, r, w))
    try:
        got = add_rms_norm(x, r, w, eps)
        mx.eval(got)
    except Exception as e:  # noqa: BLE001 - a compile or launch error is the answer
        return f"add_rms_norm raised {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    for name, g, e in zip(("sum", "norm"), got, add_rms_norm_reference(x, r, w, eps)):
        differ = int(np.count_nonzero(np.array(g.view(mx.uint16)) != np.array(e.view(mx.uint16))))
        if differ:
            return f"add_rms_norm's {name} differs from the stock ops in {differ} of {g.size} values"
    return None


__all__ = ["add_rms_norm", "add_rms_norm_reference", "check", "norm_plan", "supported"]
