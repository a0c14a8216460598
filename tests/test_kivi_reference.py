"""The KIVI reference: packing, the quantization contract, decode attention, flush."""

import os

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kiviq.kernels import (
    allocate_pool,
    blocks_to_tokens,
    decode_attention,
    decode_attention_dense,
    dequantize_key_blocks,
    dequantize_value_blocks,
    flush_tails,
    pack,
    quantize_key_blocks,
    quantize_value_blocks,
    tokens_to_blocks,
    unpack,
)
from kiviq.kernels.kivi_quant import plain_key_codes, plain_value_codes, quantize_groups

FAST = settings(max_examples=150, deadline=None)
# MLX runs float32 matmuls as TF32 on CUDA unless MLX_ENABLE_TF32=0 (~1e-3 relative):
# there, float32 results are only checked to that precision.
TF32 = mx.default_device() == mx.gpu and os.environ.get("MLX_ENABLE_TF32", "1") != "0"
R = 128
UNIT_ROUNDOFF = {mx.float16: 2.0**-11, mx.bfloat16: 2.0**-8}
# Half the smallest subnormal: the absolute rounding error floor of the storage dtype.
SUBNORMAL_HALF = {mx.float16: 2.0**-25, mx.bfloat16: 2.0**-134}


def to_np(a: mx.array) -> np.ndarray:
    return np.array(a.astype(mx.float32) if a.dtype == mx.bfloat16 else a)


def np_round_to(x: np.ndarray, dtype: mx.Dtype) -> np.ndarray:
    """float32 -> fp16/bf16 (round to nearest even) -> float32, in numpy."""
    x = x.astype(np.float32)
    if dtype == mx.float16:
        return x.astype(np.float16).astype(np.float32)
    b = x.view(np.uint32).astype(np.uint64)
    b = (b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000
    return b.astype(np.uint32).view(np.float32)


def np_quantize(x: np.ndarray, bits: int, sd: mx.Dtype):
    """The contract, written out in numpy float32, groups along the last axis."""
    levels = np.float32(2**bits - 1)
    x = x.astype(np.float32)
    mn, mx_ = x.min(-1), x.max(-1)
    zero = np_round_to(mn, sd)
    scale = np_round_to((mx_ - mn) / levels, sd)
    q = np.round((x - zero[..., None]) / np.where(scale == 0, 1, scale)[..., None])
    q = np.where(scale[..., None] == 0, 0, np.clip(q, 0, levels))
    return q.astype(np.uint8), scale, zero


def np_pack(codes: np.ndarray, bits: int) -> np.ndarray:
    p = 8 // bits
    out = np.zeros(codes.shape[:-1] + (codes.shape[-1] // p,), np.uint8)
    for j in range(p):
        out |= (codes[..., j::p] << (j * bits)).astype(np.uint8)
    return out


@FAST
@given(
    bits=st.sampled_from([2, 4, 8]),
    lead=st.lists(st.integers(0, 4), max_size=3),
    groups=st.integers(1, 12),
    seed=st.integers(0, 2**31),
)
def test_pack_unpack_round_trip(bits, lead, groups, seed):
    n = groups * (8 // bits)
    codes = np.random.default_rng(seed).integers(0, 2**bits, size=(*lead, n), dtype=np.uint8)
    packed = pack(mx.array(codes), bits)
    assert packed.dtype == mx.uint8 and packed.shape == (*lead, n // (8 // bits))
    np.testing.assert_array_equal(np.array(packed), np_pack(codes, bits))
    np.testing.assert_array_equal(np.array(unpack(packed, bits)), codes)


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_four_bytes_read_as_little_endian_uint32(bits):
    # Kernels load 32-bit words: word bits [i*b, i*b+b) must be code i.
    p = 8 // bits
    codes = np.random.default_rng(0).integers(0, 2**bits, size=(3, 8 * p), dtype=np.uint8)
    words = np.array(pack(mx.array(codes), bits)).view("<u4")
    for i in range(4 * p):
        np.testing.assert_array_equal((words >> (i * bits)) & (2**bits - 1), codes[:, i::4 * p])


def _sample(rng, shape, kind):
    if kind == "grid":  # few distinct values: many exact ties for round-half-even
        return rng.integers(-8, 8, size=shape) * 0.25
    if kind == "offset":  # narrow groups far from 0: the fp16 rounding of zero matters
        return 40.0 + rng.normal(size=shape) * 0.05
    return rng.normal(size=shape) * rng.choice([1e-4, 1.0, 20.0])


@FAST
@given(
    bits=st.sampled_from([2, 4, 8]),
    dtype=st.sampled_from([mx.float16, mx.bfloat16, mx.float32]),
    g=st.sampled_from([16, 32, 64, 128]),
    kind=st.sampled_from(["normal", "grid", "offset"]),
    seed=st.integers(0, 2**31),
)
def test_quantize_matches_numpy_bit_for_bit(bits, dtype, g, kind, seed):
    rng = np.random.default_rng(seed)
    # x: [N, H_kv, G, D]; cast to dtype first so numpy sees the same inputs.
    x = mx.array(_sample(rng, (3, 2, g, 128), kind).astype(np.float32)).astype(dtype)
    xn = to_np(x)
    sd = mx.bfloat16 if dtype == mx.bfloat16 else mx.float16
    # (quantize, codes to plain order, the groups, scales as numpy lays them out)
    for quantize, plain, groups, params in (
        (quantize_key_blocks, plain_key_codes, np.swapaxes(xn, -1, -2), lambda a: a),
        (quantize_value_blocks, plain_value_codes, xn.reshape(3, 2, g, 128 // g, g),
         lambda a: np.swapaxes(a, -1, -2)),  # stored group-major: [N, H_kv, D // G, G]
    ):
        codes, scales, zeros = quantize(x, bits=bits)
        again = quantize(x, bits=bits)
        for a, b in zip((codes, scales, zeros), again):
            np.testing.assert_array_equal(np.array(a.view(mx.uint8)), np.array(b.view(mx.uint8)))
        q_np, s_np, z_np = np_quantize(groups, bits, sd)
        assert scales.dtype == sd and zeros.dtype == sd
        np.testing.assert_array_equal(params(to_np(scales)), s_np)
        np.testing.assert_array_equal(params(to_np(zeros)), z_np)
        q_np = q_np.reshape(codes.shape[:3] + (-1,))  # back to [N, H_kv, D or G, G or D]
        np.testing.assert_array_equal(np.array(plain(codes, bits)), np_pack(q_np, bits))


@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("d", [64, 128])
def test_tiles_are_stored_in_lane_order(d, bits):
    """What the tensor-core kernel's lane (g, f) loads for k-tile kt (keys) or for
    channel group mp and token quad kt (values), read straight off the stored bytes: the
    units (4 codes) of channels (tokens) c0..c3, in the order c0, c2, c1, c3 at 2 bits,
    c0..c3 at 4 bits (kernels.layout)."""
    rng = np.random.default_rng(d + bits)
    ub, order = bits // 2, (0, 2, 1, 3) if bits == 2 else (0, 1, 2, 3)
    x = mx.array(rng.normal(size=(2, 3, 32, d)).astype(np.float32)).astype(mx.float16)
    kc, vc = quantize_key_blocks(x, bits=bits)[0], quantize_value_blocks(x, bits=bits)[0]
    k_plain, v_plain = np.array(plain_key_codes(kc, bits)), np.array(plain_value_codes(vc, bits))
    assert kc.shape == (2, 3, d, 8 * ub) and vc.shape == (2, 3, 32, d // 4 * ub)
    assert not np.array_equal(np.array(kc), k_plain)
    k_tiles, v_tiles = np.array(kc).reshape(2, 3, -1), np.array(vc).reshape(2, 3, -1)
    per_lane = d * bits // 8  # bytes of a lane's K (and V) codes per tile
    for lane in range(32):
        g, f = lane // 4, lane % 4
        for kt in range(d // 16):
            at = lane * per_lane + kt * 4 * ub
            c = 16 * kt + 4 * f
            want = np.concatenate([k_plain[:, :, c + i, g * ub:(g + 1) * ub] for i in order], axis=-1)
            np.testing.assert_array_equal(k_tiles[..., at:at + 4 * ub], want)
        for mp in range(d // 32):
            for kt in range(2):
                at = lane * per_lane + (2 * mp + kt) * 4 * ub
                t, u = 8 * f + 4 * kt, 8 * mp + g
                want = np.concatenate([v_plain[:, :, t + i, u * ub:(u + 1) * ub] for i in order], axis=-1)
                np.testing.assert_array_equal(v_tiles[..., at:at + 4 * ub], want)


def test_other_layouts_keep_plain_order():
    x = mx.array(np.random.default_rng(0).normal(size=(2, 3, 32, 96)).astype(np.float32)).astype(mx.float16)
    for bits, g, d in ((8, 32, 96), (2, 16, 96), (4, 32, 96)):
        y = x[:, :, :g, :d]
        codes = quantize_key_blocks(y, bits=bits)[0]
        assert np.array_equal(np.array(codes), np.array(plain_key_codes(codes, bits)))


@FAST
@given(
    bits=st.sampled_from([2, 4, 8]),
    dtype=st.sampled_from([mx.float16, mx.bfloat16, mx.float32]),
    g=st.sampled_from([16, 32, 64, 128]),
    length=st.sampled_from(["1", "G-1", "G", "R+G-1", "R+G", "long"]),
    kind=st.sampled_from(["normal", "grid", "offset"]),
    constant=st.booleans(),
    seed=st.integers(0, 2**31),
)
def test_dequantization_error_bound(bits, dtype, g, length, kind, constant, seed):
    rng = np.random.default_rng(seed)
    lengths = {"1": 1, "G-1": g - 1, "G": g, "R+G-1": R + g - 1, "R+G": R + g}
    s = lengths.get(length, 4 * R + 3 * g + 5)
    d = 128 if g > 32 else 64
    x = _sample(rng, (2, s, d), kind).astype(np.float32)  # [H_kv, S, D]
    if constant:
        x[:, :, 3] = 1.5  # a key channel
        x[:, 5 % s, :g] = -2.0  # a value channel group of one token
    x = mx.array(x).astype(dtype)
    blocks = tokens_to_blocks(x, g)  # only full blocks are ever quantized
    assert blocks.shape == (s // g, 2, g, d)
    sd = mx.bfloat16 if dtype == mx.bfloat16 else mx.float16
    u, sub = UNIT_ROUNDOFF[sd], SUBNORMAL_HALF[sd]
    levels = 2**bits - 1
    for quantize, dequantize, group_view in (
        (quantize_key_blocks, dequantize_key_blocks, lambda a: np.swapaxes(a, -1, -2)),
        # value groups [N, H_kv, D // G, G tokens, G channels]: scales are group-major
        (quantize_value_blocks, dequantize_value_blocks,
         lambda a: np.swapaxes(a.reshape(*a.shape[:3], d // g, g), 2, 3)),
    ):
        codes, scales, zeros = quantize(blocks, bits=bits)
        x_hat = dequantize(codes, scales, zeros, bits=bits)
        assert x_hat.dtype == mx.float32 and x_hat.shape == blocks.shape
        xg = group_view(to_np(blocks)).astype(np.float64)
        err = np.abs(group_view(np.array(x_hat)) - xg).max(-1)
        mn, r = xg.min(-1), np.ptp(xg, axis=-1)
        sc, z = to_np(scales).astype(np.float64), to_np(zeros).astype(np.float64)
        # The clip terms: |scale - r/L| <= u*r/L (+ f32 division, + subnormal floor),
        # |zero - min| <= u*|min| (+ floor); only the group's ends pay them, times L.
        assert np.all(np.abs(sc - r / levels) <= (u + 2.0**-24) * r / levels + sub)
        assert np.all(np.abs(z - mn) <= u * np.abs(mn) + sub)
        clip = levels * ((u + 2.0**-24) * r / levels + sub) + u * np.abs(mn) + sub
        # Slack: float32 rounding of x - zero, the division, q*scale and the add.
        slack = 2.0**-21 * (np.abs(xg).max(-1, initial=0) + levels * sc)
        assert np.all(err <= np.maximum(sc / 2, clip) + slack)
        # A constant group stores scale 0 and comes back as its (rounded) value.
        assert np.all(err[r == 0] <= np.abs(z - mn)[r == 0])


POOL_BLOCK_ARRAYS = ("k_codes", "k_scales", "k_zeros", "v_codes", "v_scales", "v_zeros")


def _store(pool, ids, k, v, *, bits, g):
    """Quantize k, v [H_kv, n * G, D] into pool blocks `ids`; return them dequantized."""
    kq = quantize_key_blocks(tokens_to_blocks(k, g), bits=bits)
    vq = quantize_value_blocks(tokens_to_blocks(v, g), bits=bits)
    if ids is not None:
        for name, a in zip(POOL_BLOCK_ARRAYS, kq + vq):
            getattr(pool, name)[mx.array(ids, dtype=mx.int32)] = a
    kd = blocks_to_tokens(dequantize_key_blocks(*kq, bits=bits))
    vd = blocks_to_tokens(dequantize_value_blocks(*vq, bits=bits))
    return kd, vd


def _dense_kv(kd, vd, k_tail, v_tail):
    """What decode attention must see: dequantized blocks, then the tail as is."""
    return (mx.concatenate([kd, k_tail.astype(mx.float32)], axis=1),
            mx.concatenate([vd, v_tail.astype(mx.float32)], axis=1))


def _normal(rng, shape, dtype=mx.float16):
    return mx.array(rng.normal(size=shape).astype(np.float32)).astype(dtype)


def _scenario(rng, *, bits, d, h_kv, lens, dtype=mx.float16, g=32):
    """A pool holding ragged sequences in scattered blocks; returns inputs + dense K/V.

    lens: list of (num_blocks, tail_len) per sequence.
    """
    total, ns = sum(n for n, _ in lens), len(lens) + 2
    pool = allocate_pool(total + 5, ns, h_kv, d, bits=bits, group_size=g, residual=R,
                         dtype=dtype)
    # Block 0 stays unused and poisoned: the reference reads it for garbage entries.
    ids = 1 + rng.permutation(total + 4)[:total]
    pool.k_scales[0] = mx.array(np.nan).astype(dtype)
    pool.v_zeros[0] = mx.array(np.nan).astype(dtype)
    slots = rng.permutation(ns)[: len(lens)].astype(np.int32)
    # Entries past num_blocks are garbage, including out-of-range ids.
    table = rng.integers(-5, 10**6, size=(len(lens), max(n for n, _ in lens) + 2))
    # Stale tail entries past tail_len are NaN: masking must keep them out.
    nan = mx.array(np.nan).astype(dtype)
    pool.tail_k[...] = nan
    pool.tail_v[...] = nan
    dense, start = [], 0
    for i, (n, t) in enumerate(lens):
        table[i, :n] = ids[start : start + n]
        start += n
        k, v = _normal(rng, (h_kv, n * g + t, d), dtype), _normal(rng, (h_kv, n * g + t, d), dtype)
        kd, vd = _store(pool, table[i, :n], k[:, : n * g], v[:, : n * g], bits=bits, g=g)
        pool.tail_k[int(slots[i]), :, :t] = k[:, n * g :]
        pool.tail_v[int(slots[i]), :, :t] = v[:, n * g :]
        dense.append(_dense_kv(kd, vd, k[:, n * g :], v[:, n * g :]))
    num_blocks = mx.array([n for n, _ in lens], dtype=mx.int32)
    tail_lens = mx.array([t for _, t in lens], dtype=mx.int32)
    args = (pool, mx.array(table.astype(np.int32)), num_blocks, mx.array(slots), tail_lens)
    return args, dense


RAGGED = [
    [(0, 1)],  # first token: tail only
    [(3, 0), (0, 37), (9, R + 32), (1, R + 5), (4, R)],  # empty tail, tail only, many blocks
    [(2, 33), (0, R + 32), (6, 1)],
]


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("d,h_kv,rep", [(64, 3, 3), (128, 2, 4), (64, 2, 1)])
@pytest.mark.parametrize("q_dtype", [mx.float16, mx.float32])
def test_decode_matches_dense_on_dequantized_kv(bits, d, h_kv, rep, q_dtype):
    rng = np.random.default_rng(bits * 1000 + d + rep)
    for lens in RAGGED:
        args, dense = _scenario(rng, bits=bits, d=d, h_kv=h_kv, lens=lens)
        q = _normal(rng, (len(lens), h_kv * rep, d), q_dtype)
        out = decode_attention(q, *args, scale=d**-0.5, bits=bits)
        assert out.dtype == q_dtype and out.shape == q.shape
        # Both sides compute in float32 and differ only in summation order (~1e-7
        # relative); in fp16 the outputs are then one final rounding apart (1 ulp).
        exact32 = q_dtype == mx.float32 and not TF32
        tol = dict(atol=1e-5, rtol=1e-4) if exact32 else dict(atol=2e-3, rtol=1e-2)
        for i, (k, v) in enumerate(dense):
            ref = decode_attention_dense(q[i], k, v, d**-0.5)
            np.testing.assert_allclose(np.array(out[i]), np.array(ref), **tol)


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16, mx.float32])
def test_batch_matches_single(dtype):
    rng = np.random.default_rng(7)
    lens = RAGGED[1] + RAGGED[2]
    pool_dtype = mx.bfloat16 if dtype == mx.bfloat16 else mx.float16
    (pool, table, nblocks, slots, tails), _ = _scenario(
        rng, bits=4, d=64, h_kv=2, lens=lens, dtype=pool_dtype
    )
    q = _normal(rng, (len(lens), 6, 64), dtype)

    def attend(rows, cols=None):
        return to_np(decode_attention(q[rows], pool, table[rows, :cols], nblocks[rows],
                                      slots[rows], tails[rows], scale=0.125, bits=4))

    out = attend(slice(None))
    # One ulp of the output dtype (bf16 keeps 8 of float32's 24 significand bits).
    ulp = np.spacing(np.abs(out).astype(np.float16 if dtype == mx.float16 else np.float32))
    ulp = ulp * 2**16 if dtype == mx.bfloat16 else ulp
    for i, (n, _) in enumerate(lens):
        np.testing.assert_array_equal(attend(slice(i, i + 1))[0], out[i])
        # With only its own n table columns the matmuls reduce over fewer columns, and
        # BLAS may then sum in another order: measured exact with the reference BLAS,
        # up to 2.4e-7 of the row's largest |output| with OpenBLAS. Allow 1 ulp of the
        # output dtype, and for float32 8 ulp of the row's largest entry.
        tol = ulp[i]
        if dtype == mx.float32:
            tol = np.maximum(tol, 2.0**-21 * np.abs(out[i]).max())
        assert np.all(np.abs(attend(slice(i, i + 1), n)[0] - out[i]) <= tol)


def test_decode_flush_cycle_matches_dense():
    """Engine-like use: prefill, then decode steps that append to tails and flush at R+G."""
    rng = np.random.default_rng(11)
    g, r, bits, h_kv, rep, d = 16, 32, 4, 2, 2, 32
    pool = allocate_pool(40, 3, h_kv, d, bits=bits, group_size=g, residual=r)
    free = [int(i) for i in rng.permutation(40)]
    kv, tables, tail_lens = {}, {}, {}
    for slot, n in {0: 5, 2: 70}.items():  # slot -> prompt length
        # Prefill quantizes all but the last R..R+G-1 tokens.
        nq = max(0, (n - r) // g) * g
        k, v = _normal(rng, (h_kv, n, d)), _normal(rng, (h_kv, n, d))
        tables[slot] = [free.pop() for _ in range(nq // g)]
        _store(pool, tables[slot], k[:, :nq], v[:, :nq], bits=bits, g=g)
        pool.tail_k[slot, :, : n - nq] = k[:, nq:]
        pool.tail_v[slot, :, : n - nq] = v[:, nq:]
        kv[slot], tail_lens[slot] = (k, v), n - nq
    order = [2, 0]
    for _ in range(60):
        for slot in order:  # the caller writes the current token into the tail first
            k, v = _normal(rng, (h_kv, 1, d)), _normal(rng, (h_kv, 1, d))
            pool.tail_k[slot, :, tail_lens[slot]] = k[:, 0]
            pool.tail_v[slot, :, tail_lens[slot]] = v[:, 0]
            kv[slot] = tuple(mx.concatenate([a, b], axis=1) for a, b in zip(kv[slot], (k, v)))
            tail_lens[slot] += 1
        mb = max(len(tables[s]) for s in order)
        table = mx.array([tables[s] + [0] * (mb - len(tables[s])) for s in order])
        q = _normal(rng, (2, h_kv * rep, d))
        out = decode_attention(
            q, pool, table.reshape(2, mb), mx.array([len(tables[s]) for s in order]),
            mx.array(order), mx.array([tail_lens[s] for s in order]), scale=d**-0.5,
            bits=bits, group_size=g,
        )
        for i, slot in enumerate(order):
            # Expected: quantize-dequantize of every flushed block, then the tail as is.
            k, v = kv[slot]
            nq = len(tables[slot]) * g
            kd, vd = _store(None, None, k[:, :nq], v[:, :nq], bits=bits, g=g)
            ref = decode_attention_dense(q[i], *_dense_kv(kd, vd, k[:, nq:], v[:, nq:]), d**-0.5)
            np.testing.assert_allclose(np.array(out[i]), np.array(ref), atol=2e-3, rtol=1e-2)
        full = [s for s in order if tail_lens[s] == r + g]
        if full:
            ids = [free.pop() for _ in full]
            flush_tails(pool, mx.array(full), mx.array(ids),
                        mx.array([tail_lens[s] for s in full]), bits=bits, group_size=g)
            for s, bid in zip(full, ids):
                tables[s].append(bid)
                tail_lens[s] -= g
    assert len(tables[0]) >= 2 and len(tables[2]) >= 5 and r <= tail_lens[2] < r + g


def test_flush_tails_quantizes_oldest_block_and_shifts():
    rng = np.random.default_rng(3)
    g, bits, lens = 32, 2, [(1, R + 32), (0, 32), (2, 40), (0, 70)]
    (pool, _, _, slots, tails), _ = _scenario(rng, bits=bits, d=64, h_kv=2, lens=lens)
    before = {name: to_np(a) for name, a in pool._asdict().items()}
    objects = [id(a) for a in pool]
    flush = mx.array([0, 1, 3])  # sequence indices; their slots come shuffled
    f_slots, f_lens = slots[flush], tails[flush]
    new_ids = mx.array([4, 0, 3], dtype=mx.int32)  # of the pool's 3 + 5 blocks
    out = flush_tails(pool, f_slots, new_ids, f_lens, bits=bits, group_size=g)
    # Same array objects, updated in place, same shapes.
    assert out is pool and [id(a) for a in pool] == objects
    assert all(a.shape == before[name].shape for name, a in pool._asdict().items())
    for slot, bid, tl in zip(*(np.array(a).tolist() for a in (f_slots, new_ids, f_lens))):
        old = {name: before[name][slot] for name in ("tail_k", "tail_v")}  # [H_kv, R+G, D]
        kd, vd = _store(None, None, mx.array(old["tail_k"][:, :g]).astype(mx.float16),
                        mx.array(old["tail_v"][:, :g]).astype(mx.float16), bits=bits, g=g)
        got_k = dequantize_key_blocks(pool.k_codes[bid:bid + 1], pool.k_scales[bid:bid + 1],
                                      pool.k_zeros[bid:bid + 1], bits=bits)
        got_v = dequantize_value_blocks(pool.v_codes[bid:bid + 1], pool.v_scales[bid:bid + 1],
                                        pool.v_zeros[bid:bid + 1], bits=bits)
        np.testing.assert_array_equal(np.array(blocks_to_tokens(got_k)), np.array(kd))
        np.testing.assert_array_equal(np.array(blocks_to_tokens(got_v)), np.array(vd))
        for name in ("tail_k", "tail_v"):
            new = to_np(getattr(pool, name))[slot]
            np.testing.assert_array_equal(new[:, : tl - g], old[name][:, g:tl])
            assert np.all(new[:, R:] == 0)  # vacated positions are zero-filled
    touched = {"tail": set(np.array(f_slots).tolist()), "block": set(np.array(new_ids).tolist())}
    for name, a in pool._asdict().items():
        keep = touched["tail" if name.startswith("tail") else "block"]
        rows = [i for i in range(a.shape[0]) if i not in keep]
        np.testing.assert_array_equal(to_np(a)[rows], before[name][rows])


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
def test_flush_of_all_layers_at_once_equals_a_flush_per_layer(dtype):
    """The engine flushes every layer's pool with one stacked quantization
    (dispatch.flush_layers); each pool must end exactly as its own flush leaves it."""
    from kiviq.kernels.dispatch import flush_layers

    rng = np.random.default_rng(5)
    g, bits, h_kv, d = 32, 4, 2, 64
    pairs = []
    for _ in range(3):  # layers: the same slots, other values
        pool = allocate_pool(8, 5, h_kv, d, bits=bits, group_size=g, residual=R, dtype=dtype)
        pool.tail_k[...] = _normal(rng, pool.tail_k.shape, dtype)
        pool.tail_v[...] = _normal(rng, pool.tail_v.shape, dtype)
        pairs.append((pool, type(pool)(*(mx.array(a) for a in pool))))  # the twin: flushed alone
    mx.eval(pairs)
    slots, ids = mx.array([3, 0, 4]), mx.array([7, 2, 5])  # three tails fill in the same step
    lens = mx.array([R + g - 1, R + g - 1, R + g - 1])
    flush_layers([p for p, _ in pairs], slots, ids, lens, bits=bits, group_size=g)
    for pool, twin in pairs:
        flush_tails(twin, slots, ids, lens, bits=bits, group_size=g)
        for name, a, b in zip(pool._fields, pool, twin):
            np.testing.assert_array_equal(to_np(a), to_np(b), err_msg=name)
        assert to_np(pool.tail_k[0, :, : R - 1]).any()  # something real was compared


@pytest.mark.parametrize("k", [2, 3])
def test_flush_of_k_blocks_at_once_equals_k_flushes_in_a_row(k):
    """flush_layers(blocks_per_slot=k) (KVConfig.flush_blocks) leaves each pool
    exactly as k one-block flushes in a row do: block j gets tail rows
    j*G .. j*G + G - 1, and the tail ends shifted by k*G with zeros after."""
    from kiviq.kernels.dispatch import flush_layers

    rng = np.random.default_rng(k)
    g, bits, h_kv, d, dtype = 16, 2, 2, 64, mx.bfloat16
    rows = R + k * g  # the store's tail capacity for this k
    pairs = []
    for _ in range(2):  # layers
        pool = allocate_pool(12, 4, h_kv, d, bits=bits, group_size=g, residual=rows - g, dtype=dtype)
        pool.tail_k[...] = _normal(rng, pool.tail_k.shape, dtype)
        pool.tail_v[...] = _normal(rng, pool.tail_v.shape, dtype)
        pairs.append((pool, type(pool)(*(mx.array(a) for a in pool))))
    mx.eval(pairs)
    slots = [2, 0]
    ids = [[9, 3, 6][:k], [1, 10, 4][:k]]  # per slot, oldest block first
    full = rows - 1
    flush_layers([p for p, _ in pairs], slots, [b for per in ids for b in per], [full, full],
                 bits=bits, group_size=g, blocks_per_slot=k)
    for pool, twin in pairs:
        for j in range(k):
            flush_tails(twin, mx.array(slots), mx.array([per[j] for per in ids]),
                        mx.array([full - j * g] * 2), bits=bits, group_size=g)
        for name, a, b in zip(pool._fields, pool, twin):
            np.testing.assert_array_equal(to_np(a), to_np(b), err_msg=name)
        assert to_np(pool.k_scales[9]).any() and not to_np(pool.tail_k[2, :, rows - k * g:]).any()
    with pytest.raises(ValueError, match="per slot"):
        flush_layers([pairs[0][0]], [1], [5], [full], bits=bits, group_size=g, blocks_per_slot=k)


def test_flush_tails_is_in_place_and_validates():
    pool = allocate_pool(512, 256, 8, 128, bits=4)  # tails: 2 x 80 MiB
    mx.eval(*pool)
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    flush_tails(pool, mx.array([5, 9]), mx.array([100, 7]), mx.array([R + 32, 40]), bits=4)
    mx.eval(*pool)
    # Measured ~4 MiB of temporaries whatever the pool size; one copy would add 80 MiB.
    assert mx.get_peak_memory() - base < 16 * 2**20
    with pytest.raises(ValueError, match=">= G"):
        flush_tails(pool, mx.array([1]), mx.array([2]), mx.array([31]), bits=4)
    with pytest.raises(ValueError, match="repeat"):
        flush_tails(pool, mx.array([1, 1]), mx.array([2, 3]), mx.array([40, 40]), bits=4)


def test_layout_checks():
    x = mx.zeros((1, 1, 32, 48), dtype=mx.float16)
    with pytest.raises(ValueError, match="divisible"):
        quantize_value_blocks(x, bits=4)
    with pytest.raises(ValueError, match="bits"):
        quantize_key_blocks(x, bits=3)
    with pytest.raises(ValueError, match="group_size"):
        quantize_key_blocks(mx.zeros((1, 1, 24, 64)), bits=4)
    codes, scales, zeros = quantize_groups(mx.full((2, 32), 7.0), 4, mx.float16)
    assert np.all(np.array(codes) == 0) and np.all(np.array(scales) == 0)


def test_only_the_cuda_plan_writes_the_tail():
    """KiviStore.write_and_attend scatters the new token unless the plan takes it
    (the CUDA AttendPlan)."""
    from kiviq.kernels import cuda_attend, dispatch

    pool = allocate_pool(4, 2, 1, 64, bits=4, group_size=32, residual=R)
    meta = (mx.zeros((1, 1), dtype=mx.int32), mx.zeros((1,), dtype=mx.int32),
            mx.zeros((1,), dtype=mx.int32), mx.ones((1,), dtype=mx.int32))
    plan = dispatch.attend_plan((1, 2, 64), mx.float16, pool, *meta, scale=0.1, bits=4, use_kernel=False)
    assert dispatch.writes_tail(plan) is False
    cuda_plan = object.__new__(cuda_attend.AttendPlan)  # what attend_plan returns on CUDA
    assert dispatch.writes_tail(cuda_plan) is True
