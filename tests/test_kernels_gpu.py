"""KIVI kernels (CUDA / Metal) against the plain-ops reference.

The GPU tests skip where MLX has neither backend; the host-side checks (split plan,
dispatch fallback) run everywhere. Run on a GPU with MLX_ENABLE_TF32=0 so the oracle
(the reference, float32) runs at full float32 precision on the GPU; otherwise it runs
on the CPU stream (slow for the long cases).

Expected mismatches (why the tolerances are not zero):
  * the kernel contracts dequantization `q * scale + zero` into one FMA (the reference
    rounds the product first: ~1 float32 ulp of x_hat), computes the softmax in base 2
    with log2(e) folded into the query scale, and sums tokens and splits in another
    order (split-K, warp shuffles, log-sum-exp merge). All of it float32: the kernel
    and the float32 oracle agree to ~1e-6 of the row's magnitude before the kernel
    rounds to the output dtype;
  * so the kernel's fp16/bf16 output may sit one output ulp away from the float32
    oracle rounded (a tie broken differently): tolerance = 1 ulp of the dtype
    (2^-10 relative for fp16, 2^-7 for bf16) + 1e-4 of the row's largest |value|.
The tensor-core split kernel (`cuda_attend.mma_supports`: bits 2/4, G = 32, D 64/128)
has other numerics on purpose: it never dequantizes (scales folded into q and p), so it
rounds q, q * scale, p and p * scale to the pool's dtype (u = its unit roundoff, 2^-11
in fp16, 2^-8 in bf16), float32 accumulation throughout. Its oracle (`oracle_fold`)
rounds q and q * scale exactly as the kernel does; the rounding of p and of p * scale
adds <= 3 u max|v| of the row's sequence (tolerance: twice that).
The flush kernel has no a*b+c and must match codes, scales and zeros bit for bit.
The cases and oracles are in tests/kernel_oracles.py.
"""

from __future__ import annotations

import time

import mlx.core as mx
import numpy as np
import pytest

from kiviq.kernels import cuda_attend, dispatch, kivi_cuda, launch
from kiviq.kernels.kivi_reference import decode_attention, flush_tails
from kiviq.kernels.layout import KiviPool, allocate_pool
from kiviq.kernels.rotation import hadamard_rotate
from gpu_helpers import NEEDS_GPU, backend, to_np
from kernel_oracles import (
    R,
    UNIT_ROUNDOFF,
    check_close,
    check_kernel,
    expect,
    make_case,
    oracle,
    oracle_fold,
    split_len,
)


# ---- host-side checks (any machine) -------------------------------------------------

def test_split_plan_fills_the_gpu_from_the_shape():
    for b, h_kv, mb in [(1, 8, 1024), (1, 8, 4), (8, 8, 128), (32, 8, 256), (64, 8, 512),
                        (3, 2, 1), (256, 8, 2048)]:
        nsplit, bps = kivi_cuda.split_plan(b, h_kv, mb, 32, sms=132)
        assert bps % 8 == 0  # whole 256-token warp steps
        assert nsplit * bps >= mb  # covers every block
        if mb >= 4 * 8:  # whole 4-warp thread blocks of splits, at most 3 of them empty
            assert nsplit % 4 == 0 and mb > (nsplit - 4) * bps
        else:
            assert mb > (nsplit - 1) * bps
        units = b * h_kv * nsplit
        # Several waves of 4-warp blocks on 132 SMs unless the sequence is too short.
        assert units >= 132 * 16 or nsplit == -(-mb // 8)
    assert kivi_cuda.split_plan(4, 8, 0, 32) == (0, 8)
    # B = 1 at 32k tokens still gets >= 1000 warps.
    assert kivi_cuda.split_plan(1, 8, 1020, 32, sms=132)[0] * 8 >= 1000


def test_sm_count_comes_from_the_cuda_runtime(monkeypatch):
    """split_plan fills the device's SMs: cudaDeviceGetAttribute(multiprocessor count)
    through ctypes, read once; FALLBACK_SMS where no CUDA library loads."""
    from kiviq.kernels import cuda_device

    calls = []

    class Runtime:
        def cudaDeviceGetAttribute(self, out, attr, device):
            calls.append((attr, device))
            out._obj.value = 78
            return 0

    def no_library(name):
        raise OSError(name)

    monkeypatch.setattr(cuda_device.ctypes, "CDLL", lambda name: Runtime() if name == "libcudart.so.13"
                        else no_library(name))
    cuda_device.num_sms.cache_clear()
    try:
        assert cuda_device.num_sms() == 78 and cuda_device.num_sms() == 78
        assert calls == [(16, 0)]  # cudaDevAttrMultiProcessorCount, device 0, asked once
        plan = kivi_cuda.split_plan(1, 8, 1020, 32, step_tokens=32)
        assert plan == kivi_cuda.split_plan(1, 8, 1020, 32, sms=78, step_tokens=32)
        assert plan != kivi_cuda.split_plan(1, 8, 1020, 32, sms=132, step_tokens=32)
        monkeypatch.setattr(cuda_device.ctypes, "CDLL", no_library)
        cuda_device.num_sms.cache_clear()
        assert cuda_device.num_sms() == cuda_device.FALLBACK_SMS
    finally:
        cuda_device.num_sms.cache_clear()


def test_mma_kernel_covers_the_common_layouts():
    pool = allocate_pool(2, 2, 8, 128, bits=4)
    assert cuda_attend.mma_supports((4, 32, 128), pool, 4, 32) is None
    assert cuda_attend.mma_supports((4, 32, 64), pool, 2, 32) is None
    assert "bits=8" in cuda_attend.mma_supports((4, 32, 128), pool, 8, 32)
    assert "G=16" in cuda_attend.mma_supports((4, 32, 128), pool, 4, 16)
    assert "D=256" in cuda_attend.mma_supports((4, 32, 256), pool, 4, 32)
    assert "D=32" in cuda_attend.mma_supports((4, 32, 32), pool, 4, 32)
    # One warp per block-sized step: B = 1 at 32k tokens fills a wave of the GPU.
    nsplit, bps = kivi_cuda.split_plan(1, 8, 1020, 32, sms=132, step_tokens=32)
    assert nsplit * bps >= 1020 and nsplit * 8 >= 132 * 8


@pytest.mark.parametrize("b, mb, plan", [
    # large batches: about UNITS_PER_SM warps per SM, splits of >= MIN_SPLIT_BLOCKS blocks
    (32, 256, (24, 11)), (64, 512, (16, 32)), (128, 128, (8, 16)), (16, 512, (48, 11)), (64, 128, (16, 8)),
    # small batches: fewer, longer splits in whole waves of 3 blocks per SM
    (1, 1024, (172, 6)), (1, 256, (128, 2)), (4, 128, (44, 3)), (8, 128, (24, 6)), (8, 256, (24, 11)),
    (32, 128, (12, 11)),
    # all in one wave anyway: one-block splits
    (1, 128, (128, 1)),
])
def test_mma_split_plan_keeps_splits_long_enough(b, mb, plan):
    """The H200 (132 SMs) plans the kernel arms of benchmarks/kernel_attend.py timed:
    where the occupancy plan's splits are under MIN_SPLIT_BLOCKS blocks, the wave plan
    (8-33% faster there); elsewhere the occupancy plan (the wave plan 0-18% slower)."""
    assert kivi_cuda.split_plan(b, 8, mb, 32, sms=132, step_tokens=32) == plan
    nsplit, bps = plan
    assert nsplit % 4 == 0 and nsplit * bps >= mb and mb > (nsplit - 4) * bps


def test_dispatch_uses_the_reference_without_a_gpu_kernel():
    rng = np.random.default_rng(0)
    args = make_case(rng, lens=[(2, 40), (0, 5)], h_kv=2, rep=2, d=64, bits=4,
                     dtype=mx.float16)
    kw = dict(scale=0.125, bits=4)
    ref = decode_attention(*args, **kw)
    np.testing.assert_array_equal(to_np(dispatch.decode_attend(*args, **kw, use_kernel=False)), to_np(ref))
    if not dispatch.kernel_available():
        assert dispatch.backend() == "reference"
        np.testing.assert_array_equal(to_np(dispatch.decode_attend(*args, **kw)), to_np(ref))
        with pytest.raises(RuntimeError, match="no KIVI kernel"):
            dispatch.decode_attend(*args, **kw, use_kernel=True)
    assert dispatch.backend(use_kernel=False) == "reference"


def test_kernel_template_holds_no_length():
    # Everything that grows (lengths, max blocks, split count) travels as data or in
    # the grid: the templates of a step's plan depend on dtypes, D, G, bits and rep only.
    rng = np.random.default_rng(1)
    seen, grids = set(), set()
    for lens in ([(0, 3)], [(5, 130)], [(300, 150), (1, 7)]):
        q, pool, table, nb, slots, tl = make_case(rng, lens=lens, h_kv=2, rep=4, d=128, bits=4,
                                                  dtype=mx.float16)
        plan = kivi_cuda.AttendPlan(q.shape, q.dtype, pool, table, nb, slots, tl, scale=0.1,
                                    bits=4, group_size=32)
        seen.add((tuple(map(str, plan.split_kw["template"])), tuple(map(str, plan.merge_kw["template"]))))
        grids.add(plan.split_kw["grid"])
    assert len(seen) == 1
    assert len(grids) == 3


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
@pytest.mark.parametrize("bits", [2, 4])
def test_fold_oracle_is_the_reference_within_its_stated_rounding(bits, dtype):
    """oracle_fold (what the MMA kernel is checked against on a GPU) against the
    float32 reference, on any machine: its only departures are the roundings of q and
    q * scale (scores) it models, so the outputs agree within a few ulps of the values;
    a wrong fold (scale or zero on the wrong side) would not."""
    rng = np.random.default_rng(11)
    args = make_case(rng, lens=[(3, 40), (0, 5), (9, 128)], h_kv=2, rep=4, d=128, bits=bits,
                     dtype=dtype)
    ref = to_np(oracle(*args, scale=0.09, bits=bits))
    got, extra = oracle_fold(*args, scale=0.09, bits=bits)
    vmax = extra / (6 * UNIT_ROUNDOFF[dtype])
    err = np.abs(to_np(got) - ref)
    assert np.all(err <= 4 * UNIT_ROUNDOFF[dtype] * vmax), float(err.max())
    assert err.max() > 0  # the roundings are there: the oracle is not the reference itself


def test_step_plan_cuts_the_tail_into_row_splits_and_sizes_the_merge():
    """The host side of one decode step (no GPU needed): MMA splits of one block, the
    tail in 32-row splits counted in params[4] (the kernels and the merge read it), and
    a merge of about 8 splits per warp."""
    rng = np.random.default_rng(3)
    q, pool, table, nb, slots, tl = make_case(rng, lens=[(124, 128)], h_kv=8, rep=4, d=128, bits=4,
                                              dtype=mx.float16)
    plan = kivi_cuda.AttendPlan(q.shape, q.dtype, pool, table, nb, slots, tl, scale=0.1, bits=4,
                                group_size=32)
    mb, bps, nsplit, rg, tail_splits, new_token = np.array(plan.params).tolist()
    assert (rg, tail_splits) == (R + 32, -(-(R + 32) // launch.TAIL_ROWS))
    # params[5]: whether the new token comes with the launch (and is written by it).
    assert new_token == 0 and np.array(plan.meta_new[4]).tolist() == [mb, bps, nsplit, rg, tail_splits, 1]
    # B = 1: one block per split, whole 4-warp thread blocks of them
    assert mb == table.shape[1] and bps == 1 and nsplit == -(-mb // 4) * 4
    nsu = nsplit + tail_splits
    assert plan.split_kw["output_shapes"][0] == (1, 8, nsu, 4, 128)
    assert plan.split_kw["grid"] == (-(-nsu // launch.WARPS) * launch.WARPS * 32, 8, 1)
    mw = cuda_attend.merge_warps(nsu)
    assert plan.merge_kw["threadgroup"] == (mw * 32, 1, 1) and plan.merge_kw["grid"] == (32 * mw * 32, 1, 1)
    too_long = allocate_pool(2, 2, 8, 128, bits=4, residual=32 * launch.MAX_TAIL_SPLITS)
    assert "R + G" in launch.supports((1, 32, 128), mx.float16, too_long, 4, 32)
    assert cuda_attend.merge_warps(1) == 1 and cuda_attend.merge_warps(25) == 4
    assert cuda_attend.merge_warps(1001) == cuda_attend.MERGE_WARPS


# ---- GPU parity ---------------------------------------------------------------------

G = 32
# Lengths in tokens: {1, G-1, G, R+G-1, 4k, 32k}, plus exactly one block with a full
# tail and blocks with an empty tail (tail_len 0 is legal when blocks exist).
SHORT = [1, G - 1, G, R + G - 1]
CASES = {
    "b1": [split_len(1)],
    "b3": [split_len(n) for n in (G - 1, R + G - 1, 4096)],
    "b32": ([split_len(n) for n in (SHORT + [4096, R + G]) * 5] + [(3, 0), (40, 0)]),
}
# (bits, dtype, D) x (H_kv, rep) pairs cycle so every rep in {1, 3, 4, 8} meets both
# dtypes, both head dims and every bit width at least once.
HEADS = [(4, 1), (3, 3), (8, 4), (2, 8)]
COMBOS = [(bits, dtype, d) for bits in (2, 4, 8) for dtype in (mx.float16, mx.bfloat16)
          for d in (64, 128)]
PARAMS = [(*c, *HEADS[(i + i // 4) % 4]) for i, c in enumerate(COMBOS)]


@pytest.mark.parametrize("bits,dtype,d,h_kv,rep", PARAMS,
                         ids=[f"b{p[0]}-{p[1]}-d{p[2]}-kv{p[3]}x{p[4]}".replace("mlx.core.", "")
                              for p in PARAMS])
@pytest.mark.gpu
@NEEDS_GPU
def test_decode_matches_reference(bits, dtype, d, h_kv, rep):
    rng = np.random.default_rng(bits * 1000 + d + rep)
    for name, lens in CASES.items():
        args = make_case(rng, lens=lens, h_kv=h_kv, rep=rep, d=d, bits=bits, dtype=dtype)
        check_kernel(args, dtype, f"{name} bits={bits} d={d} kv={h_kv} rep={rep}",
                     scale=d**-0.5, bits=bits)


@pytest.mark.parametrize("d", [32, 256])  # the CUDA-core split kernel's head dims
@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.gpu
@NEEDS_GPU
def test_decode_matches_reference_at_other_head_dims(d, bits):
    rng = np.random.default_rng(d + bits)
    for dtype in (mx.float16, mx.bfloat16):
        args = make_case(rng, lens=CASES["b3"], h_kv=2, rep=4, d=d, bits=bits, dtype=dtype)
        check_kernel(args, dtype, f"b3 bits={bits} d={d}", scale=d**-0.5, bits=bits)




LONG = [  # the 32k cases: few combos, so the run stays short
    (4, mx.float16, 128, 8, 4, [split_len(32768)]),
    (2, mx.bfloat16, 64, 2, 8, [split_len(32768), split_len(1), split_len(4096)]),
    (8, mx.float16, 128, 3, 3, [split_len(32768)]),
]


@pytest.mark.parametrize("bits,dtype,d,h_kv,rep,lens", LONG,
                         ids=["4bit-fp16-b1", "2bit-bf16-b3", "8bit-fp16-b1"])
@pytest.mark.gpu
@NEEDS_GPU
def test_decode_matches_reference_at_32k(bits, dtype, d, h_kv, rep, lens):
    rng = np.random.default_rng(32768 + bits)
    args = make_case(rng, lens=lens, h_kv=h_kv, rep=rep, d=d, bits=bits, dtype=dtype)
    check_kernel(args, dtype, f"32k bits={bits} B={len(lens)}",
                 scale=d**-0.5, bits=bits)


@pytest.mark.gpu
@NEEDS_GPU
def test_decode_edge_cases():
    rng = np.random.default_rng(5)
    # float32 queries; no quantized block in the whole batch (empty table).
    q, pool, table, nb, slots, tl = make_case(rng, lens=[(0, 7), (0, 1)], h_kv=2, rep=2,
                                              d=64, bits=4, dtype=mx.float16)
    for qq in (q, q.astype(mx.float32)):
        check_kernel((qq, pool, table[:, :0], nb, slots, tl), qq.dtype,
                     f"no blocks {qq.dtype}", scale=0.1, bits=4)
    # A sequence with no tokens at all gets zeros, its neighbours are unaffected.
    q, pool, table, nb, slots, tl = make_case(rng, lens=[(2, 5), (0, 0), (9, 0)], h_kv=2,
                                              rep=3, d=128, bits=2, dtype=mx.bfloat16)
    out = check_kernel((q, pool, table, nb, slots, tl), q.dtype, "empty sequence",
                       scale=0.1, bits=2)
    assert np.all(to_np(out)[1] == 0)
    # group sizes other than 32 (16 and 128 at D=128: the CUDA-core kernel).
    for g in (16, 128):
        args = make_case(rng, lens=[(3, R + 5), (0, 9)], h_kv=2, rep=4, d=128, bits=4,
                         dtype=mx.float16, g=g)
        check_kernel(args, mx.float16, f"G={g}", scale=0.1, bits=4, group_size=g)


@pytest.mark.gpu
@NEEDS_GPU
def test_dispatch_picks_the_kernel_and_use_kernel_false_forces_the_reference():
    rng = np.random.default_rng(9)
    args = make_case(rng, lens=[(4, 130), (0, 9)], h_kv=2, rep=4, d=128, bits=4,
                     dtype=mx.float16)
    kw = dict(scale=0.1, bits=4)
    assert dispatch.backend() in ("cuda", "metal")
    np.testing.assert_array_equal(to_np(dispatch.decode_attend(*args, **kw)),
                                  to_np(backend().kivi_decode_attend(*args, **kw)))
    assert dispatch.backend(use_kernel=False) == "reference"
    np.testing.assert_array_equal(to_np(dispatch.decode_attend(*args, **kw, use_kernel=False)),
                                  to_np(decode_attention(*args, **kw)))


@pytest.mark.gpu
@NEEDS_GPU
def test_plan_takes_the_models_query_layout():
    """The engine passes q as the model made it, [B, H_q, 1, D]: the step plan reads
    and returns that shape with exactly the values of the [B, H_q, D] call."""
    rng = np.random.default_rng(12)
    q, pool, *meta = make_case(rng, lens=[(5, 130), (0, 9), (2, 31)], h_kv=2, rep=4, d=128,
                               bits=4, dtype=mx.bfloat16)
    kw = dict(scale=0.1, bits=4)
    flat = dispatch.attend_plan(q.shape, q.dtype, pool, *meta, **kw)(q, pool)
    q4 = q[:, :, None]
    out = dispatch.attend_plan(q4.shape, q4.dtype, pool, *meta, **kw)(q4, pool)
    assert out.shape == q4.shape
    np.testing.assert_array_equal(to_np(out[:, :, 0]), to_np(flat))


@pytest.mark.gpu
@NEEDS_GPU
@pytest.mark.parametrize("dtype,d,bits", [(mx.bfloat16, 128, 2), (mx.float16, 128, 4), (mx.float16, 64, 2),
                                          (mx.bfloat16, 64, 4)])
def test_a_rotated_plan_rotates_its_output_back_bit_for_bit(dtype, d, bits):
    """rotate_out (a 2r pool): the CUDA merge rotates each output row itself, with the
    bits mx.hadamard_transform gives over the plain plan's output (the op it saves)."""
    rng = np.random.default_rng(d + bits)
    q, pool, *meta = make_case(rng, lens=[(5, 130), (0, 9), (2, 31), (40, 1)], h_kv=2, rep=4, d=d,
                               bits=bits, dtype=dtype)
    q4 = q[:, :, None]
    kw = dict(scale=0.1, bits=bits)
    plain = dispatch.attend_plan(q4.shape, q4.dtype, pool, *meta, **kw)(q4, pool)
    rotated = dispatch.attend_plan(q4.shape, q4.dtype, pool, *meta, **kw, rotate_out=True)(q4, pool)
    assert rotated.shape == q4.shape and rotated.dtype == dtype
    np.testing.assert_array_equal(to_np(rotated), to_np(hadamard_rotate(plain)))
    assert not np.array_equal(to_np(rotated), to_np(plain))


@pytest.mark.gpu
@NEEDS_GPU
def test_growing_lengths_do_not_recompile():
    rng = np.random.default_rng(2)
    be = backend()
    objects = (be.ATTEND_KERNEL, be.MERGE_KERNEL)
    q, pool, table, nb, slots, tl = make_case(rng, lens=[(64, 130), (64, 140)], h_kv=8,
                                              rep=4, d=128, bits=4, dtype=mx.float16)
    times = []
    for step in range(52):  # one more block per call: max_blocks and the split plan grow
        n = 1 + step
        t0 = time.perf_counter()
        out = be.kivi_decode_attend(q, pool, table[:, :n], mx.minimum(nb, n), slots, tl,
                                    scale=0.1, bits=4)
        mx.eval(out)
        times.append(time.perf_counter() - t0)
    assert (be.ATTEND_KERNEL, be.MERGE_KERNEL) == objects  # built once at import
    # An NVRTC compile of the split kernel takes >100 ms; a warm call well under 10 ms.
    later = times[2:]
    assert max(later) < 0.05, f"a later call took {max(later) * 1e3:.1f} ms: recompiled?"
    plans = {kivi_cuda.split_plan(2, 8, n, 32) for n in range(1, 53)}
    assert len(plans) > 3  # the grid really changed along the way


# ---- the new token with the launch ----------------------------------------------------

@pytest.mark.parametrize("bits", [2, 4, 8])  # 8 bits: the CUDA-core kernel
@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
@pytest.mark.gpu
@NEEDS_GPU
def test_new_token_with_the_launch_equals_a_written_tail(bits, dtype):
    """plan(q, pool, k_new, v_new) (the engine's decode step on CUDA) gives the same
    output, bit for bit, as the same plan over a tail the token was scattered into,
    and leaves the same tails. The stale row it replaces is NaN, so a read of it
    instead of k_new / v_new shows; tail lengths put the new row at the start, the
    middle and the end of a 32-row tail chunk."""
    if backend() is not kivi_cuda:
        pytest.skip("only the CUDA plan takes the new token (Metal reads a written tail)")
    rng = np.random.default_rng(bits * 3 + (dtype == mx.bfloat16))
    lens = [(3, 1), (0, 31), (2, 32), (5, 33), (1, R + 31), (0, 64), (4, 96)]
    h_kv, d = 2, 128
    q, pool, table, nb, slots, tl = make_case(rng, lens=lens, h_kv=h_kv, rep=4, d=d, bits=bits, dtype=dtype)
    b = len(lens)
    new = [mx.array(rng.normal(size=(b, h_kv, 1, d)).astype(np.float32)).astype(dtype) for _ in range(2)]
    shape = (b, h_kv, 1)
    index = (mx.broadcast_to(slots[:, None, None], shape),
             mx.broadcast_to(mx.arange(h_kv, dtype=mx.int32)[None, :, None], shape),
             mx.broadcast_to((tl - 1)[:, None, None], shape))

    def copy(p):
        return KiviPool(*(a + mx.zeros_like(a) for a in p))

    written, fresh = copy(pool), copy(pool)
    written.tail_k[index] = new[0]
    written.tail_v[index] = new[1]
    fresh.tail_k[index] = mx.full(new[0].shape, np.nan, dtype=dtype)  # stale rows
    fresh.tail_v[index] = mx.full(new[1].shape, np.nan, dtype=dtype)
    mx.eval(*written, *fresh)
    plan = kivi_cuda.AttendPlan(q.shape, q.dtype, pool, table, nb, slots, tl, scale=0.1, bits=bits,
                                group_size=32)
    expected = plan(q, written)
    got = plan(q, fresh, *new)
    mx.eval(expected, got)
    assert not np.isnan(to_np(got)).any()
    assert mx.array_equal(got, expected).item()
    for name in ("tail_k", "tail_v"):
        assert np.array_equal(to_np(getattr(fresh, name)), to_np(getattr(written, name)), equal_nan=True), name


@pytest.mark.gpu
@NEEDS_GPU
@pytest.mark.parametrize("g", [16, 32])  # the CUDA-core and the MMA split kernel
def test_decode_flush_cycle_with_kernels_matches_reference(g):
    """Engine-like: append a token, attend, flush at R + G; kernels vs reference pools."""
    rng = np.random.default_rng(11)
    r, bits, h_kv, rep, d = 2 * g, 4, 2, 2, 64
    pools = [allocate_pool(40, 3, h_kv, d, bits=bits, group_size=g, residual=r)
             for _ in range(2)]
    tables, tail_lens, free = {0: [], 2: []}, {0: 0, 2: 0}, list(range(40))
    order = [2, 0]
    for _ in range(3 * (r + g) // 2 + 3 * g):  # >= 3 blocks flushed per sequence
        for slot in order:
            k, v = (mx.array(rng.normal(size=(h_kv, d)).astype(np.float16)) for _ in range(2))
            for pool in pools:
                pool.tail_k[slot, :, tail_lens[slot]] = k
                pool.tail_v[slot, :, tail_lens[slot]] = v
            tail_lens[slot] += 1
        mb = max(len(tables[s]) for s in order)
        table = mx.array([tables[s] + [0] * (mb - len(tables[s])) for s in order],
                         dtype=mx.int32).reshape(2, mb)
        q = mx.array(rng.normal(size=(2, h_kv * rep, d)).astype(np.float16))
        args = (table, mx.array([len(tables[s]) for s in order]), mx.array(order),
                mx.array([tail_lens[s] for s in order]))
        out = dispatch.decode_attend(q, pools[0], *args, scale=d**-0.5, bits=bits,
                                     group_size=g, use_kernel=True)
        ref, extra = expect(q, pools[1], *args, scale=d**-0.5, bits=bits, group_size=g)
        check_close(out, ref, mx.float16, "cycle", extra)
        full = [s for s in order if tail_lens[s] == r + g]
        if full:
            ids = [free.pop() for _ in full]
            fargs = (mx.array(full), mx.array(ids), mx.array([tail_lens[s] for s in full]))
            dispatch.flush(pools[0], *fargs, bits=bits, group_size=g, use_kernel=True)
            flush_tails(pools[1], *fargs, bits=bits, group_size=g)
            for s, bid in zip(full, ids):
                tables[s].append(bid)
                tail_lens[s] -= g
    for name, a, b in zip(KiviPool._fields, *pools):
        assert np.array_equal(to_np(a), to_np(b)), name
    assert len(tables[0]) >= 3
