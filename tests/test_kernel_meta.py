"""The kernels' small per-step inputs: what reaches the launches must be the same
values in the same shapes and dtypes (kernels.launch.const and upload,
kernels.cuda_flush.flush_meta; KiviStore.begin_decode's in tests/test_kv_store.py).

On CUDA each comes from an upload, a cast whose output is device memory, where a
host-made array is MLX managed memory (kernels.launch.upload says why that matters).
These checks run on any backend, the launches themselves in tests/test_kernels_gpu.py.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from kiviq.kernels import cuda_flush
from kiviq.kernels.launch import LOG2E, const, const_values, upload
from kiviq.kernels.layout import allocate_pool


def _same(a: mx.array, b: mx.array) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and bool(mx.array_equal(a, b).item())


@pytest.mark.parametrize("values,dtype", [((5, 2, 3, 160, 5, 1), mx.int32),
                                          ((0.125 * LOG2E,) * 4, mx.float32),
                                          ((1e-6, 13.28771238, 1.0), mx.float32),
                                          ((0.0,), mx.bfloat16), ((7, 2), mx.int32)])
def test_const_holds_its_values_on_or_off_the_device(values, dtype):
    """A const past MLX's shared pool of <= 8-byte host arrays is a device copy
    (an op's output); both kinds give back their exact values."""
    a = const(values, dtype)
    assert _same(a, mx.array(list(values), dtype=dtype))
    assert const(values, dtype) is a and const_values(a) == values


def test_flush_meta_is_the_same_values():
    pool = allocate_pool(8, 4, 2, 64, bits=4, group_size=32, residual=128)
    slots, ids = mx.array([3, 1], dtype=mx.int32), mx.array([6, 7, 2, 5], dtype=mx.int32)
    got = cuda_flush.flush_meta(pool, slots, ids, 2)
    assert _same(got[0], slots) and _same(got[1], ids)
    assert _same(got[2], const((160, 2, 2), mx.int32))


def test_upload_keeps_every_bit_of_int32_values():
    values = np.array([0, 1, -1, 2**31 - 1, -(2**31), 123456], dtype=np.int32)
    got = upload(values)
    assert got.dtype == mx.int32 and got.shape == (6,)
    assert np.array_equal(np.array(got), values)
    # A float's bits travel too (the attention's query scale does).
    bits = np.array([0.125 * LOG2E], dtype=np.float32).view(np.int32)
    assert np.array(upload(bits).view(mx.float32))[0] == np.float32(0.125 * LOG2E)
    assert np.array_equal(np.array(upload([3, 4])), [3, 4])

