"""The kernels' small per-step inputs as views of one array made by an op
(kernels.kivi_cuda.device_meta / flush_meta).

On CUDA that op's output is device memory, where host-made arrays are MLX managed
memory (docs/benchmarks.md, kernel section, session 11). What the kernels read
must be the same values in the same shapes and dtypes; these checks run on any
backend, the launches themselves in tests/test_kernels_gpu.py.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from kiviq.kernels import kivi_cuda
from kiviq.kernels.layout import allocate_pool


def _meta(b=3, width=5):
    rng = np.random.default_rng(0)
    tables = mx.array(rng.integers(0, 100, (b, width)).astype(np.int32))
    num_blocks = mx.array([5, 0, 2], dtype=mx.int32)[:b]
    slots = mx.array([2, 0, 7], dtype=mx.int32)[:b]
    tail_lens = mx.array([1, 31, 160], dtype=mx.int32)[:b]
    params = kivi_cuda._const((width, 2, 3, 160, 5, 0), mx.int32)
    qscale = kivi_cuda._const((0.125 * kivi_cuda.LOG2E,), mx.float32)
    return [tables, num_blocks, slots, tail_lens, params, qscale]


def _same(a: mx.array, b: mx.array) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and bool(mx.array_equal(a, b).item())


@pytest.mark.parametrize("b,width", [(3, 5), (1, 1)])  # B = 1: lengths of 4 bytes each
def test_device_meta_views_hold_the_inputs_and_the_new_token_params(b, width):
    meta = _meta(b, width)
    params_new = kivi_cuda._const((width, 2, 3, 160, 5, 1), mx.int32)
    views, views_new = kivi_cuda.device_meta(meta, params_new)
    for got, want in zip(views[:5], meta[:5]):
        assert _same(got, want)
    assert _same(views_new[4], params_new)
    for got, want in zip(views_new[:4], meta[:4]):
        assert _same(got, want)
    # The scale four times over (16 bytes: past MLX's shared pool of <= 8-byte arrays).
    assert views[5].shape == (4,) and views[5].dtype == mx.float32
    assert np.all(np.array(views[5]) == np.array(meta[5])[0])
    assert views_new[5] is views[5]


def test_flush_meta_is_the_same_values_and_host_mode_passes_them_through(monkeypatch):
    pool = allocate_pool(8, 4, 2, 64, bits=4, group_size=32, residual=128)
    slots, ids = mx.array([3, 1], dtype=mx.int32), mx.array([6, 7], dtype=mx.int32)
    got = kivi_cuda.flush_meta(pool, slots, ids, 1)
    want_params = kivi_cuda._const((160, 2, 1), mx.int32)
    assert _same(got[0], slots) and _same(got[1], ids) and _same(got[2], want_params)
    monkeypatch.setenv(kivi_cuda.META_ENV, "host")
    host = kivi_cuda.flush_meta(pool, slots, ids, 1)
    assert host[0] is slots and host[1] is ids and _same(host[2], want_params)
