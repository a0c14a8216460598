"""The KIVI kernel tests' cases and oracles (tests/test_kernels_gpu.py states the
contracts they check): random pools of ragged sequences, the float32 reference, the MMA
kernel's rounding model and the tolerance check."""

from __future__ import annotations

import json
import os

import mlx.core as mx
import numpy as np

from kiviq.kernels import cuda_attend, kivi_cuda
from kiviq.kernels.kivi_quant import (
    blocks_to_tokens,
    dequantize_value_blocks,
    plain_key_codes,
    unpack,
)
from kiviq.kernels.kivi_reference import decode_attention
from kiviq.kernels.layout import KiviPool
from gpu_helpers import backend, to_np

R = 128
OUT_TOL = {mx.float16: 2.0**-10, mx.bfloat16: 2.0**-7, mx.float32: 2.0**-20}
UNIT_ROUNDOFF = {mx.float16: 2.0**-11, mx.bfloat16: 2.0**-8}
ERR_LOG = os.environ.get("KIVIQ_ERR_LOG")  # JSON lines of max errors, if set


def split_len(n: int, g: int = 32, r: int = R) -> tuple[int, int]:
    """A sequence of n tokens as (quantized blocks, tail length), per the flush rule."""
    if n < r + g:
        return 0, n
    nb = (n - r) // g
    return nb, n - nb * g


def make_case(rng, *, lens, h_kv, rep, d, bits, dtype, g=32):
    """A pool of random codes/scales holding ragged sequences in scattered blocks.

    lens: list of (num_blocks, tail_len). Unused blocks (block 0 among them) have NaN
    scales or zeros, tail rows past tail_len are NaN and table entries past num_blocks
    are garbage (out of range too): the kernel must read none of them.
    Returns (q, pool, block_tables, num_blocks, slots, tail_lens).
    """
    total, ns, p = sum(n for n, _ in lens), len(lens) + 2, 8 // bits
    nb_pool = total + 3
    levels = 2**bits - 1
    # k, v values span [zero, zero + L * scale] ~ [-2, 2]: scores of a few units.
    shapes = {
        "k_codes": (nb_pool, h_kv, d, g // p), "v_codes": (nb_pool, h_kv, g, d // p),
        "k_scales": (nb_pool, h_kv, d), "v_scales": (nb_pool, h_kv, d // g, g),
    }
    arrs = {}
    for kind in ("k", "v"):
        arrs[f"{kind}_codes"] = rng.integers(0, 256, size=shapes[f"{kind}_codes"], dtype=np.uint8)
        sshape = shapes[f"{kind}_scales"]
        sc = rng.uniform(0.5, 1.5, size=sshape) * 4.0 / levels
        ze = rng.normal(-2.0, 0.5, size=sshape)
        arrs[f"{kind}_scales"], arrs[f"{kind}_zeros"] = sc, ze
    ids = 1 + rng.permutation(nb_pool - 1)[:total]
    used = np.zeros(nb_pool, bool)
    used[ids] = True
    arrs["k_scales"][~used] = np.nan
    arrs["v_zeros"][~used] = np.nan
    tails = {n: rng.normal(size=(ns, h_kv, R + g, d)) for n in ("tail_k", "tail_v")}
    slots = rng.permutation(ns)[: len(lens)].astype(np.int32)
    table = rng.integers(-5, 10**6, size=(len(lens), max([n for n, _ in lens] + [0]) + 2))
    start = 0
    for i, (n, t) in enumerate(lens):
        table[i, :n] = ids[start : start + n]
        start += n
        for a in tails.values():
            a[slots[i], :, t:] = np.nan
    pool = KiviPool(
        **{k: mx.array(arrs[k]) for k in ("k_codes", "v_codes")},
        **{k: mx.array(arrs[k].astype(np.float32)).astype(dtype)
           for k in ("k_scales", "k_zeros", "v_scales", "v_zeros")},
        **{k: mx.array(a.astype(np.float32)).astype(dtype) for k, a in tails.items()},
    )
    q = mx.array(rng.normal(size=(len(lens), h_kv * rep, d)).astype(np.float32)).astype(dtype)
    return (q, pool, mx.array(table.astype(np.int32)),
            mx.array([n for n, _ in lens], dtype=mx.int32), mx.array(slots),
            mx.array([t for _, t in lens], dtype=mx.int32))


def oracle(q, *args, **kw):
    """The reference at float32 precision (q upcast; no TF32)."""
    def run():
        out = decode_attention(q.astype(mx.float32), *args, **kw)
        mx.eval(out)
        return out
    if mx.default_device() == mx.gpu and os.environ.get("MLX_ENABLE_TF32", "1") != "0":
        with mx.stream(mx.cpu):
            return run()
    return run()


def check_close(out, ref, dtype, label, extra=None):
    """extra: an absolute tolerance per row ([B, 1, 1] or scalar), added to the bound."""
    o, r = to_np(out), to_np(ref)
    assert o.shape == r.shape and out.dtype == dtype
    rowmax = np.abs(r).max(axis=-1, keepdims=True)
    err = np.abs(o - r)
    bound = OUT_TOL[dtype] * np.abs(r) + 1e-4 * rowmax
    if extra is not None:
        bound = bound + extra
    if ERR_LOG:
        with open(ERR_LOG, "a") as f:
            f.write(json.dumps({"case": label, "dtype": str(dtype),
                                "max_abs": float(err.max()),
                                "max_rel_to_row": float((err / np.maximum(rowmax, 1e-30)).max()),
                                "worst_vs_bound": float((err / np.maximum(bound, 1e-30)).max())})
                    + "\n")
    bad = ~(err <= bound)
    assert not bad.any(), (
        f"{label}: {bad.sum()} of {bad.size} outside tolerance; max err {err.max():.3g}, "
        f"at ref {r[bad][:5]}, got {o[bad][:5]}")


def oracle_fold(q, pool, table, nb, slots, tl, *, scale, bits, group_size=32):
    """The MMA kernel's numerics, in float64: key scores codes . rd(rd(q) * scale) +
    zeros . rd(q) per block (rd: rounded to the pool dtype), exactly as the kernel
    rounds; values code * scale + zero, unrounded; the tail with q as given.

    Returns (reference [B, H_q, D] float32, extra tolerance [B, 1, 1] = 6 u max|v|):
    the kernel rounds p (<= u max|v| in the output) and p * scale (<= u * 2 max|v|:
    |code * scale| = |v - zero| <= 2 max|v|) for the values, which no oracle can
    repeat (p depends on the running max); twice that bound.
    """
    h_kv, d = pool.tail_k.shape[1], pool.tail_k.shape[-1]
    sd = pool.k_scales.dtype
    f64 = lambda a: np.array(a.astype(mx.float32), dtype=np.float64)  # noqa: E731
    # float64 -> float32 is exact for these products (<= 22 significant bits), so one rounding
    rd = lambda a: f64(mx.array(a.astype(np.float32)).astype(sd))  # noqa: E731
    outs, extra = [], []
    for i in range(q.shape[0]):
        n, t, s = int(nb[i].item()), int(tl[i].item()), int(slots[i].item())
        qi = f64(q[i]).reshape(h_kv, -1, d)  # [H_kv, rep, D]
        scores, vals = [], []
        if n:
            idx = table[i, :n]
            codes = np.array(unpack(plain_key_codes(pool.k_codes[idx], bits), bits), dtype=np.float64)  # [n, H_kv, D, G]
            ks, kz = f64(pool.k_scales[idx]), f64(pool.k_zeros[idx])  # [n, H_kv, D]
            qr = rd(qi)
            qs = rd(qr[None] * ks[:, :, None, :])  # [n, H_kv, rep, D]
            sc = (np.einsum("nhdg,nhrd->hrng", codes, qs)
                  + np.einsum("nhd,hrd->hrn", kz, qr)[..., None])
            scores.append(sc.reshape(*sc.shape[:2], -1))
            vals.append(f64(blocks_to_tokens(dequantize_value_blocks(
                pool.v_codes[idx], pool.v_scales[idx], pool.v_zeros[idx], bits=bits))))
        if t:
            scores.append(np.einsum("htd,hrd->hrt", f64(pool.tail_k[s, :, :t]), qi))
            vals.append(f64(pool.tail_v[s, :, :t]))
        if not scores:
            outs.append(np.zeros(q.shape[1:]))
            extra.append(0.0)
            continue
        logits = np.concatenate(scores, axis=-1) * scale
        v = np.concatenate(vals, axis=1)
        p = np.exp(logits - logits.max(axis=-1, keepdims=True))
        p /= p.sum(axis=-1, keepdims=True)
        outs.append(np.einsum("hrt,htd->hrd", p, v).reshape(q.shape[1:]))
        extra.append(6 * UNIT_ROUNDOFF[sd] * float(np.abs(v).max()))
    return (mx.array(np.stack(outs).astype(np.float32)),
            np.array(extra, dtype=np.float64)[:, None, None])


def expect(q, pool, table, nb, slots, tl, *, scale, bits, group_size=32):
    """(reference, extra tolerance) for the split kernel this call dispatches to."""
    args = (q, pool, table, nb, slots, tl)
    if (backend() is kivi_cuda
            and cuda_attend.mma_supports(q.shape, pool, bits, group_size) is None):
        return oracle_fold(*args, scale=scale, bits=bits, group_size=group_size)
    return oracle(*args, scale=scale, bits=bits, group_size=group_size), None


def check_kernel(args, dtype, label, *, scale, bits, group_size=32):
    """Run the backend's decode kernel on args and compare with its oracle."""
    out = backend().kivi_decode_attend(*args, scale=scale, bits=bits, group_size=group_size)
    ref, extra = expect(*args, scale=scale, bits=bits, group_size=group_size)
    check_close(out, ref, dtype, label, extra)
    return out
