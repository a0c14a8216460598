"""Storage layout of a KIVI-quantized KV pool (one per layer).

Every kernel (CUDA, Metal) and the plain-ops reference read exactly this layout.

Axis names:
    B      batch (sequences in one decode step)
    H_q    query heads;  H_kv kv heads;  query head h reads kv head h // (H_q // H_kv)
    D      head_dim
    G      group size (16, 32, 64 or 128; default 32); D % G == 0
    R      residual length (default 128, a multiple of G)
    b      bits per code, in {2, 4, 8};  P = 8 // b codes per byte
    NB     blocks in the pool;  NS sequence slots (tails)

One block = G consecutive tokens of one sequence, for all kv heads of one layer.

Shapes (per layer):
    k_codes   uint8       [NB, H_kv, D, G // P]   keys, quantized PER CHANNEL over the
                                                  block's G tokens; a byte packs P
                                                  consecutive TOKENS of one channel
    k_scales  fp16|bf16   [NB, H_kv, D]
    k_zeros   fp16|bf16   [NB, H_kv, D]
    v_codes   uint8       [NB, H_kv, G, D // P]   values, quantized PER TOKEN in groups
                                                  of G consecutive CHANNELS; a byte packs
                                                  P consecutive CHANNELS of one token
    v_scales  fp16|bf16   [NB, H_kv, D // G, G]   group-major: one channel group's G
    v_zeros   fp16|bf16   [NB, H_kv, D // G, G]   tokens adjacent (a lane of the MMA
                                                  kernel reads its 8 tokens' as 16 bytes)
    tail_k    fp16|bf16   [NS, H_kv, R + G, D]    the unquantized residual window, by
    tail_v    fp16|bf16   [NS, H_kv, R + G, D]    slot; tail token i is at index i
                                                  (oldest first); entries at index >=
                                                  tail_len are unspecified

Packing: code j of a byte sits at bits [j*b, j*b + b) (low bits first, little-endian),
so 4 consecutive bytes read as a little-endian uint32 hold 4P consecutive codes.
A k_codes row (one channel of one block) is G // P bytes: G=32 gives 8 bytes at 2
bits, 16 at 4 bits, 32 at 8 bits. A v_codes row (one token) is D // P bytes.

Kernel notes: one (block, kv head) tile is contiguous -- D * G / P bytes of k_codes
(2 KiB at D=128, G=32, 4 bits), G * D / P bytes of v_codes, D fp16 k scales -- and,
since D and G are multiples of 16 and G / P >= 4, every codes tile starts at a
multiple of 64 bytes from the array's base (scale tiles: of 2 * D bytes), so 16-byte
vector loads stay aligned. Pass the pool arrays whole (never sliced views) so a custom
kernel gets them without a copy. Scales and zeros cost 4 bytes per group of G: at
G = 32 that is +50% over the codes at 2 bits, +25% at 4 bits (3 and 5 bits per
element in all).

Lane order (2 and 4 bits, G = 32, D 64 or 128; `lane_order`): within each (block, kv
head) tile the code bytes are permuted, the shapes above unchanged, so that the CUDA
tensor-core kernel's lane (g, f) (g = lane / 4, f = lane % 4; m16n8k16 fragments)
finds the codes it multiplies adjacent, as D * b / 32 words per tile (16-byte loads,
instead of one 1- or 2-byte load per code pair and channel). A unit is 4 codes (b / 2
bytes: 4 tokens of a key channel, 4 channels of a value token); in units:
    key unit (channel c, tokens 4u .. 4u+3) at
        ((u * 4 + (c % 16) // 4) * (D / 16) + c // 16) * 4 + ORD[c % 4]
    value unit (token t, channels 4u .. 4u+3) at
        ((((u % 8) * 4 + t // 8) * (D / 32) + u // 8) * 2 + (t % 8) // 4) * 4 + ORD[t % 4]
    ORD = (0, 2, 1, 3) at 2 bits, (0, 1, 2, 3) at 4 bits
Four units make the lane's operands for one k-tile (16 channels of K, 4 tokens of V):
at 4 bits units 0|1 and 2|3 are its two 32-bit words; at 2 bits ORD puts units 0, 2 in
the word's low bytes and 1, 3 in its high bytes, so one AND per code pair gives the
operand 0|1 from the word and 2|3 from the word >> 8. `key_lane_positions` /
`value_lane_positions` give the byte positions; every reader and writer of such a
pool (the reference included) uses them.

Quantization contract (what a flush kernel must reproduce bit for bit): see
`kernels.kivi_quant`.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import mlx.core as mx
import numpy as np

BITS = (2, 4, 8)
GROUP_SIZES = (16, 32, 64, 128)


class KiviPool(NamedTuple):
    """The eight arrays of one layer's pool (shapes in the module docstring).

    The tuple is immutable but its arrays are updated in place by slice/scatter
    assignment (`flush_tails`, the engine's tail writes), so a pool object stays valid.
    """

    k_codes: mx.array
    k_scales: mx.array
    k_zeros: mx.array
    v_codes: mx.array
    v_scales: mx.array
    v_zeros: mx.array
    tail_k: mx.array
    tail_v: mx.array

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self)


def codes_per_byte(bits: int) -> int:
    """P = 8 // bits, after checking `bits`."""
    if bits not in BITS:
        raise ValueError(f"bits must be one of {BITS}, got {bits}")
    return 8 // bits


def check_layout(bits: int, group_size: int, head_dim: int | None = None) -> None:
    """Raise ValueError unless (bits, G, D) describe a supported layout."""
    codes_per_byte(bits)
    if group_size not in GROUP_SIZES:
        raise ValueError(f"group_size must be one of {GROUP_SIZES}, got {group_size}")
    if head_dim is not None and head_dim % group_size != 0:
        raise ValueError(
            f"head_dim ({head_dim}) must be divisible by group_size ({group_size}): "
            "values are quantized in groups of G consecutive channels"
        )


def allocate_pool(
    num_blocks: int,
    num_slots: int,
    num_kv_heads: int,
    head_dim: int,
    *,
    bits: int,
    group_size: int = 32,
    residual: int = 128,
    dtype: mx.Dtype = mx.float16,
) -> KiviPool:
    """Allocate a zero-filled pool for one layer.

    Args:
        num_blocks: NB.
        num_slots: NS, the number of tails (concurrent sequences).
        num_kv_heads: H_kv.
        head_dim: D.
        bits: b, in {2, 4, 8}.
        group_size: G.
        residual: R, a multiple of G; tails hold R + G tokens.
        dtype: fp16 or bf16; used for the scales, zeros and tails.

    Returns:
        A KiviPool of zeros.
    """
    check_layout(bits, group_size, head_dim)
    if residual % group_size != 0:
        raise ValueError(f"residual ({residual}) must be a multiple of group_size")
    p = 8 // bits
    nb, ns, h, d, g = num_blocks, num_slots, num_kv_heads, head_dim, group_size
    return KiviPool(
        k_codes=mx.zeros((nb, h, d, g // p), dtype=mx.uint8),
        k_scales=mx.zeros((nb, h, d), dtype=dtype),
        k_zeros=mx.zeros((nb, h, d), dtype=dtype),
        v_codes=mx.zeros((nb, h, g, d // p), dtype=mx.uint8),
        v_scales=mx.zeros((nb, h, d // g, g), dtype=dtype),
        v_zeros=mx.zeros((nb, h, d // g, g), dtype=dtype),
        tail_k=mx.zeros((ns, h, residual + g, d), dtype=dtype),
        tail_v=mx.zeros((ns, h, residual + g, d), dtype=dtype),
    )


def bytes_per_token(num_kv_heads: int, head_dim: int, *, bits: int, key_group: int, value_group: int,
                    fp16_key_channels: int = 0, scale_bytes: int = 2) -> float:
    """Bytes one token costs in one layer's quantized blocks (the fp16 tail excluded).

    Codes: b bits per element of K and V. Keys: one scale and one zero per channel
    per ``key_group`` tokens. Values: one scale and one zero per ``value_group``
    channels of each token. ``fp16_key_channels`` channels per kv head (outliers)
    are stored as 2-byte floats instead of codes, and have no scales. With
    key_group == value_group == G this is the pool's block bytes / G (see
    `allocate_pool`); fp16 costs 2 * H_kv * D * 2.
    """
    h, d, c = num_kv_heads, head_dim, fp16_key_channels
    codes = h * (d - c) * bits / 8 + h * d * bits / 8
    key_sz = h * (d - c) * 2 * scale_bytes / key_group
    value_sz = h * (d // value_group) * 2 * scale_bytes
    return codes + key_sz + value_sz + h * c * 2


LANE_ORDER_HEAD_DIMS = (64, 128)
_ORD = {2: np.array([0, 2, 1, 3]), 4: np.array([0, 1, 2, 3])}


def lane_order(bits: int, group_size: int, head_dim: int) -> bool:
    """Whether a pool of this layout keeps its tiles' code bytes in lane order
    (module docstring): 2 or 4 bits, G = 32, D 64 or 128, the tensor-core kernel's."""
    return bits in _ORD and group_size == 32 and head_dim in LANE_ORDER_HEAD_DIMS


def _unit_bytes(unit_pos: np.ndarray, bits: int) -> np.ndarray:
    """Byte positions of the bytes of units at `unit_pos` [..., units], one row of the
    plain layout per leading index: b / 2 bytes per unit, in order."""
    ub = bits // 2
    return (unit_pos[..., None] * ub + np.arange(ub)).reshape(unit_pos.shape[0], -1)


@functools.lru_cache(maxsize=None)
def key_lane_positions(head_dim: int, bits: int) -> np.ndarray:
    """int32 [D * G / P]: where plain key byte i (row c = i // (G / P)) of a lane-order
    tile (G = 32) lives."""
    d = head_dim
    c, u = np.arange(d)[:, None], np.arange(8)[None, :]
    units = ((u * 4 + (c % 16) // 4) * (d // 16) + c // 16) * 4 + _ORD[bits][c % 4]
    return _unit_bytes(units, bits).reshape(-1).astype(np.int32)


@functools.lru_cache(maxsize=None)
def value_lane_positions(head_dim: int, bits: int) -> np.ndarray:
    """int32 [G * D / P]: where plain value byte i (row t = i // (D / P)) of a lane-order
    tile (G = 32) lives."""
    d = head_dim
    t, u = np.arange(32)[:, None], np.arange(d // 4)[None, :]
    units = ((((u % 8) * 4 + t // 8) * (d // 32) + u // 8) * 2 + (t % 8) // 4) * 4 + _ORD[bits][t % 4]
    return _unit_bytes(units, bits).reshape(-1).astype(np.int32)
