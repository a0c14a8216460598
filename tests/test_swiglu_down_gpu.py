"""An MLP's SwiGLU and down projection for one row in one launch (kernels/cuda/swiglu_down.cu)
against the stock ops it replaces (mlx-lm's compiled SwiGLU, then MLX's gemv): the same
bits, so the engine's tokens do not change (CUDA only). The sizes cover each of MLX's
gemv lane widths (4 values a lane where F is a multiple of 128, 2 where of 64, else 1)
and output sizes that leave the last thread block partly empty."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from kiviq.engine.fused_trunk import install_fused_trunk
from kiviq.kernels.swiglu_down import check, supported, swiglu_down, swiglu_down_reference, values_per_lane
from tests.test_model_families import tiny_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not supported(9728, mx.bfloat16), reason="needs MLX's CUDA backend (the kernel is CUDA only)")]


def bits(a: mx.array) -> np.ndarray:
    return np.array(a.view(mx.uint16))


def operands(hidden: int, out_size: int, dtype, rows: int = 1, seed: int = 0):
    rng = np.random.default_rng(hidden * 31 + out_size + seed)
    gate_up = rng.standard_normal((rows, 1, 2 * hidden)) * rng.uniform(0.5, 4.0, 2 * hidden)
    weight = rng.standard_normal((out_size, hidden)) / np.sqrt(hidden)
    return tuple(mx.array(a.astype(np.float32), dtype=dtype) for a in (gate_up, weight))


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("hidden,out_size", [(9728, 2560), (1536, 576), (14336, 4096), (192, 40), (200, 17), (1000, 130),
                                             (24576, 64)])
def test_swiglu_and_down_are_the_stock_ops_bit_for_bit(dtype, hidden, out_size):
    gate_up, weight = operands(hidden, out_size, dtype)
    got = swiglu_down(gate_up, weight)
    want = swiglu_down_reference(gate_up, weight)
    assert got.shape == want.shape == (1, 1, out_size) and got.dtype == want.dtype
    same = bits(got) == bits(want)
    assert same.all(), f"{values_per_lane(hidden)} a lane: {np.count_nonzero(~same)} of {same.size} values differ"


def test_several_rows_get_the_stock_ops():
    gate_up, weight = operands(1536, 576, mx.bfloat16, rows=3)
    assert (bits(swiglu_down(gate_up, weight)) == bits(swiglu_down_reference(gate_up, weight))).all()


def test_the_start_up_check_passes():
    assert check(9728, 2560, mx.bfloat16) is None and check(1536, 576, mx.float16) is None


def test_rows_too_wide_for_shared_memory_or_not_in_vectors_of_8_are_not_supported():
    assert supported(24576, mx.bfloat16) and not supported(24584, mx.bfloat16)
    assert not supported(1001, mx.bfloat16)


def test_a_bf16_model_gets_the_kernel_by_default():
    model = tiny_model("qwen3")
    model.set_dtype(mx.bfloat16)
    from kiviq.engine.fused_projections import fuse_projections
    fuse_projections(model)
    assert install_fused_trunk(model)
    assert model.model._swiglu_down is swiglu_down
