"""KIVI packing and (de)quantization in plain mlx ops: the bit-exact contract.

Layout of the results: see `kernels.layout` (k_codes [N, H_kv, D, G // P], ...).

Quantization contract, for one group x_1..x_n (n = G; finite inputs within the
storage dtype's range; L = 2^b - 1; all arithmetic IEEE float32, round to nearest even):
    mn, mx_ = min(x), max(x)                      over real values only (full blocks)
    zero    = cast_sd(mn)                         sd = storage dtype, fp16 or bf16
    scale   = cast_sd((mx_ - mn) / L)             f32 subtract, f32 *true* division
    q_i     = clip(round((x_i - f32(zero)) / f32(scale)), 0, L)    round half to even
    q_i     = 0 where scale == 0                  (constant group, or scale underflow)
Dequantization:
    x_hat_i = f32(q_i) * f32(scale) + f32(zero)   a multiply then an add, each rounded
    then a cast to the compute dtype, if any, at the very end.

Parity notes for kernels:
  * Quantize has no a*b+c pattern, so a flush kernel can and must match codes, scales
    and zeros bit for bit: IEEE division (no fast-math reciprocal, no `x * (1/scale)`),
    round with CUDA `rintf` / Metal `rint` (Metal `round` is half away from zero).
  * Dequantize: these separate ops round the product before the add. A kernel that
    contracts to an FMA rounds once; x_hat then differs by about one float32 ulp of
    max(|q * scale|, |x_hat|) at most, far below fp16 resolution. Kernel parity tests
    on dequantized values must allow that (or compile with contraction off); attention
    outputs use tolerances anyway. Do not wrap this reference in `mx.compile`: fused
    code may contract too.

Error bound (tested): with r = mx_ - mn, s = f32(scale), z = f32(zero),
    |x_hat_i - x_i| <= max(s / 2,  L * |s - r / L| + |z - mn|)  + f32 rounding slack.
Inside [z, z + L*s] rounding to the nearest level costs at most s/2. Because zero and
scale are rounded to the storage dtype, that interval can miss the group's ends:
below z the code clips to 0 (error <= |z - mn|), above z + L*s it clips to L (error
<= r - L*s + (mn - z)). With unit roundoff u (fp16 2^-11, bf16 2^-8),
L * |s - r/L| <= L * u * s (normal range), so the clip term is ~0.0015 s at 2 bits,
~0.007 s at 4 bits and ~0.12 s at 8 bits in fp16 -- but ~1.0 s at 8 bits in bf16,
where the group maximum can therefore be off by about a whole step (measured 0.80 s).
|z - mn| <= u * |mn| matters for narrow groups far from zero (it can exceed s then);
it too is paid only by values that clip.
Interior values never see the rounding of zero: codes come from the stored zero.

Measured: these ops give bit-identical codes, scales and zeros on CPU and on CUDA
(mlx 0.32.4, H200), so the contract does not depend on the device.
"""

from __future__ import annotations

import functools

import mlx.core as mx
import numpy as np

from kiviq.kernels.layout import (
    check_layout,
    codes_per_byte,
    key_lane_positions,
    lane_order,
    value_lane_positions,
)


def pack(codes: mx.array, bits: int) -> mx.array:
    """Pack b-bit codes along the last axis, P = 8 // b per byte, low bits first.

    Args:
        codes: integer codes in [0, 2^b), shape [..., n] with n % P == 0.
        bits: b, in {2, 4, 8}.

    Returns:
        uint8 array [..., n // P]; code j of each group of P sits at bits [j*b, j*b+b).
    """
    p = codes_per_byte(bits)
    n = codes.shape[-1]
    if n % p != 0:
        raise ValueError(f"last axis ({n}) must be a multiple of {p} to pack {bits}-bit codes")
    # Masking keeps an out-of-range code from spilling into its neighbours' bits.
    c = codes.astype(mx.uint8) & ((1 << bits) - 1)
    if p == 1:
        return c
    c = c.reshape(*codes.shape[:-1], n // p, p)
    # P strided elementwise ops: a reduction over an axis of 2 or 4 codes ran as a
    # row reduce on CUDA, a third of a prefill's device time (measured).
    out = c[..., 0]
    for j in range(1, p):
        out = out | (c[..., j] << (j * bits))
    return out


def unpack(packed: mx.array, bits: int) -> mx.array:
    """Inverse of `pack`: uint8 [..., m] -> uint8 codes [..., m * P]."""
    p = codes_per_byte(bits)
    if p == 1:
        return packed.astype(mx.uint8)
    packed = packed.astype(mx.uint8)
    mask = (1 << bits) - 1
    # P contiguous shift/mask ops and one stack: ~3x faster on CPU than one
    # broadcast against a [P] shift vector (tiny inner dimension).
    codes = mx.stack([(packed >> (j * bits)) & mask for j in range(p)], axis=-1)
    return codes.reshape(*packed.shape[:-1], packed.shape[-1] * p)


def default_scale_dtype(x_dtype: mx.Dtype) -> mx.Dtype:
    """Scales/zeros are bf16 for a bf16 model and fp16 otherwise."""
    return mx.bfloat16 if x_dtype == mx.bfloat16 else mx.float16


def quantize_groups(
    x: mx.array, bits: int, scale_dtype: mx.Dtype
) -> tuple[mx.array, mx.array, mx.array]:
    """Quantize groups along the last axis by the module's contract.

    Args:
        x: [..., n], one group per row, any float dtype.
        bits: b.
        scale_dtype: storage dtype of scale and zero.

    Returns:
        (codes uint8 [..., n] unpacked, scale [...], zero [...]).
    """
    levels = (1 << bits) - 1
    xf = x.astype(mx.float32)
    mn = mx.min(xf, axis=-1)
    mx_ = mx.max(xf, axis=-1)
    zero = mn.astype(scale_dtype)
    scale = ((mx_ - mn) / levels).astype(scale_dtype)
    # Codes come from the stored (rounded) zero and scale, so dequantization agrees.
    zf = zero.astype(mx.float32)[..., None]
    sf = scale.astype(mx.float32)[..., None]
    flat = sf == 0
    q = mx.round((xf - zf) / mx.where(flat, 1.0, sf))
    q = mx.where(flat, 0.0, mx.clip(q, 0, levels))
    return q.astype(mx.uint8), scale, zero


def dequantize_groups(codes: mx.array, scale: mx.array, zero: mx.array) -> mx.array:
    """codes [..., n] (unpacked), scale/zero [...] -> float32 [..., n]."""
    # Two rounded ops on purpose (no FMA): this is the pinned reference.
    prod = codes.astype(mx.float32) * scale.astype(mx.float32)[..., None]
    return prod + zero.astype(mx.float32)[..., None]


def quantize_key_blocks(
    k: mx.array, *, bits: int, scale_dtype: mx.Dtype | None = None
) -> tuple[mx.array, mx.array, mx.array]:
    """Quantize key blocks per channel over each block's G tokens.

    Args:
        k: [N, H_kv, G, D], token-major as the model produces it.
        bits: b.
        scale_dtype: storage dtype; default bf16 for bf16 input, else fp16.

    Returns:
        codes uint8 [N, H_kv, D, G // P], scales [N, H_kv, D], zeros [N, H_kv, D].
    """
    check_layout(bits, k.shape[-2])
    sd = scale_dtype or default_scale_dtype(k.dtype)
    # kt: [N, H_kv, D, G] -- one group per channel.
    codes, scales, zeros = quantize_groups(mx.swapaxes(k, -1, -2), bits, sd)
    return _to_lane_order(pack(codes, bits), bits, key=True), scales, zeros


def quantize_value_blocks(
    v: mx.array, *, bits: int, scale_dtype: mx.Dtype | None = None
) -> tuple[mx.array, mx.array, mx.array]:
    """Quantize value blocks per token, in groups of G consecutive channels.

    Args:
        v: [N, H_kv, G, D]; the channel group size is the block size G; D % G == 0.
        bits: b.
        scale_dtype: storage dtype; default bf16 for bf16 input, else fp16.

    Returns:
        codes uint8 [N, H_kv, G, D // P], scales [N, H_kv, D // G, G] (group-major:
        a channel group's tokens adjacent), zeros alike.
    """
    n, h, g, d = v.shape
    check_layout(bits, g, d)
    sd = scale_dtype or default_scale_dtype(v.dtype)
    # vg: [N, H_kv, G, D // G, G] -- one group per (token, channel group).
    codes, scales, zeros = quantize_groups(v.reshape(n, h, g, d // g, g), bits, sd)
    return (_to_lane_order(pack(codes.reshape(n, h, g, d), bits), bits, key=False),
            mx.swapaxes(scales, -1, -2), mx.swapaxes(zeros, -1, -2))


def dequantize_key_blocks(
    codes: mx.array, scales: mx.array, zeros: mx.array, *, bits: int,
    dtype: mx.Dtype = mx.float32,
) -> mx.array:
    """codes [..., D, G // P], scales/zeros [..., D] -> [..., G, D] in dtype."""
    x = dequantize_groups(unpack(plain_key_codes(codes, bits), bits), scales, zeros)
    return mx.swapaxes(x, -1, -2).astype(dtype)


def dequantize_value_blocks(
    codes: mx.array, scales: mx.array, zeros: mx.array, *, bits: int,
    dtype: mx.Dtype = mx.float32,
) -> mx.array:
    """codes [..., G, D // P], scales/zeros [..., D // G, G] -> [..., G, D] in dtype.

    Blocks usually come as [N, H_kv, ...]; any leading axes work.
    """
    q = unpack(plain_value_codes(codes, bits), bits)
    ng = scales.shape[-2]
    x = dequantize_groups(q.reshape(*q.shape[:-1], ng, q.shape[-1] // ng),
                          mx.swapaxes(scales, -1, -2), mx.swapaxes(zeros, -1, -2))
    return x.reshape(q.shape).astype(dtype)


def _lane_index(codes: mx.array, bits: int, key: bool, to_lane: bool) -> mx.array | None:
    """The gather index that takes a tile of `codes` (key [..., D, G // P] or value
    [..., G, D // P]) to lane order (`to_lane`) or back to plain order; None where its
    layout keeps plain order (`kernels.layout`)."""
    p = codes_per_byte(bits)
    g, d = (codes.shape[-1] * p, codes.shape[-2]) if key else (codes.shape[-2], codes.shape[-1] * p)
    return _tile_index(d, bits, key, to_lane) if lane_order(bits, g, d) else None


@functools.lru_cache(maxsize=None)
def _tile_index(d: int, bits: int, key: bool, to_lane: bool) -> mx.array:
    # Made once: a host-made array per call would cost its creation and, on a GPU, a
    # page migration at every use (prefill quantizes K and V of every layer).
    pos = key_lane_positions(d, bits) if key else value_lane_positions(d, bits)
    return mx.array(np.argsort(pos).astype(np.int32) if to_lane else pos)


def _permute_tiles(codes: mx.array, index: mx.array | None) -> mx.array:
    """Each tile's (last two axes') bytes gathered by `index` (None: unchanged)."""
    if index is None:
        return codes
    *lead, rows, row = codes.shape
    return mx.take(codes.reshape(*lead, rows * row), index, axis=-1).reshape(codes.shape)


def _to_lane_order(codes: mx.array, bits: int, key: bool) -> mx.array:
    """Packed codes in plain order -> as the pool stores them (lane order where it applies)."""
    return _permute_tiles(codes, _lane_index(codes, bits, key, to_lane=True))


def plain_key_codes(codes: mx.array, bits: int) -> mx.array:
    """Key codes [..., D, G // P] as the pool stores them -> plain order (`kernels.layout`)."""
    return _permute_tiles(codes, _lane_index(codes, bits, key=True, to_lane=False))


def plain_value_codes(codes: mx.array, bits: int) -> mx.array:
    """Value codes [..., G, D // P] as the pool stores them -> plain order."""
    return _permute_tiles(codes, _lane_index(codes, bits, key=False, to_lane=False))


def tokens_to_blocks(x: mx.array, group_size: int) -> mx.array:
    """[H_kv, S, D] -> [S // G, H_kv, G, D]: the full blocks; the S % G rest is dropped."""
    h, s, d = x.shape
    n = s // group_size
    x = x[:, : n * group_size].reshape(h, n, group_size, d)
    return mx.swapaxes(x, 0, 1)


def blocks_to_tokens(x: mx.array) -> mx.array:
    """[N, H_kv, G, D] -> [H_kv, N * G, D], inverse of `tokens_to_blocks`."""
    n, h, g, d = x.shape
    return mx.swapaxes(x, 0, 1).reshape(h, n * g, d)


def fake_quantize_keys(k: mx.array, bits: int, group_size: int,
                       scale_dtype: mx.Dtype = mx.float16) -> mx.array:
    """Quantize then dequantize keys as the cache does: what a reader of the blocks sees.

    For simulations (no packing, so any group size dividing S works). Keys are
    quantized per channel over each group of ``group_size`` consecutive tokens.

    Args:
        k: [..., S, D] with S % group_size == 0, the tokens to quantize.

    Returns:
        float32 [..., S, D]; equals dequantize_key_blocks(quantize_key_blocks(...)).
    """
    *lead, s, d = k.shape
    g = group_size
    if s % g:
        raise ValueError(f"{s} tokens are not whole groups of {g}")
    # [..., S//G, G, D] -> [..., S//G, D, G]: one group per (token group, channel).
    kt = mx.swapaxes(k.reshape(*lead, s // g, g, d), -1, -2)
    x = dequantize_groups(*quantize_groups(kt, bits, scale_dtype))
    return mx.swapaxes(x, -1, -2).reshape(*lead, s, d)


def fake_quantize_values(v: mx.array, bits: int, group_size: int,
                         scale_dtype: mx.Dtype = mx.float16) -> mx.array:
    """Quantize then dequantize values as the cache does (per token, groups of
    ``group_size`` consecutive channels). v: [..., D] with D % group_size == 0.

    Returns:
        float32, v's shape; equals dequantize_value_blocks(quantize_value_blocks(...)).
    """
    *lead, d = v.shape
    if d % group_size:
        raise ValueError(f"head_dim {d} is not whole groups of {group_size}")
    x = dequantize_groups(*quantize_groups(v.reshape(*lead, d // group_size, group_size), bits, scale_dtype))
    return x.reshape(v.shape)
