"""The kernels' small per-step inputs as views of one array made by an op
(kernels.cuda_attend.device_meta, kernels.cuda_flush.flush_meta).

On CUDA that op's output is device memory, where host-made arrays are MLX managed
memory (kernels.launch.packed_views says why that matters). What the kernels read
must be the same values in the same shapes and dtypes; these checks run on any
backend, the launches themselves in tests/test_kernels_gpu.py.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from kiviq.kernels import cuda_attend, cuda_flush
from kiviq.kernels.launch import LOG2E, const
from kiviq.kernels.layout import allocate_pool


def _meta(b=3, width=5):
    rng = np.random.default_rng(0)
    tables = mx.array(rng.integers(0, 100, (b, width)).astype(np.int32))
    num_blocks = mx.array([5, 0, 2], dtype=mx.int32)[:b]
    slots = mx.array([2, 0, 7], dtype=mx.int32)[:b]
    tail_lens = mx.array([1, 31, 160], dtype=mx.int32)[:b]
    params = const((width, 2, 3, 160, 5, 0), mx.int32)
    qscale = const((0.125 * LOG2E,), mx.float32)
    return [tables, num_blocks, slots, tail_lens, params, qscale]


def _same(a: mx.array, b: mx.array) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and bool(mx.array_equal(a, b).item())


@pytest.mark.parametrize("b,width", [(3, 5), (1, 1)])  # B = 1: lengths of 4 bytes each
def test_device_meta_views_hold_the_inputs_and_the_new_token_params(b, width):
    meta = _meta(b, width)
    params_new = const((width, 2, 3, 160, 5, 1), mx.int32)
    rope = (1e-6, 19.931568, 1.0)  # the prologue's eps, log2(RoPE base), RoPE scale
    views, views_new, rope_view = cuda_attend.device_meta(meta, params_new, rope)
    for got, want in zip(views[:5], meta[:5]):
        assert _same(got, want)
    assert _same(views_new[4], params_new)
    for got, want in zip(views_new[:4], meta[:4]):
        assert _same(got, want)
    # The scale four times over (16 bytes: past MLX's shared pool of <= 8-byte arrays).
    assert views[5].shape == (4,) and views[5].dtype == mx.float32
    assert np.all(np.array(views[5]) == np.array(meta[5])[0])
    assert views_new[5] is views[5]
    assert rope_view.dtype == mx.float32 and np.array_equal(np.array(rope_view)[:3], np.array(rope, np.float32))


def test_flush_meta_is_the_same_values():
    pool = allocate_pool(8, 4, 2, 64, bits=4, group_size=32, residual=128)
    slots, ids = mx.array([3, 1], dtype=mx.int32), mx.array([6, 7, 2, 5], dtype=mx.int32)
    got = cuda_flush.flush_meta(pool, slots, ids, 2)
    assert _same(got[0], slots) and _same(got[1], ids)
    assert _same(got[2], const((160, 2, 2, 2), mx.int32))  # tail rows, heads, blocks per slot, slots
