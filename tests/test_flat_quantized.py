"""Quantized matmuls over all rows at once (engine.flat_quantized): every matmul of a
batched step is 2-D, the logits and the engine's tokens are the same, and the swap
is undone exactly."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from kiviq.engine import Request, build_engine
from kiviq.engine.flat_quantized import (FlatQuantizedEmbedding, FlatQuantizedLinear, flat_quantized_matmuls,
                                         flatten_quantized_matmuls, restore_quantized_matmuls)
from tests.engine_runs import IdTokenizer, run_engine, tiny_model

def quantized_model():
    model = tiny_model()
    nn.quantize(model, group_size=64, bits=4)  # the tied head becomes a QuantizedEmbedding
    mx.eval(model.parameters())
    return model


def quantized_matmul_inputs(monkeypatch) -> list[tuple[int, ...]]:
    """Record the shape of every activation that reaches mx.quantized_matmul."""
    seen, real = [], mx.quantized_matmul

    def spy(x, *args, **kwargs):
        seen.append(tuple(x.shape))
        return real(x, *args, **kwargs)

    monkeypatch.setattr(mx, "quantized_matmul", spy)
    return seen


def test_a_batched_step_multiplies_rows_in_2d_and_gives_the_same_logits(monkeypatch):
    model = quantized_model()
    ids = mx.array([[5], [77], [300]])  # a decode step's [B, 1] input, no cache
    want = model(ids)
    mx.eval(want)
    seen = quantized_matmul_inputs(monkeypatch)
    assert flatten_quantized_matmuls(model) == 2 * 7 + 1  # 7 linears per layer + the tied head
    got = model(ids)
    mx.eval(got)
    # Without the swap MLX gets [3, 1, K]: M = 1 and a batch of 3 problems.
    assert seen and all(len(s) == 2 and s[0] == 3 for s in seen), seen
    assert got.shape == want.shape
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-5, atol=1e-5)


def test_restore_undoes_exactly_and_a_second_flatten_changes_nothing():
    model = quantized_model()
    assert flatten_quantized_matmuls(model) == 15
    assert flatten_quantized_matmuls(model) == 0
    kinds = {type(m) for _, m in model.named_modules()}
    assert FlatQuantizedLinear in kinds and FlatQuantizedEmbedding in kinds
    assert restore_quantized_matmuls(model) == 15
    kinds = {type(m) for _, m in model.named_modules()}
    assert FlatQuantizedLinear not in kinds and FlatQuantizedEmbedding not in kinds
    assert nn.QuantizedLinear in kinds


def test_the_context_restores_only_what_it_flattened():
    model = quantized_model()
    head = model.model.embed_tokens
    head.__class__ = FlatQuantizedEmbedding  # flattened before, by someone else
    with flat_quantized_matmuls(model) as n:
        assert n == 14
        assert all(type(m) is not nn.QuantizedLinear for _, m in model.named_modules())
    assert type(head) is FlatQuantizedEmbedding
    assert type(model.model.layers[0].self_attn.q_proj) is nn.QuantizedLinear


def test_an_unquantized_model_is_left_alone():
    assert flatten_quantized_matmuls(tiny_model()) == 0


@pytest.mark.parametrize("compiled", [False, True], ids=["plain", "compiled"])
def test_the_engine_gives_the_same_tokens_with_flat_matmuls(monkeypatch, compiled):
    requests = lambda: [Request(f"r{i}", [1 + i, 40 + 7 * i, 9, 200 - i] * (3 + i), 12)  # noqa: E731
                        for i in range(5)]
    kw = dict(kv_bits=4, kv_group_size=16, kv_residual=32, kv_memory=64 << 20, max_sequences=5,
              compile_decode=compiled)
    plain_model = quantized_model()
    want = run_engine(build_engine(plain_model, IdTokenizer(), flat_qmm=False, **kw), requests())
    # flat_qmm=False left it plain; build_engine fused q/k/v and gate/up (engine.fused_projections):
    # 4 linears per layer + the tied head.
    assert flatten_quantized_matmuls(plain_model) == 9

    flat_model = quantized_model()
    seen = quantized_matmul_inputs(monkeypatch)
    got = run_engine(build_engine(flat_model, IdTokenizer(), flat_qmm=True, **kw), requests())
    assert got == want
    assert seen and all(len(s) == 2 for s in seen)

