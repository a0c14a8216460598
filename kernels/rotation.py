"""Orthogonal rotations of K and V along head_dim, before KIVI quantization.

A rotation spreads a few large channels over all of them, so a quantization group
(values: G consecutive channels of one token) no longer has its range set by one
outlier. With an orthogonal M (M @ M.T = I) attention is unchanged in exact
arithmetic: scores q . k = (q M) . (k M), and the output sum_t p_t v_t M is rotated
back by M.T. So a cache may store quantize(k M), quantize(v M) and either rotate q
and the output (a kernel) or rotate the dequantized K, V back (a reference or a
simulation): the two are the same in exact arithmetic.

The matrix is the normalized Sylvester-Hadamard matrix H_n / sqrt(n) (n a power of
two; entries +-1/sqrt(n)), optionally with its rows multiplied by a fixed random
+-1 sign per channel (``seed``): diag(s) @ H is orthogonal too, and breaks the
Hadamard pattern's alignment with structured channels.

The store (``--kv-bits 2r``: ``KVConfig.rotate``) uses the plain normalized matrix
through ``hadamard_rotate``: one ``mx.hadamard_transform`` op per tensor, no
constant. H = H.T = H^-1, so the same call rotates into the cache's basis and back
out of it. On CUDA the decode step does these rotations inside its kernels instead
(``kivi_hadamard8`` in kernels/cuda/kivi.cuh, the same bits). The simulation's ``rotate`` / ``unrotate`` keep their float32 matmuls.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np


def hadamard(n: int, seed: int | None = None) -> mx.array:
    """The orthogonal [n, n] float32 matrix diag(s) @ H_n / sqrt(n).

    Args:
        n: size, a power of two (head_dim).
        seed: None for s = 1; else s = random +-1 signs from numpy's default_rng(seed).

    Raises:
        ValueError: n is not a power of two.
    """
    if n < 1 or n & (n - 1):
        raise ValueError(f"Hadamard size must be a power of two, got {n}")
    h = np.ones((1, 1))
    while h.shape[0] < n:  # Sylvester: H_2m = [[H, H], [H, -H]], exact in float64
        h = np.block([[h, h], [h, -h]])
    h = h / np.sqrt(n)
    if seed is not None:
        signs = np.random.default_rng(seed).choice([-1.0, 1.0], size=n)
        h = signs[:, None] * h
    return mx.array(h.astype(np.float32))


def rotate(x: mx.array, m: mx.array) -> mx.array:
    """x [..., n] -> x @ m, in float32 (the rotated channels)."""
    return x.astype(mx.float32) @ m


def unrotate(x: mx.array, m: mx.array) -> mx.array:
    """Inverse of `rotate` for an orthogonal m: x @ m.T, in float32."""
    return x.astype(mx.float32) @ m.T


def check_rotation(head_dim: int) -> None:
    """Raise ValueError unless ``hadamard_rotate`` applies to rows of ``head_dim``.

    Only powers of two: ``mx.hadamard_transform`` also takes 12, 20 or 28 times a
    power of two, but those matrices are not symmetric, so the transform would not
    be its own inverse.
    """
    if head_dim < 2 or head_dim & (head_dim - 1) or head_dim > 8192:
        raise ValueError(f"the Hadamard rotation of K and V (kv_bits 2r) needs a power-of-two head_dim "
                         f"(2 .. 8192), got {head_dim}")


def hadamard_rotate(x: mx.array) -> mx.array:
    """x [..., n] -> x @ H, H = ``hadamard(n)`` (normalized Sylvester, symmetric,
    orthogonal), along the last axis, in x's dtype: one ``mx.hadamard_transform``.

    Its own inverse: ``hadamard_rotate(hadamard_rotate(x)) == x`` up to rounding.
    Rounding against float32 math, measured (MLX 0.32.4, n = 64..256, error per
    element over the row's RMS, u = unit roundoff of x's dtype): float32 input mean
    1.0 u, max 8 u (a float32 matmul with the matrix: mean 2-4 u, max 22-52 u);
    fp16/bf16 on the CPU backend, which adds in x's dtype stage by stage, mean 1.0 u,
    max 10 u (one final rounding: mean 0.3 u, max 3.7 u). MLX's CUDA kernel adds
    in float32 and rounds to x's dtype after each of its passes (radix 16, then
    the rest) and after the scale: three roundings at n = 64..256 (read in MLX's
    source; kernels/cuda/kivi.cuh reproduces it bit for bit). Either way far below the 2-bit quantization error the rotation is there
    to shrink; a float32 matmul would be no more exact and is as many ops.
    """
    return mx.hadamard_transform(x)
