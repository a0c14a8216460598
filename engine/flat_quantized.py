"""Quantized matmuls over all rows at once: one GEMM per layer for a whole decode batch.

A decode step feeds the model [B, 1, K] activations. MLX's CUDA quantized matmul
(mlx/backend/cuda/quantized/quantized.cpp, 0.32) takes M from the second-to-last
axis and treats the leading axes as a batch: M = 1 with B = 32 problems, so from
B = 8 up it launches a batched qmm (`qmm_sm80`: grid z = B) whose every problem
reads the whole weight matrix again. Reshaping the activations to [B * L, K]
first makes the same call one GEMM with M = B * L, and the weights are read once.

The reshape is free (the activations are row-contiguous), and the rows' results
are the same dot products. It is applied by swapping the class of each quantized
module (the instances keep their arrays), so it can be undone and never copies
weights. On by default (same tokens); `EngineConfig(flat_qmm=False)` leaves the
model as it is.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import mlx.core as mx
import mlx.nn as nn


def _rows(x: mx.array) -> mx.array:
    return x if x.ndim <= 2 else x.reshape(-1, x.shape[-1])


class FlatQuantizedLinear(nn.QuantizedLinear):
    """`nn.QuantizedLinear` whose matmul sees all leading axes as rows."""

    def __call__(self, x: mx.array) -> mx.array:
        y = super().__call__(_rows(x))
        return y.reshape(*x.shape[:-1], y.shape[-1])


class FlatQuantizedEmbedding(nn.QuantizedEmbedding):
    """`nn.QuantizedEmbedding` whose `as_linear` (a tied output head) sees rows."""

    def as_linear(self, x: mx.array) -> mx.array:
        y = super().as_linear(_rows(x))
        return y.reshape(*x.shape[:-1], y.shape[-1])


_FLAT = {nn.QuantizedLinear: FlatQuantizedLinear, nn.QuantizedEmbedding: FlatQuantizedEmbedding}
_PLAIN = {v: k for k, v in _FLAT.items()}


def _swap(modules, mapping: dict) -> list[nn.Module]:
    """Give each of `modules` whose exact type `mapping` names the mapped class;
    returns those changed (subclasses are left alone: they keep their own call)."""
    swapped = [m for m in modules if type(m) in mapping]
    for m in swapped:
        m.__class__ = mapping[type(m)]
    return swapped


def flatten_quantized_matmuls(model: nn.Module) -> int:
    """Make every quantized linear (and tied quantized embedding head) of `model`
    multiply all rows in one matmul. Returns how many modules changed (0 for a
    model without quantized layers, or one already flattened)."""
    return len(_swap((m for _, m in model.named_modules()), _FLAT))


def restore_quantized_matmuls(model: nn.Module) -> int:
    """Undo `flatten_quantized_matmuls`. Returns how many modules changed."""
    return len(_swap((m for _, m in model.named_modules()), _PLAIN))


@contextlib.contextmanager
def flat_quantized_matmuls(model: nn.Module) -> Iterator[int]:
    """`model` flattened for the duration (benchmark arms that share one model);
    yields the number of modules flattened, and restores only those."""
    swapped = _swap((m for _, m in model.named_modules()), _FLAT)
    try:
        yield len(swapped)
    finally:
        _swap(swapped, _PLAIN)

