"""The residual add and RMSNorm in one launch (kernels/cuda/add_rms_norm.cu) against
the stock ops it replaces (an add, then mlx.fast.rms_norm): the same bits, so the
engine's tokens do not change (CUDA only). The plan's row sizes cover each of MLX's
rms_norm_small layouts (64 threads with one chunk, 128 threads with whole chunks, 64
threads with whole chunks, 128 threads with a partial last chunk)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from kiviq.engine.fused_trunk import install_fused_trunk
from kiviq.kernels.add_rms_norm import add_rms_norm, add_rms_norm_reference, check, norm_plan, supported
from tests.test_model_families import tiny_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not supported(2560, mx.bfloat16), reason="needs MLX's CUDA backend (the kernel is CUDA only)")]


def bits(a: mx.array) -> np.ndarray:
    return np.array(a.view(mx.uint16))


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("size", [128, 576, 1024, 1096, 2048, 2560, 3584, 4096, 5120, 8192])
@pytest.mark.parametrize("rows", [1, 7, 64])
def test_add_and_norm_are_the_stock_ops_bit_for_bit(dtype, size, rows):
    rng = np.random.default_rng(size + rows)
    # A residual stream with a few large channels, as real ones have, and a smaller update.
    x = rng.standard_normal((rows, 1, size)) * rng.uniform(0.05, 8.0, size)
    r = rng.standard_normal((rows, 1, size)) * 0.5
    x, r = (mx.array(a.astype(np.float32), dtype=dtype) for a in (x, r))
    w = mx.array(rng.uniform(0.2, 2.0, size).astype(np.float32), dtype=dtype)
    got = add_rms_norm(x, r, w, 1e-6)
    want = add_rms_norm_reference(x, r, w, 1e-6)
    for name, g, e in zip(("sum", "norm"), got, want):
        assert g.shape == e.shape and g.dtype == e.dtype, name
        same = bits(g) == bits(e)
        assert same.all(), f"{name} {norm_plan(size)}: {np.count_nonzero(~same)} of {same.size} values differ"


def test_the_start_up_check_passes():
    assert check(2560, mx.bfloat16) is None and check(576, mx.float16) is None


def test_a_bf16_model_gets_the_kernel_by_default():
    model = tiny_model("qwen3")
    model.set_dtype(mx.bfloat16)
    assert install_fused_trunk(model)
    assert model.model._add_norm is add_rms_norm


@pytest.mark.parametrize("eps", [1e-5, 0.25])
def test_eps_reaches_the_kernel(eps):
    """eps is a template argument (its float32 bits): a large one changes every value."""
    rng = np.random.default_rng(3)
    x, r = (mx.array(rng.standard_normal((4, 1, 2560)).astype(np.float32) * 0.1, dtype=mx.bfloat16) for _ in range(2))
    w = mx.array(rng.uniform(0.2, 2.0, 2560).astype(np.float32), dtype=mx.bfloat16)
    _, got = add_rms_norm(x, r, w, eps)
    _, want = add_rms_norm_reference(x, r, w, eps)
    assert (bits(got) == bits(want)).all()
    assert not (bits(got) == bits(add_rms_norm_reference(x, r, w, 1e-6)[1])).all()
