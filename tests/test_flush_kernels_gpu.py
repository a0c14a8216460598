"""The KIVI flush kernels (CUDA / Metal) against the reference: codes, scales and
zeros bit for bit (a flush has no a*b+c), in place, one layer or all layers at
once. Skipped where MLX has neither backend."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from gpu_helpers import NEEDS_GPU, backend, to_np
from kiviq.kernels import dispatch, kivi_cuda
from kiviq.kernels.cuda_flush import MAX_FLUSH_LAYERS
from kiviq.kernels.kivi_reference import flush_tails
from kiviq.kernels.layout import KiviPool, allocate_pool
from kiviq.kernels.qk_rope import Prologue

R = 128


def _tails(rng, shape, kind):
    if kind == "grid":  # few distinct values: many exact ties for round-half-even
        return rng.integers(-8, 8, size=shape) * 0.25
    if kind == "offset":  # narrow groups far from 0: the rounding of zero matters
        return 40.0 + rng.normal(size=shape) * 0.05
    x = rng.normal(size=shape) * rng.choice([1e-4, 1.0, 20.0])
    x[..., 3] = 1.5  # a constant key channel
    x[:, :, 5, :16] = -2.0  # a constant value group (G = 16)
    return x


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
@pytest.mark.parametrize("g", [16, 32, 128])
@pytest.mark.gpu
@NEEDS_GPU
def test_flush_kernel_is_bit_exact(bits, dtype, g):
    rng = np.random.default_rng(bits + g)
    be = backend()
    for kind in ("normal", "grid", "offset"):
        pools = []
        for _ in range(2):
            pool = allocate_pool(12, 6, 2, 128, bits=bits, group_size=g, residual=R,
                                 dtype=dtype)
            pools.append(pool)
        x = {n: _tails(rng, pools[0].tail_k.shape, kind) for n in ("tail_k", "tail_v")}
        for pool in pools:
            for n, a in x.items():
                getattr(pool, n)[...] = mx.array(a.astype(np.float32)).astype(dtype)
            mx.eval(*pool)
        slots, ids = mx.array([4, 0, 2]), mx.array([7, 1, 11])
        lens = mx.array([R + g, g, R + 3])
        be.kivi_flush(pools[0], slots, ids, lens, bits=bits, group_size=g)
        flush_tails(pools[1], slots, ids, lens, bits=bits, group_size=g)
        for name, a, b in zip(KiviPool._fields, pools[0], pools[1]):
            assert np.array_equal(to_np(a), to_np(b)), f"{name} differs ({kind})"


@pytest.mark.parametrize("bits,k,layers", [(2, 1, 3), (4, 1, 3), (2, 3, 3), (4, 3, 3),
                                           (4, 1, MAX_FLUSH_LAYERS + 3)])
@pytest.mark.gpu
@NEEDS_GPU
def test_multi_block_flush_of_all_layers_kernel_equals_reference(bits, k, layers):
    """flush_layers with k blocks per slot (KVConfig.flush_blocks; the fused kernel on
    CUDA, the gather path on Metal): every pool ends bit-identical to the reference.
    More layers than one launch takes (MAX_FLUSH_LAYERS) are two launches."""
    rng = np.random.default_rng(bits * 7 + k + layers)
    g, dtype = 32, mx.bfloat16
    sets = []
    for use_kernel in (True, False):
        pools = [allocate_pool(16, 5, 2, 128, bits=bits, group_size=g, residual=R + (k - 1) * g, dtype=dtype)
                 for _ in range(layers)]
        sets.append((use_kernel, pools))
    for layer in range(layers):
        x = {n: _tails(rng, sets[0][1][0].tail_k.shape, "normal") for n in ("tail_k", "tail_v")}
        for _, pools in sets:
            for n, a in x.items():
                getattr(pools[layer], n)[...] = mx.array(a.astype(np.float32)).astype(dtype)
            mx.eval(*pools[layer])
    slots, lens = [3, 0], [R + k * g - 1, R + k * g - 1]
    ids = [9, 2, 14, 5, 11, 0][: 2 * k]
    for use_kernel, pools in sets:
        dispatch.flush_layers(pools, slots, ids, lens, bits=bits, group_size=g, use_kernel=use_kernel,
                              blocks_per_slot=k)
    for layer in range(layers):
        for name, a, b in zip(KiviPool._fields, sets[0][1][layer], sets[1][1][layer]):
            assert np.array_equal(to_np(a), to_np(b)), f"layer {layer}: {name} differs"


@pytest.mark.gpu
@NEEDS_GPU
def test_fused_flush_of_all_layers_is_in_place():
    if backend() is not kivi_cuda:
        pytest.skip("the fused flush kernel is CUDA only")
    pools = [allocate_pool(512, 256, 8, 128, bits=4) for _ in range(2)]  # tails: 2 x 80 MiB each
    mx.eval(pools)
    objects = [id(a) for p in pools for a in p]
    dispatch.flush_layers(pools, [5, 9], [100, 7], [R + 31, R + 31], bits=4)  # compile outside
    mx.eval(pools)
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    dispatch.flush_layers(pools, [6, 10], [101, 8], [R + 31, R + 31], bits=4)
    mx.eval(pools)
    assert [id(a) for p in pools for a in p] == objects
    # One copy of a tail array would add 80 MiB; the shifted rows are 2 x 2 x 2 x 160 KiB.
    assert mx.get_peak_memory() - base < 16 * 2**20


@pytest.mark.gpu
@NEEDS_GPU
def test_flush_kernel_is_in_place():
    pool = allocate_pool(512, 256, 8, 128, bits=4)  # tails: 2 x 80 MiB
    mx.eval(*pool)
    objects = [id(a) for a in pool]
    backend().kivi_flush(pool, mx.array([5, 9]), mx.array([100, 7]),
                          mx.array([R + 32, 40]), bits=4)  # compile outside the measure
    mx.eval(*pool)
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    backend().kivi_flush(pool, mx.array([6, 10]), mx.array([101, 8]),
                          mx.array([R + 32, 40]), bits=4)
    mx.eval(*pool)
    assert [id(a) for a in pool] == objects
    # One copy of a tail array would add 80 MiB.
    assert mx.get_peak_memory() - base < 16 * 2**20


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
@pytest.mark.parametrize("g,d", [(16, 64), (32, 128), (128, 128)])
@pytest.mark.gpu
@NEEDS_GPU
def test_forward_blocks_kernel_equals_reference(bits, dtype, g, d):
    """dispatch.write_blocks (a prefill's new blocks: CUDA's in-place kernel, Metal's
    quantize kernel) against the reference: every pool array bit for bit, from keys and
    values in the model's transposed [B, H_kv, L, D] views, blocks at any start."""
    rng = np.random.default_rng(bits * 31 + g + d)
    b, h, length = 3, 2, 3 * g
    first = mx.array([0, g, length, 2 * length + 5, 2 * length + 2 * g - 3], dtype=mx.int32)
    ids = mx.array([7, 0, 11, 3, 9], dtype=mx.int32)
    for kind in ("normal", "grid", "offset"):
        # Stored [B, L, H_kv, D] and passed transposed, as the model's projections come.
        x = {n: mx.array(np.swapaxes(_tails(rng, (b, h, length, d), kind), 1, 2).astype(np.float32)).astype(dtype)
             for n in ("keys", "values")}
        pools = []
        for use_kernel in (True, False):
            pool = allocate_pool(12, 2, h, d, bits=bits, group_size=g, residual=R, dtype=dtype)
            mx.eval(*pool)
            done = dispatch.write_blocks(pool, mx.swapaxes(x["keys"], 1, 2), mx.swapaxes(x["values"], 1, 2),
                                         first, ids, bits=bits, group_size=g, use_kernel=use_kernel)
            mx.eval(pool, [] if done is None else done)
            pools.append(pool)
        for name, a, c in zip(KiviPool._fields, *pools):
            assert np.array_equal(to_np(a), to_np(c)), f"{name} differs ({kind})"


@pytest.mark.gpu
@NEEDS_GPU
def test_forward_blocks_kernel_is_in_place():
    if backend() is not kivi_cuda:
        pytest.skip("the in-place block write is CUDA only")
    pool = allocate_pool(4096, 8, 8, 128, bits=4)  # codes: 64 MiB per array
    mx.eval(*pool)
    objects = [id(a) for a in pool]
    keys = mx.random.normal((2, 8, 256, 128)).astype(mx.float16)
    first, ids = mx.array([0, 32, 256, 480], dtype=mx.int32), mx.array([5, 900, 17, 4000], dtype=mx.int32)
    mx.eval(keys, dispatch.write_blocks(pool, keys, keys, first, ids, bits=4))  # compile outside
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    mx.eval(dispatch.write_blocks(pool, keys, keys, first, ids + 1, bits=4), *pool)
    assert [id(a) for a in pool] == objects
    # One copy of a code array would add 64 MiB; the keys are 1 MiB.
    assert mx.get_peak_memory() - base < 8 * 2**20


@pytest.mark.parametrize("layers", [3, MAX_FLUSH_LAYERS + 2])
@pytest.mark.gpu
@NEEDS_GPU
def test_step_flush_in_the_graph_runs_before_the_attention(layers):
    """A decode step's flush as ops of its own graph (`dispatch.step_flush`: padded slots,
    never evaluated on its own) and an attention plan made `after` it: the pools and every
    layer's output bit-equal to the flush evaluated first (`flush_layers`), then the same
    plan. An attention that ran before the flush would read blocks not yet written. Six
    of seven sequences flush: more than the launch's blocks per head (STEP_FLUSH_SLOTS),
    so blocks take several slots each."""
    if backend() is not kivi_cuda:
        pytest.skip("the in-graph step flush is CUDA only")
    rng = np.random.default_rng(layers)
    g, bits, dtype, d = 32, 4, mx.bfloat16, 128
    sets = [[allocate_pool(16, 8, 2, d, bits=bits, group_size=g, residual=R, dtype=dtype) for _ in range(layers)]
            for _ in range(2)]
    for layer in range(layers):
        x = {n: _tails(rng, sets[0][0].tail_k.shape, "normal") for n in ("tail_k", "tail_v")}
        for pools in sets:
            for n, a in x.items():
                getattr(pools[layer], n)[...] = mx.array(a.astype(np.float32)).astype(dtype)
            mx.eval(*pools[layer])
    # Seven sequences; those in slots 3, 0, 6, 7, 1, 5 flush one block each, 4 does not.
    slots, flushing, ids = [3, 0, 6, 7, 1, 5, 4], [3, 0, 6, 7, 1, 5], [9, 2, 14, 5, 11, 0]
    meta = (mx.array([[i] for i in ids] + [[0]], dtype=mx.int32), mx.array([1] * 6 + [0], dtype=mx.int32),
            mx.array(slots, dtype=mx.int32), mx.array([R] * 6 + [41], dtype=mx.int32))
    q = mx.array(rng.normal(size=(7, 8, d)).astype(np.float32)).astype(dtype)
    kw = dict(scale=d ** -0.5, bits=bits, group_size=g, use_kernel=True)

    dispatch.flush_layers(sets[1], flushing, ids, [R + g - 1] * 6, bits=bits, group_size=g, use_kernel=True)
    plan = dispatch.attend_plan(q.shape, q.dtype, sets[1][0], *meta, **kw)
    expected = [plan(q, pool) for pool in sets[1]]
    mx.eval(expected)

    padded = mx.array([*flushing, -1] + [*ids, -1] + [*dispatch.step_flush_params(sets[0][0], 1), 7], dtype=mx.int32)
    done = dispatch.step_flush(sets[0], padded[:7], padded[7:14], padded[14:], bits=bits, group_size=g)
    plan = dispatch.attend_plan(q.shape, q.dtype, sets[0][0], *meta, **kw, after=done)
    got = [plan(q, pool) for pool in sets[0]]
    mx.eval(got)  # the flush runs only as what the launches depend on

    for layer in range(layers):
        assert np.array_equal(to_np(got[layer]), to_np(expected[layer])), f"layer {layer}: output differs"
        for name, a, b in zip(KiviPool._fields, sets[0][layer], sets[1][layer]):
            assert np.array_equal(to_np(a), to_np(b)), f"layer {layer}: {name} differs"


@pytest.mark.parametrize("layout,prologue", [
    (dict(bits=4, group_size=32, head_dim=128, num_q_heads=32, num_kv_heads=8, dtype=mx.bfloat16),
     Prologue(32, 8, rope_base=1e6, eps=1e-6, norm=True)),
    (dict(bits=2, group_size=32, head_dim=128, num_q_heads=32, num_kv_heads=8, dtype=mx.bfloat16),
     Prologue(32, 8, rope_base=1e6, eps=1e-6, norm=True, rotate=True)),
    (dict(bits=2, group_size=32, head_dim=64, num_q_heads=9, num_kv_heads=3, dtype=mx.float16),
     Prologue(9, 3, rope_base=1e5))], ids=["qwen3-4b-4bit", "qwen3-4b-2r", "smollm2-2bit"])
@pytest.mark.gpu
@NEEDS_GPU
def test_the_start_up_self_check_passes_and_covers_the_step(layout, prologue):
    from kiviq.kernels.self_check import self_check
    pool = allocate_pool(2, 1, layout["num_kv_heads"], layout["head_dim"], bits=layout["bits"],
                         group_size=layout["group_size"], residual=R, dtype=layout["dtype"])
    if backend() == "cuda":  # the step's in-graph flush and its prologue are among what it checks
        assert dispatch.step_flush_params(pool, 1) is not None
        assert kivi_cuda.prologue_supports((1, prologue.n_heads, layout["head_dim"]), layout["dtype"], pool,
                                           prologue) is None
    assert self_check(**layout, residual=R, prologue=prologue) is None
