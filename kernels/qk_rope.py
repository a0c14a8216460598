"""A decode step's q, k and v from the fused q/k/v projection, as attention reads them.

mlx-lm's attention turns the projection's [B, 1, (H_q + 2 H_kv) D] row into heads
with three strided copies, normalizes q and k per head (Qwen3: two ``rms_norm``
launches) and rotates them (two ``rope`` launches): seven ops per layer in a decode
step whose time is mostly MLX's host work per op. On CUDA ``qk_rope`` is one launch
(kernels/cuda/qk_rope.cu) that gives the same bits; ``qk_rope_reference`` is the
same computation with the stock ops, what the kernel is tested against. A rotated
cache (``--kv-bits 2r``) also wants q, k and v Hadamard-rotated along D (three
``mx.hadamard_transform`` launches per layer): ``rotate=True`` does that in the same
launch, with the same bits.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import math

import mlx.core as mx

from kiviq.kernels.cuda_source import cuda_kernel
from kiviq.kernels.launch import const
from kiviq.kernels.rotation import hadamard_rotate

HEAD_DIMS = (64, 128)
DTYPES = (mx.float16, mx.bfloat16)

QK_ROPE_KERNEL = cuda_kernel("qk_rope.cu", name="kivi_qk_rope",
                             input_names=["qkv", "q_weight", "k_weight", "offsets", "params"],
                             output_names=["q", "k", "v"])


@functools.lru_cache(maxsize=16)
def _log2f(x: float) -> float:
    """log2 in float32 as MLX's rope computes its base on the host (C's log2f), so
    the kernel's angles are MLX's to the bit; Python's double log2 rounded to float32
    can differ in the last bit."""
    libm = ctypes.util.find_library("m")
    if libm:
        f = ctypes.CDLL(libm).log2f
        f.restype, f.argtypes = ctypes.c_float, [ctypes.c_float]
        return f(x)
    return float(mx.array(math.log2(x), dtype=mx.float32))


def supported(head_dim: int, dtype: mx.Dtype) -> bool:
    return QK_ROPE_KERNEL is not None and head_dim in HEAD_DIMS and dtype in DTYPES


def qk_rope(qkv: mx.array, offsets: mx.array, *, n_heads: int, n_kv_heads: int,
            rope_base: float, rope_scale: float = 1.0, q_weight: mx.array | None = None,
            k_weight: mx.array | None = None, eps: float = 0.0,
            rotate: bool = False) -> tuple[mx.array, mx.array, mx.array]:
    """(q [B, H_q, 1, D], k, v [B, H_kv, 1, D]) from qkv [B, 1, (H_q + 2 H_kv) D]:
    heads split, q and k normalized when the norm weights are given (RMSNorm, eps),
    then rotated (rotate-half RoPE over all D dims) at each sequence's position
    ``offsets`` [B] (int32); with ``rotate`` q, k and v then go through
    ``kernels.rotation.hadamard_rotate`` (a 2r cache's basis). One CUDA launch;
    `supported` says where it runs."""
    b, length, width = qkv.shape
    d = width // (n_heads + 2 * n_kv_heads)
    if length != 1 or d * (n_heads + 2 * n_kv_heads) != width:
        raise ValueError(f"qk_rope: qkv {qkv.shape} is not one token of {n_heads} + 2 x {n_kv_heads} heads")
    norm = q_weight is not None
    unused = const((0,), qkv.dtype)
    params = const((float(eps), _log2f(rope_base), float(rope_scale)), mx.float32)
    return tuple(QK_ROPE_KERNEL(
        inputs=[qkv, q_weight if norm else unused, k_weight if norm else unused, offsets, params],
        template=[("T", qkv.dtype), ("D", d), ("HQ", n_heads), ("HKV", n_kv_heads), ("NORM", int(norm)),
                  ("ROTATE", int(rotate))],
        grid=(32 * (n_heads + 2 * n_kv_heads), b, 1), threadgroup=(32, 1, 1),
        output_shapes=[(b, n_heads, 1, d), (b, n_kv_heads, 1, d), (b, n_kv_heads, 1, d)],
        output_dtypes=[qkv.dtype] * 3))


def qk_rope_reference(qkv: mx.array, offsets: mx.array, *, n_heads: int, n_kv_heads: int,
                      rope_base: float, rope_scale: float = 1.0, q_weight: mx.array | None = None,
                      k_weight: mx.array | None = None, eps: float = 0.0,
                      rotate: bool = False) -> tuple[mx.array, mx.array, mx.array]:
    """`qk_rope` with the ops mlx-lm's attention and a rotated cache use (any backend)."""
    b, length, width = qkv.shape
    d = width // (n_heads + 2 * n_kv_heads)
    q, k, v = mx.split(qkv, [n_heads * d, (n_heads + n_kv_heads) * d], axis=-1)
    q = q.reshape(b, length, n_heads, d)
    k = k.reshape(b, length, n_kv_heads, d)
    if q_weight is not None:
        q = mx.fast.rms_norm(q, q_weight, eps)
        k = mx.fast.rms_norm(k, k_weight, eps)
    q, k = (x.transpose(0, 2, 1, 3) for x in (q, k))
    v = v.reshape(b, length, n_kv_heads, d).transpose(0, 2, 1, 3)
    q = mx.fast.rope(q, d, traditional=False, base=rope_base, scale=rope_scale, offset=offsets)
    k = mx.fast.rope(k, d, traditional=False, base=rope_base, scale=rope_scale, offset=offsets)
    if rotate:
        q, k, v = (hadamard_rotate(x) for x in (q, k, v))
    return q, k, v


__all__ = ["qk_rope", "qk_rope_reference", "supported"]
