"""The one-launch decode prologue (kernels/cuda/qk_rope.cu) against the stock ops
it replaces (mlx.fast.rms_norm and mlx.fast.rope on the split projection, and for a
2r cache mx.hadamard_transform of q, k and v): the same bits, so the engine's tokens
do not change (CUDA only)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from kiviq.kernels.qk_rope import qk_rope, qk_rope_reference, supported

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not supported(128, mx.bfloat16), reason="needs MLX's CUDA backend (the prologue kernel is CUDA only)")]


def bits(a: mx.array) -> np.ndarray:
    return np.array(a.view(mx.uint16))


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("d,h_q,h_kv,norm,base", [(128, 32, 8, True, 1e6), (128, 16, 16, False, 5e5),
                                                   (64, 9, 3, False, 1e5), (64, 8, 2, True, 1e4)],
                         ids=["qwen3-4b", "mha", "smollm2", "d64-norm"])
@pytest.mark.parametrize("b", [1, 5, 64])
@pytest.mark.parametrize("rotate", [False, True], ids=["plain", "2r"])
def test_prologue_is_the_stock_ops_bit_for_bit(dtype, d, h_q, h_kv, norm, base, b, rotate):
    rng = np.random.default_rng(b * d + h_q)
    width = (h_q + 2 * h_kv) * d
    # Varied magnitudes per head, as real activations have (norms then matter).
    qkv = mx.array((rng.standard_normal((b, 1, width)) * rng.uniform(0.1, 30.0, (b, 1, width))).astype(np.float32),
                   dtype=dtype)
    offsets = mx.array(rng.integers(0, 40_000, size=b), dtype=mx.int32)
    kw = dict(n_heads=h_q, n_kv_heads=h_kv, rope_base=base, rope_scale=1.0, rotate=rotate)
    if norm:
        kw.update(q_weight=mx.array(rng.uniform(0.2, 2.0, d), dtype=dtype),
                  k_weight=mx.array(rng.uniform(0.2, 2.0, d), dtype=dtype), eps=1e-6)
    got = qk_rope(qkv, offsets, **kw)
    want = qk_rope_reference(qkv, offsets, **kw)
    for name, g, w in zip("qkv", got, want):
        assert g.shape == w.shape and g.dtype == w.dtype, name
        same = bits(g) == bits(w)
        assert same.all(), f"{name}: {np.count_nonzero(~same)} of {same.size} values differ"


def test_prologue_rejects_more_than_one_token():
    qkv = mx.zeros((2, 3, 48 * 128), dtype=mx.bfloat16)
    with pytest.raises(ValueError, match="one token"):
        qk_rope(qkv, mx.zeros((2,), dtype=mx.int32), n_heads=32, n_kv_heads=8, rope_base=1e6)
