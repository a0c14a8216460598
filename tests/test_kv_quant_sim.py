"""The pieces of the 2-bit fake-quantization simulation (benchmarks/kv_quant_sim.py)
that live in the product: the Hadamard rotation, fake quantization, byte accounting."""

import mlx.core as mx
import numpy as np
import pytest

from kiviq.kernels import (
    allocate_pool,
    dequantize_key_blocks,
    dequantize_value_blocks,
    quantize_key_blocks,
    quantize_value_blocks,
    tokens_to_blocks,
)
from kiviq.kernels.kivi_quant import fake_quantize_keys, fake_quantize_values
from kiviq.kernels.layout import bytes_per_token
from kiviq.kernels.rotation import hadamard, rotate, unrotate


@pytest.mark.parametrize("n", [1, 2, 16, 64, 128])
@pytest.mark.parametrize("seed", [None, 0, 7])
def test_hadamard_is_orthogonal(n, seed):
    m = np.array(hadamard(n, seed), dtype=np.float64)
    np.testing.assert_allclose(m @ m.T, np.eye(n), atol=1e-6)
    np.testing.assert_allclose(m.T @ m, np.eye(n), atol=1e-6)
    # Every entry is +-1/sqrt(n): a rotation spreads each channel over all of them.
    np.testing.assert_allclose(np.abs(m), 1 / np.sqrt(n), rtol=1e-6)


def test_hadamard_signs_change_the_matrix_and_are_fixed_by_the_seed():
    assert not np.array_equal(np.array(hadamard(64)), np.array(hadamard(64, 0)))
    assert np.array_equal(np.array(hadamard(64, 3)), np.array(hadamard(64, 3)))


@pytest.mark.parametrize("n", [0, 3, 48, 96])
def test_hadamard_rejects_sizes_that_are_not_powers_of_two(n):
    with pytest.raises(ValueError, match="power of two"):
        hadamard(n)


@pytest.mark.parametrize("seed", [None, 1])
def test_rotation_round_trip_and_attention_invariance(seed):
    rng = np.random.default_rng(0)
    m = hadamard(64, seed)
    x = mx.array(rng.standard_normal((3, 40, 64)).astype(np.float32) * 5)
    np.testing.assert_allclose(np.array(unrotate(rotate(x, m), m)), np.array(x), atol=1e-5)
    # Scores with q and k both rotated equal the plain scores; norms are kept.
    q = mx.array(rng.standard_normal((3, 4, 64)).astype(np.float32))
    plain = q @ mx.swapaxes(x, -1, -2)
    rotated = rotate(q, m) @ mx.swapaxes(rotate(x, m), -1, -2)
    np.testing.assert_allclose(np.array(rotated), np.array(plain), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.linalg.norm(np.array(rotate(x, m)), axis=-1),
                               np.linalg.norm(np.array(x), axis=-1), rtol=1e-5)


def test_rotation_spreads_an_outlier_channel():
    x = np.zeros((1, 64), dtype=np.float32)
    x[0, 5] = 64.0
    y = np.array(rotate(mx.array(x), hadamard(64)))
    np.testing.assert_allclose(np.abs(y), 8.0, rtol=1e-6)


def _kv(seed, h=3, s=96, d=64, scale=3.0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((h, s, d)).astype(np.float32) * scale
    x[:, :, 7] *= 20  # an outlier channel
    return mx.array(x)


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("g", [16, 32])
@pytest.mark.parametrize("sd", [mx.float16, mx.bfloat16])
def test_fake_quantize_equals_real_quantize_dequantize(bits, g, sd):
    """The simulation's values are exactly what the store's blocks dequantize to."""
    k, v = _kv(bits * g), _kv(bits * g + 1)
    kb, vb = tokens_to_blocks(k, g), tokens_to_blocks(v, g)  # [N, H, G, D]
    real_k = dequantize_key_blocks(*quantize_key_blocks(kb, bits=bits, scale_dtype=sd), bits=bits)
    real_v = dequantize_value_blocks(*quantize_value_blocks(vb, bits=bits, scale_dtype=sd), bits=bits)
    sim_k = tokens_to_blocks(fake_quantize_keys(k, bits, g, sd), g)
    sim_v = tokens_to_blocks(fake_quantize_values(v, bits, g, sd), g)
    assert np.array_equal(np.array(sim_k), np.array(real_k))
    assert np.array_equal(np.array(sim_v), np.array(real_v))


def test_fake_quantize_groups_run_the_right_way():
    """Keys: per channel over G tokens (a channel's constant run is exact, whatever
    the other channels do); values: per token over G channels."""
    k = np.random.default_rng(0).standard_normal((1, 32, 64)).astype(np.float32)
    k[0, :16, 3] = 1.25  # one key group: channel 3, tokens 0..15
    out = np.array(fake_quantize_keys(mx.array(k), 2, 16))
    assert np.all(out[0, :16, 3] == 1.25)
    assert not np.all(out[0, 16:, 3] == k[0, 16:, 3])
    v = np.random.default_rng(1).standard_normal((1, 4, 64)).astype(np.float32)
    v[0, 2, 32:] = -0.5  # one value group: token 2, channels 32..63
    out = np.array(fake_quantize_values(mx.array(v), 2, 32))
    assert np.all(out[0, 2, 32:] == -0.5)
    # 2 bits: at most 4 distinct levels per group.
    assert len(np.unique(out[0, 1, :32])) <= 4
    assert len(np.unique(np.array(fake_quantize_keys(mx.array(k), 2, 16))[0, 16:, 9])) <= 4


def test_fake_quantize_rejects_partial_groups():
    with pytest.raises(ValueError, match="groups"):
        fake_quantize_keys(mx.zeros((1, 40, 64)), 2, 32)
    with pytest.raises(ValueError, match="groups"):
        fake_quantize_values(mx.zeros((1, 40, 48)), 2, 32)


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("g", [16, 32, 64])
@pytest.mark.parametrize("h,d", [(3, 64), (8, 128)])
def test_bytes_per_token_matches_the_real_pool(bits, g, h, d):
    """With equal key and value groups, the accounting is the pool's block bytes / G."""
    pool = allocate_pool(4, 1, h, d, bits=bits, group_size=g, residual=128)
    block_bytes = sum(a.nbytes for a in pool[:6]) / 4
    assert bytes_per_token(h, d, bits=bits, key_group=g, value_group=g) == block_bytes / g


def test_bytes_per_token_figures():
    # SmolLM2 (3 kv heads, D 64): fp16 768; 2-bit G=32 is 96 code bytes + 24 + 24 scale bytes.
    assert bytes_per_token(3, 64, bits=2, key_group=32, value_group=32) == 144  # 0.1875x
    assert bytes_per_token(3, 64, bits=2, key_group=16, value_group=16) == 192  # 0.25x
    assert bytes_per_token(3, 64, bits=2, key_group=16, value_group=32) == 168
    # 2 fp16 key channels per head: 62 channels of codes and scales, 2 of 2 bytes.
    assert bytes_per_token(3, 64, bits=2, key_group=32, value_group=32, fp16_key_channels=2) == (
        3 * 62 * 2 / 8 + 96 / 2 + 3 * 62 * 4 / 32 + 24 + 3 * 2 * 2)
