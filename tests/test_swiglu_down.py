"""The one-row SwiGLU + down projection's plan and reference (kernels/swiglu_down.py), on
any backend; the kernel's bits against the stock ops are tests/test_swiglu_down_gpu.py's."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from kiviq.engine.fused_projections import fuse_projections
from kiviq.kernels.swiglu_down import loads_ahead, rows_per_block, swiglu_down, swiglu_down_reference, values_per_lane
from tests.test_model_families import tiny_model


def test_the_reference_is_mlx_lms_mlp_bit_for_bit():
    model = tiny_model("qwen3")
    mlp = model.model.layers[0].mlp
    x = mx.random.normal((1, 1, mlp.gate_proj.weight.shape[1]), key=mx.random.key(4))
    want = mlp(x)
    fuse_projections(model)
    got = swiglu_down_reference(mlp.gate_up_proj(x), mlp.down_proj.weight)
    assert np.array_equal(np.array(got), np.array(want))


def test_one_block_per_sm_where_the_rows_allow():
    assert rows_per_block(2560, 132) == 20 and -(-2560 // 20) <= 132  # Qwen3-4B: 128 blocks
    assert rows_per_block(4096, 132) == 32  # at most 1,024 threads
    assert rows_per_block(8192, 132) == 32
    assert rows_per_block(576, 132) == 5 and rows_per_block(17, 132) == 1


def test_a_block_of_1024_threads_keeps_fewer_loads_in_flight():
    assert loads_ahead(20) == 16 and loads_ahead(32) == 8  # 64 registers a thread at 1,024


def test_mlxs_gemv_lane_widths():
    assert [values_per_lane(f) for f in (9728, 1536, 192, 200)] == [4, 4, 2, 1]


def test_without_the_kernel_the_stock_ops_run():
    if mx.cuda.is_available():
        return
    gate_up = mx.random.normal((1, 1, 64), key=mx.random.key(1))
    weight = mx.random.normal((8, 32), key=mx.random.key(2))
    assert np.array_equal(np.array(swiglu_down(gate_up, weight)), np.array(swiglu_down_reference(gate_up, weight)))
