"""A decode step's q, k and v from the fused q/k/v projection, as attention reads them.

mlx-lm's attention turns the projection's [B, 1, (H_q + 2 H_kv) D] row into heads
with three strided copies, normalizes q and k per head (Qwen3: two ``rms_norm``
launches) and rotates them (two ``rope`` launches); a rotated cache (``--kv-bits
2r``) also wants q, k and v Hadamard-rotated along D (three ``mx.hadamard_transform``
launches). A decode step's time is mostly MLX's host work per op, so on CUDA the
split attention kernels do all of that themselves (``Prologue`` describes it to
``kernels.cuda_attend.AttendPlan.with_prologue``; the device code is
kernels/cuda/kivi_prologue.cuh), with the same bits.
``qk_rope_reference`` is the same computation with the stock ops: what the kernels
are tested against, and what runs where they do not.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import math
from dataclasses import dataclass

import mlx.core as mx

from kiviq.kernels.rotation import hadamard_rotate

PROLOGUE_HEAD_DIMS = (64, 128)
PROLOGUE_DTYPES = (mx.float16, mx.bfloat16)


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


@dataclass(frozen=True)
class Prologue:
    """How one attention layer's decode step makes q, k and v from its projection row:
    heads split, q and k RMS-normalized (``norm``: with the layer's q_norm and k_norm
    weights, ``eps``), rotate-half RoPE over all D dims at each sequence's position
    (``rope_base``, ``rope_scale``), and with ``rotate`` all three Hadamard-rotated
    (a 2r cache's basis). The same for every layer of a model."""

    n_heads: int
    n_kv_heads: int
    rope_base: float
    rope_scale: float = 1.0
    eps: float = 0.0
    norm: bool = False
    rotate: bool = False

    def constants(self) -> tuple[float, float, float]:
        """(eps, log2 of the RoPE base, RoPE scale): the kernels' float constants."""
        return (float(self.eps), _log2f(self.rope_base), float(self.rope_scale))

    def reference(self, qkv: mx.array, offsets: mx.array, q_norm: mx.array | None = None,
                  k_norm: mx.array | None = None) -> tuple[mx.array, mx.array, mx.array]:
        """``qk_rope_reference`` of this prologue."""
        return qk_rope_reference(qkv, offsets, n_heads=self.n_heads, n_kv_heads=self.n_kv_heads,
                                 rope_base=self.rope_base, rope_scale=self.rope_scale,
                                 q_weight=q_norm if self.norm else None, k_weight=k_norm if self.norm else None,
                                 eps=self.eps, rotate=self.rotate)


def qk_rope_reference(qkv: mx.array, offsets: mx.array, *, n_heads: int, n_kv_heads: int,
                      rope_base: float, rope_scale: float = 1.0, q_weight: mx.array | None = None,
                      k_weight: mx.array | None = None, eps: float = 0.0,
                      rotate: bool = False) -> tuple[mx.array, mx.array, mx.array]:
    """(q [B, H_q, 1, D], k, v [B, H_kv, 1, D]) from qkv [B, 1, (H_q + 2 H_kv) D]
    with the ops mlx-lm's attention and a rotated cache use (any backend): heads
    split, q and k normalized when the norm weights are given (RMSNorm, eps), then
    rotated (rotate-half RoPE over all D dims) at each sequence's position ``offsets``
    [B] (int32); with ``rotate`` q, k and v then go through
    ``kernels.rotation.hadamard_rotate``."""
    b, length, width = qkv.shape
    d = width // (n_heads + 2 * n_kv_heads)
    if length != 1 or d * (n_heads + 2 * n_kv_heads) != width:
        raise ValueError(f"qk_rope: qkv {qkv.shape} is not one token of {n_heads} + 2 x {n_kv_heads} heads")
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


__all__ = ["PROLOGUE_DTYPES", "PROLOGUE_HEAD_DIMS", "Prologue", "qk_rope_reference"]
