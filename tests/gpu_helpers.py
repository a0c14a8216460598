"""What the KIVI kernel tests share: the skip for machines without a GPU kernel,
the backend module that runs here, and arrays as float numpy for comparisons."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import kiviq.kernels.kivi_metal
from kiviq.kernels import dispatch, kivi_cuda

NEEDS_GPU = pytest.mark.skipif(
    not dispatch.kernel_available(),
    reason="needs MLX's CUDA backend (Linux+NVIDIA) or Metal (Apple silicon); this "
    "machine has neither (the Metal kernels were written without Apple hardware: only "
    "tests/test_metal_source.py checks them, that they parse and their index math)",
)
gpu = [pytest.mark.gpu, NEEDS_GPU]


def backend():
    return kivi_cuda if kivi_cuda.available() else kiviq.kernels.kivi_metal


def to_np(a: mx.array) -> np.ndarray:
    return np.array(a.astype(mx.float32) if a.dtype in (mx.bfloat16, mx.float16) else a)
