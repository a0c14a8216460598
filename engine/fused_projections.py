"""Sibling projections of one input as one matmul: q/k/v, and gate/up.

Why: a decode step is host-bound. MLX spends about 10 us of host time on every
op it evaluates, whatever the op computes, and a Qwen3-4B-shaped step has ~770
of them. Each layer's ``q_proj``, ``k_proj`` and ``v_proj`` read the same
normalized hidden state, as do the MLP's ``gate_proj`` and ``up_proj``: one
matmul over their concatenated weights does the work of three (and of two),
three fewer matmuls per layer. The weights are read once per step either way.

How, without a forward of our own per model family: the stock mlx-lm code calls
``q_proj(x), k_proj(x), v_proj(x)`` (and ``gate_proj(x), up_proj(x)``) on the
same ``x``, in that order. Each of those modules becomes a ``ProjectionPart``:
the first runs the fused matmul and takes its columns; its siblings find that
product (the same ``x`` object, traced or not) and slice theirs, and the last
drops it. A part called on an input the first did not see still gets the right
columns (the whole product is computed for it): correct anywhere, only not
fused.

Each output element is the same dot product as before; only the matmul kernel
chosen for the wider output could sum it in another order (on a CPU and on an
H200 the greedy tokens stayed the same: docs/performance.md).
"""

from __future__ import annotations

from typing import Sequence

import mlx.core as mx
import mlx.nn as nn

# Families whose attention calls q/k/v_proj(x) on one x, and whose MLP calls
# gate_proj(x) and up_proj(x) on one x (mlx-lm 0.32's llama, mistral, qwen2, qwen3).
FUSABLE_FAMILIES = frozenset({"llama", "mistral", "qwen2", "qwen3"})
SIBLINGS = (("self_attn", ("q_proj", "k_proj", "v_proj"), "qkv_proj"),
            ("mlp", ("gate_proj", "up_proj"), "gate_up_proj"))


class _Product:
    """The fused matmul's output for the input the first sibling was called
    with, until the last sibling took its columns (a plain object: mlx's Module
    would treat an array attribute as a parameter)."""

    def __init__(self, fused: nn.Module, splits: list[int], names: Sequence[str]):
        self.fused, self.splits, self.names = fused, splits, tuple(names)
        self.x: mx.array | None = None
        self.y: mx.array | None = None

    def columns(self, name: str, x: mx.array) -> mx.array:
        i = self.names.index(name)
        shared = i > 0 and self.x is x
        y = self.y if shared else self.fused(x)
        if i == 0:  # the stock code calls the first sibling first: keep its product
            self.x, self.y = x, y
        elif shared and i == len(self.names) - 1:  # every sibling served: drop the references
            self.x = self.y = None
        return y[..., self.splits[i]:self.splits[i + 1]]


class ProjectionPart(nn.Module):
    """One of a fused group's projections (``q_proj`` of ``qkv_proj``, say).
    Holds no weights: they live once, in the fused module."""

    def __init__(self, product: _Product, name: str):
        super().__init__()
        self._product, self._name = product, name

    def __call__(self, x: mx.array) -> mx.array:
        return self._product.columns(self._name, x)


def _can_fuse(parts: list[nn.Module]) -> bool:
    first = parts[0]
    if type(first) is nn.Linear or isinstance(first, nn.QuantizedLinear):
        same = all(type(p) is type(first) and ("bias" in p) == ("bias" in first) for p in parts)
        if isinstance(first, nn.QuantizedLinear):
            same = same and all((p.group_size, p.bits, getattr(p, "mode", None)) ==
                                (first.group_size, first.bits, getattr(first, "mode", None)) for p in parts)
        return same
    return False


def _fused_module(parts: list[nn.Module]) -> nn.Module:
    """A module of the parts' class whose weights are theirs, stacked along the
    output axis (for a quantized linear the groups run along the input axis, so
    codes, scales and biases stack the same way)."""
    first = parts[0]
    fused = nn.Module.__new__(type(first))
    nn.Module.__init__(fused)
    for key in ("group_size", "bits", "mode"):
        if key in first.__dict__:
            setattr(fused, key, first.__dict__[key])
    for key in ("weight", "scales", "biases", "bias"):
        if key in first:
            fused[key] = mx.concatenate([p[key] for p in parts], axis=0)
    if isinstance(first, nn.QuantizedLinear):
        fused.freeze()  # as nn.QuantizedLinear keeps its codes frozen
    return fused


def fuse_projections(model: nn.Module) -> int:
    """Fuse q/k/v and gate/up in every layer of a known family. Returns the
    number of groups fused (0 for other families, or a model already fused).
    Each layer's new weights are evaluated before the next layer's are made, so
    loading peaks at one layer's projections above the model's size."""
    if getattr(model, "model_type", None) not in FUSABLE_FAMILIES:
        return 0
    count = 0
    for layer in getattr(getattr(model, "model", None), "layers", []):
        for owner_name, names, fused_name in SIBLINGS:
            owner = getattr(layer, owner_name, None)
            parts = [owner.get(n) for n in names] if isinstance(owner, nn.Module) else []
            if not parts or any(p is None for p in parts) or not _can_fuse(parts):
                continue
            fused = _fused_module(parts)
            mx.eval(fused.parameters())
            splits = [0]
            for p in parts:
                splits.append(splits[-1] + p["weight"].shape[0])
            product = _Product(fused, splits, names)
            setattr(owner, fused_name, fused)
            for name in names:
                setattr(owner, name, ProjectionPart(product, name))
            count += 1
    return count
