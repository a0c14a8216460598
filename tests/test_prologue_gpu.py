"""The decode prologue inside the split kernels (`AttendPlan.with_prologue`, what the
engine's decode step runs on CUDA: engine.decode_attention) against the stock ops
(`Prologue.reference`: mlx.fast.rms_norm and mlx.fast.rope on the split projection,
and for a 2r cache mx.hadamard_transform of q, k and v) followed by the plain launch
that takes the new token: the same output bits and the same tails, so the engine's
tokens do not change (CUDA only)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from kiviq.kernels import dispatch, kivi_cuda
from kiviq.kernels.layout import KiviPool
from kiviq.kernels.qk_rope import Prologue
from gpu_helpers import to_np
from kernel_oracles import R, make_case

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not kivi_cuda.available(), reason="needs MLX's CUDA backend (the prologue runs in the CUDA split kernels)")]

# (bits, dtype, head_dim, kv heads, query heads per kv head, q/k norms, 2r rotation)
CASES = [
    (4, mx.bfloat16, 128, 2, 4, True, False),   # Qwen3's layer, the MMA kernel
    (2, mx.float16, 128, 2, 4, True, True),     # 2r
    (4, mx.float16, 128, 2, 4, False, False),   # llama's (no q/k norms)
    (2, mx.bfloat16, 64, 3, 3, False, False),   # SmolLM2-135M's heads
    (8, mx.bfloat16, 128, 2, 4, True, True),    # the CUDA-core kernel
    (8, mx.float16, 64, 1, 8, False, False),
]


def copy(pool: KiviPool) -> KiviPool:
    return KiviPool(*(a + mx.zeros_like(a) for a in pool))


@pytest.mark.parametrize("bits,dtype,d,h_kv,rep,norm,rotate", CASES,
                         ids=[f"{c[0]}bit-{'bf16' if c[1] == mx.bfloat16 else 'fp16'}-d{c[2]}-rep{c[4]}"
                              f"{'-norm' if c[5] else ''}{'-2r' if c[6] else ''}" for c in CASES])
def test_prologue_in_the_launch_is_the_stock_ops_then_the_launch(bits, dtype, d, h_kv, rep, norm, rotate):
    rng = np.random.default_rng(bits * 7 + d + rep)
    # The new row at the start, the middle and the end of a tail chunk; empty block lists.
    lens = [(3, 1), (0, 31), (2, 32), (5, 33), (1, R + 31), (0, 64), (4, 96)]
    _, pool, table, nb, slots, tl = make_case(rng, lens=lens, h_kv=h_kv, rep=rep, d=d, bits=bits, dtype=dtype)
    b, h_q = len(lens), h_kv * rep
    # Varied magnitudes per value, as real activations have (the norms then matter).
    width = (h_q + 2 * h_kv) * d
    qkv = mx.array((rng.standard_normal((b, 1, width)) * rng.uniform(0.1, 30.0, (b, 1, width))).astype(np.float32),
                   dtype=dtype)
    offsets = mx.array(rng.integers(0, 40_000, size=b), dtype=mx.int32)
    q_norm = mx.array(rng.uniform(0.2, 2.0, d), dtype=dtype) if norm else None
    k_norm = mx.array(rng.uniform(0.2, 2.0, d), dtype=dtype) if norm else None
    prologue = Prologue(h_q, h_kv, rope_base=1e6 if norm else 1e4, eps=1e-6 if norm else 0.0, norm=norm,
                        rotate=rotate)
    q, k, v = prologue.reference(qkv, offsets, q_norm, k_norm)
    shape = (b, h_q, 1, d)
    plain = kivi_cuda.AttendPlan(shape, dtype, pool, table, nb, slots, tl, scale=0.1, bits=bits, group_size=32,
                                 rotate_out=rotate)
    fused = dispatch.prologue_plan(shape, dtype, pool, table, nb, slots, tl, scale=0.1, bits=bits, group_size=32,
                                   prologue=prologue, rotate_out=rotate)
    assert isinstance(fused, kivi_cuda.AttendPlan)
    want_pool, got_pool = copy(pool), copy(pool)
    want = plain(q, want_pool, k, v)
    got = fused.with_prologue(qkv, got_pool, offsets, q_norm, k_norm)
    mx.eval(want, got, *want_pool, *got_pool)
    assert not np.isnan(to_np(got)).any()
    same = np.array(got.view(mx.uint16)) == np.array(want.view(mx.uint16))
    assert same.all(), f"{np.count_nonzero(~same)} of {same.size} output values differ"
    for name in ("tail_k", "tail_v"):
        assert np.array_equal(to_np(getattr(got_pool, name)), to_np(getattr(want_pool, name)), equal_nan=True), name


def test_what_the_kernels_do_not_take_runs_the_stock_ops():
    """No plan where the prologue cannot run in the kernel (the caller then runs
    `Prologue.reference`); a plan made with a prologue refuses a plain call."""
    rng = np.random.default_rng(0)
    _, pool, table, nb, slots, tl = make_case(rng, lens=[(1, 3)], h_kv=2, rep=4, d=128, bits=4, dtype=mx.bfloat16)
    args = (pool, table, nb, slots, tl)
    kw = dict(scale=0.1, bits=4, group_size=32)
    ok = Prologue(8, 2, rope_base=1e6)
    assert dispatch.prologue_plan((1, 8, 1, 128), mx.float16, *args, prologue=ok, **kw) is None  # pool is bf16
    assert dispatch.prologue_plan((1, 8, 1, 128), mx.bfloat16, *args, prologue=Prologue(8, 4, 1e6), **kw) is None
    assert dispatch.prologue_plan((1, 8, 1, 128), mx.bfloat16, *args, prologue=ok, use_kernel=False, **kw) is None
    plan = dispatch.prologue_plan((1, 8, 1, 128), mx.bfloat16, *args, prologue=ok, **kw)
    with pytest.raises(ValueError, match="with_prologue"):
        plan(mx.zeros((1, 8, 1, 128), dtype=mx.bfloat16), pool)
