"""Run the kernels this machine would use once, on a small random case, against the
reference: a compile or launch error, or a kernel that computes something else on
this GPU, driver or MLX build, shows before any request does.

What is checked is what the engine runs (`kernels.dispatch` with `use_kernel=None`):

* flush: both ways the engine flushes, against the reference path
  (`use_kernel=False`) on identical pools, every array bit for bit (the flush
  kernels' contract): `dispatch.flush_layers` of two layers (a flush evaluated on
  its own, as before a first step), and, where a decode step flushes inside its own
  graph (`dispatch.step_flush_params`), `dispatch.step_flush` as a step launches it:
  the flushing slots first, then -1 to the batch's size, more flushing slots than
  thread blocks per head so that a block takes several.
* attend: `dispatch.attend_plan` over a few sequences of different lengths (no block
  and a short tail; blocks and a full tail; ...), called as the engine calls it: with
  the step's new token where the plan writes the tail itself (`dispatch.writes_tail`;
  the tail row it replaces holds NaN, so a read of it shows), after a scatter of
  the token otherwise. The output is compared with `kivi_reference.decode_attention`
  within the tolerance tests/test_kernels_gpu.py states: 1 output ulp relative +
  1e-4 of the row's largest |value| + 6 u max|v| (u: the unit roundoff of the pool
  dtype; the loosest stated contract, the MMA kernel's rounding of p and p * scale).
  The case is built so that the kernels' other deliberate roundings are exact
  (power-of-two scales, zeros on a 1/8 grid, q in the pool dtype: K_hat, V_hat,
  q * scale and p * scale are representable), which is what lets the plain
  reference stand in for the tests' per-kernel oracles. A tail written by the
  plan must equal the scattered one bit for bit.
* prologue (given the model's `Prologue`, where `dispatch.prologue_plan` runs it in
  the launch, as a decode step on CUDA does): the same case from a fused q/k/v row,
  against `Prologue.reference` followed by the plain plan: output and tails bit for
  bit (the prologue kernel's contract).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from kiviq.kernels import dispatch
from kiviq.kernels.kivi_reference import decode_attention
from kiviq.kernels.layout import KiviPool, allocate_pool
from kiviq.kernels.qk_rope import Prologue

OUT_TOL = {mx.float16: 2.0**-10, mx.bfloat16: 2.0**-7, mx.float32: 2.0**-20}
UNIT_ROUNDOFF = {mx.float16: 2.0**-11, mx.bfloat16: 2.0**-8, mx.float32: 2.0**-24}
_MAX_REASON = 600


def self_check(*, bits: int, group_size: int, head_dim: int, num_q_heads: int, num_kv_heads: int,
               dtype: mx.Dtype, residual: int = 128, prologue: Prologue | None = None) -> str | None:
    """Check the kernels `dispatch` chooses here against the reference, once.

    Args:
        bits, group_size, head_dim, num_q_heads, num_kv_heads, dtype, residual: the
            engine's KIVI layout (b, G, D, H_q, H_kv, pool dtype, R).
        prologue: the model's decode prologue, where its attention layers hand the
            kernels their q/k/v projection (`engine.decode_attention`); None: not checked.

    Returns:
        None when the kernels agree with the reference, or when no kernel runs here
        (the reference backend); else a one-line reason: which operation, and its
        mismatch or the exception its compile or launch raised.
    """
    if dispatch.kernel_module() is None:
        return None
    shape = dict(bits=bits, g=group_size, d=head_dim, h_q=num_q_heads, h_kv=num_kv_heads, dtype=dtype,
                 r=residual)
    checks = (("flush", _check_flush), ("attend", _check_attend),
              ("prologue", lambda **kw: None if prologue is None else _check_prologue(**kw, prologue=prologue)))
    for name, check in checks:
        try:
            reason = check(**shape)
        except Exception as e:  # a compile or launch error is the answer, not a crash
            reason = f"raised {type(e).__name__}: {e}"
        if reason is not None:
            return _one_line(f"{name} kernel: {reason}")
    return None


def _one_line(text: str) -> str:
    text = " / ".join(line.strip() for line in text.splitlines() if line.strip())
    return text if len(text) <= _MAX_REASON else text[:_MAX_REASON - 3] + "..."


def _f32(a: mx.array) -> np.ndarray:
    return np.array(a.astype(mx.float32))


def _bits(a: mx.array) -> np.ndarray:
    """The array's bits (NaN and -0 included) as unsigned integers."""
    size = a.dtype.size
    return np.array(a if size == 1 else a.view({2: mx.uint16, 4: mx.uint32}[size]))


def _first_difference(got: KiviPool, want: KiviPool) -> str | None:
    for name, a, b in zip(KiviPool._fields, got, want):
        x, y = _bits(a), _bits(b)
        if not np.array_equal(x, y):
            return f"{name} differs from the reference in {int((x != y).sum())} of {x.size} entries"
    return None


def _normal(rng, shape, dtype) -> mx.array:
    return mx.array(rng.normal(size=shape).astype(np.float32)).astype(dtype)


def _check_flush(*, bits, g, d, h_q, h_kv, dtype, r) -> str | None:
    rng = np.random.default_rng(0)
    batch = 7  # slots; a step's flush gives min(batch, STEP_FLUSH_SLOTS = 4) blocks per head to its 6 flushing slots
    slots, ids = [5, 2, 0, 6, 3, 1], [9, 5, 1, 12, 3, 7]
    layers = [{n: rng.normal(size=(batch, h_kv, r + g, d)).astype(np.float32) for n in ("tail_k", "tail_v")}
              for _ in range(2)]

    def pools():
        made = []
        for x in layers:
            pool = allocate_pool(16, batch, h_kv, d, bits=bits, group_size=g, residual=r, dtype=dtype)
            pool.tail_k[...] = mx.array(x["tail_k"]).astype(dtype)
            pool.tail_v[...] = mx.array(x["tail_v"]).astype(dtype)
            mx.eval(*pool)
            made.append(pool)
        return made

    want = pools()
    dispatch.flush_layers(want, slots, ids, [r + g] * len(slots), bits=bits, group_size=g, use_kernel=False)
    eager = pools()
    dispatch.flush_layers(eager, slots, ids, [r + g] * len(slots), bits=bits, group_size=g)
    arms = [("flush_layers", eager)]
    params = dispatch.step_flush_params(want[0], 1)
    if params is not None:
        step = pools()
        pad = [-1] * (batch - len(slots))
        meta = (mx.array(slots + pad, dtype=mx.int32), mx.array(ids + pad, dtype=mx.int32),
                mx.array([*params, batch], dtype=mx.int32))
        mx.eval(dispatch.step_flush(step, *meta, bits=bits, group_size=g))
        arms.append(("step_flush", step))
    mx.eval(*want)
    mx.synchronize()
    for name, got in arms:
        for layer, (a, b) in enumerate(zip(got, want)):
            diff = _first_difference(a, b)
            if diff is not None:
                return f"{name}, layer {layer}: {diff}"
    return None


def _attend_case(*, bits, g, d, h_q, h_kv, dtype, r, seed=1):
    """(q [B, H_q, 1, D], pool, block_tables, num_blocks, slots, tail_lens, k_new, v_new):
    the tail rows at tail_len - 1 hold NaN, k_new / v_new the step's token."""
    rng = np.random.default_rng(seed)
    lens = [(0, 3), (3, r), (6, r + g - 1), (1, max(1, g - 1))]  # (blocks, tail_len incl. the new token)
    b, p = len(lens), 8 // bits
    total = sum(n for n, _ in lens)
    nb_pool = total + 2
    levels = 2**bits - 1
    pool = allocate_pool(nb_pool, b + 1, h_kv, d, bits=bits, group_size=g, residual=r, dtype=dtype)
    pool.k_codes[...] = mx.array(rng.integers(0, 256, size=(nb_pool, h_kv, d, g // p), dtype=np.uint8))
    pool.v_codes[...] = mx.array(rng.integers(0, 256, size=(nb_pool, h_kv, g, d // p), dtype=np.uint8))
    # Values span about [-2, 4]; scales are powers of two and zeros on a 1/8 grid, so
    # code * scale + zero is exact in fp16 and bf16 at 2 and 4 bits (5 significant bits).
    top = 2.0 ** np.floor(np.log2(4.0 / levels))
    for name in ("k_scales", "v_scales"):
        shape = getattr(pool, name).shape
        getattr(pool, name)[...] = mx.array(top / rng.choice([1.0, 2.0], size=shape).astype(np.float32)).astype(dtype)
    for name in ("k_zeros", "v_zeros"):
        shape = getattr(pool, name).shape
        getattr(pool, name)[...] = mx.array(-rng.integers(0, 17, size=shape).astype(np.float32) / 8).astype(dtype)
    slots = rng.permutation(b + 1)[:b].astype(np.int32)
    tail = {n: rng.normal(size=pool.tail_k.shape).astype(np.float32) for n in ("tail_k", "tail_v")}
    ids = 1 + rng.permutation(nb_pool - 1)[:total]
    table = np.zeros((b, max(n for n, _ in lens) + 1), dtype=np.int32)
    at = 0
    for i, (n, t) in enumerate(lens):
        table[i, :n] = ids[at:at + n]
        at += n
        for a in tail.values():
            a[slots[i], :, t - 1] = np.nan  # stale: the new token goes here
    pool.tail_k[...] = mx.array(tail["tail_k"]).astype(dtype)
    pool.tail_v[...] = mx.array(tail["tail_v"]).astype(dtype)
    q = _normal(rng, (b, h_q, 1, d), dtype)
    k_new, v_new = (_normal(rng, (b, h_kv, 1, d), dtype) for _ in range(2))
    mx.eval(*pool, q, k_new, v_new)
    return (q, pool, mx.array(table), mx.array([n for n, _ in lens], dtype=mx.int32), mx.array(slots),
            mx.array([t for _, t in lens], dtype=mx.int32), k_new, v_new)


def _write_token(pool: KiviPool, slots, tail_lens, k_new, v_new) -> None:
    """The engine's scatter of the step's token into the tails (KiviStore.write_decode)."""
    b, h_kv = k_new.shape[:2]
    shape = (b, h_kv, 1)
    index = (mx.broadcast_to(slots[:, None, None], shape),
             mx.broadcast_to(mx.arange(h_kv, dtype=mx.int32)[None, :, None], shape),
             mx.broadcast_to((tail_lens - 1)[:, None, None], shape))
    pool.tail_k[index] = k_new
    pool.tail_v[index] = v_new
    mx.eval(*pool)


def _attend_with_token(plan, q, pool: KiviPool, slots, tail_lens, k_new, v_new) -> mx.array:
    """`plan`'s output called as the engine calls it: given the step's token where it
    writes the tail itself, after the token's scatter otherwise."""
    if dispatch.writes_tail(plan):
        return plan(q, pool, k_new, v_new)
    _write_token(pool, slots, tail_lens, k_new, v_new)
    return plan(q, pool)


def _tails_differ(got: KiviPool, want: KiviPool, what: str) -> str | None:
    for name in ("tail_k", "tail_v"):
        if not np.array_equal(_bits(getattr(got, name)), _bits(getattr(want, name))):
            return f"{name} after the step differs from {what}"
    return None


def _check_attend(*, bits, g, d, h_q, h_kv, dtype, r) -> str | None:
    q, got_pool, table, nb, slots, tl, k_new, v_new = _attend_case(bits=bits, g=g, d=d, h_q=h_q, h_kv=h_kv,
                                                                   dtype=dtype, r=r)
    want_pool = _attend_case(bits=bits, g=g, d=d, h_q=h_q, h_kv=h_kv, dtype=dtype, r=r)[1]
    _write_token(want_pool, slots, tl, k_new, v_new)
    scale = d**-0.5
    plan = dispatch.attend_plan(q.shape, q.dtype, got_pool, table, nb, slots, tl, scale=scale, bits=bits,
                                group_size=g)
    out = _attend_with_token(plan, q, got_pool, slots, tl, k_new, v_new)
    mx.eval(out, *got_pool)
    mx.synchronize()
    ref = decode_attention(q[:, :, 0].astype(mx.float32), want_pool, table, nb, slots, tl, scale=scale,
                           bits=bits, group_size=g)
    o, e = _f32(out).reshape(ref.shape), _f32(ref)
    # max |v|: the tails' and the new token's, or a block value's (codes * scale <= 4, |zero| <= 2)
    vmax = max(6.0, *(float(np.abs(_f32(a)).max()) for a in (want_pool.tail_v, v_new)))
    bound = (OUT_TOL.get(dtype, 2.0**-10) * np.abs(e) + 1e-4 * np.abs(e).max(axis=-1, keepdims=True)
             + 6 * UNIT_ROUNDOFF.get(dtype, 2.0**-11) * vmax)
    err = np.abs(o - e)
    bad = ~(err <= bound)  # NaN counts as bad
    if bad.any():
        worst = float(np.nanmax(np.where(np.isnan(err), np.inf, err)))
        return (f"output differs from the reference in {int(bad.sum())} of {bad.size} values, "
                f"max error {worst:.3g} (bound {float(bound.max()):.3g})")
    return _tails_differ(got_pool, want_pool, "the tail with the token written")


def _check_prologue(*, bits, g, d, h_q, h_kv, dtype, r, prologue: Prologue) -> str | None:
    case = dict(bits=bits, g=g, d=d, h_q=h_q, h_kv=h_kv, dtype=dtype, r=r)
    _, got_pool, table, nb, slots, tl, _, _ = _attend_case(**case)
    want_pool = _attend_case(**case)[1]
    b, scale = table.shape[0], d**-0.5
    shape = (b, h_q, 1, d)
    plan = dispatch.prologue_plan(shape, dtype, got_pool, table, nb, slots, tl, scale=scale, bits=bits,
                                  group_size=g, prologue=prologue, rotate_out=prologue.rotate)
    if plan is None:  # the engine runs Prologue.reference and the plain plan here, as below
        return None
    rng = np.random.default_rng(2)
    width = (h_q + 2 * h_kv) * d
    # Magnitudes varied per value, as real activations are: the norms then matter.
    qkv = mx.array(rng.normal(size=(b, 1, width)) * rng.uniform(0.1, 30.0, size=(b, 1, width)), dtype=dtype)
    offsets = mx.array(rng.integers(0, 40_000, size=b), dtype=mx.int32)
    q_norm, k_norm = (mx.array(rng.uniform(0.2, 2.0, size=d), dtype=dtype) if prologue.norm else None
                      for _ in range(2))
    out = plan.with_prologue(qkv, got_pool, offsets, q_norm, k_norm)
    q, k, v = prologue.reference(qkv, offsets, q_norm, k_norm)
    plain = dispatch.attend_plan(shape, dtype, want_pool, table, nb, slots, tl, scale=scale, bits=bits,
                                 group_size=g, rotate_out=prologue.rotate)
    want = _attend_with_token(plain, q, want_pool, slots, tl, k, v)
    mx.eval(out, want, *got_pool, *want_pool)
    mx.synchronize()
    x, y = _bits(out), _bits(want)
    if not np.array_equal(x, y):
        return (f"output differs from Prologue.reference then the plain launch in {int((x != y).sum())} "
                f"of {x.size} values")
    return _tails_differ(got_pool, want_pool, "the tail Prologue.reference's token was written into")


__all__ = ["self_check"]
