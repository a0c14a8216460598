"""A decode step's trunk with fewer launches: each residual add in one launch with the
RMSNorm that follows it, and at one sequence each MLP's SwiGLU inside its down projection.

Why: a decode step is host-bound (MLX spends ~10 us of host time on every op it
evaluates). mlx-lm's decoder layer adds the attention's output to the residual stream,
normalizes the sum for the MLP, adds the MLP's output and leaves the sum to the next
layer, which normalizes it first: two adds and two norms per layer. On CUDA
``kernels.add_rms_norm`` does an add and the norm after it in one launch with the same
bits, so a Qwen3-4B step makes 72 launches fewer (two per layer) and gives the same
tokens. Where a step has one sequence, ``kernels.swiglu_down`` runs the MLP's SwiGLU and
its down projection (MLX's gemv there) in one launch with the same bits: 36 fewer.

How: the trunk (``model.model``) of the families whose decoder layer is exactly
"x + attention(input norm(x)), then h + mlp(post-attention norm(h))" and whose trunk
is "embed, the layers, a final norm" (llama, mistral, qwen2, qwen3 in mlx-lm 0.32)
gets a subclass whose ``__call__`` runs that same arithmetic with each add and the next
norm fused, for a decode step (one token per sequence) over KIVI caches whose store uses
the kernels; anything else runs the stock forward. The modules and parameters stay as
they are (only the trunk's class changes).
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import mlx.core as mx
import mlx.nn as nn

from kiviq.engine.fused_projections import FUSABLE_FAMILIES
from kiviq.engine.kivi_cache import KiviLayerCache, model_dtype
from kiviq.kernels import swiglu_down as swiglu_down_kernel
from kiviq.kernels.add_rms_norm import add_rms_norm, check, supported

log = logging.getLogger("kiviq.engine")

_CLASSES: dict[type, type] = {}


def _is_rms_norm(module: Any) -> bool:
    return type(module) is nn.RMSNorm


def _eligible(trunk: nn.Module) -> bool:
    layers = getattr(trunk, "layers", None)
    if not layers or trunk.get("embed_tokens") is None or not _is_rms_norm(trunk.get("norm")):
        return False
    if getattr(trunk, "pipeline_size", 1) != 1:  # split across processes: its own forward
        return False
    for layer in layers:
        cls = type(layer)
        if cls.__name__ != "TransformerBlock" or not cls.__module__.startswith("mlx_lm.models."):
            return False
        if getattr(layer, "use_sliding", False):
            return False
        if not (_is_rms_norm(layer.get("input_layernorm")) and _is_rms_norm(layer.get("post_attention_layernorm"))):
            return False
    return True


def _fused_class(stock: type) -> type:
    """``stock`` with the fused decode path (made once per stock class)."""
    cls = _CLASSES.get(stock)
    if cls is None:
        def __call__(self, inputs: mx.array, cache: Any = None, input_embeddings: mx.array | None = None):
            first = cache[0] if cache else None
            if (inputs.ndim != 2 or inputs.shape[1] != 1 or input_embeddings is not None
                    or not isinstance(first, KiviLayerCache) or first.store.use_kernel is False):
                return stock.__call__(self, inputs, cache, input_embeddings)
            return fused_forward(self, inputs, cache, self._add_norm, self._swiglu_down)

        cls = _CLASSES[stock] = type(f"FusedTrunk{stock.__name__}", (stock,), {"__call__": __call__})
    return cls


def fused_forward(trunk: nn.Module, inputs: mx.array, cache: list, add_norm: Callable,
                  swiglu_down: Callable | None = None) -> mx.array:
    """The stock trunk's result for one token per sequence (no mask: one query row
    attends to all its keys), each residual add fused with the norm after it; with
    ``swiglu_down(gate_up, down_weight)`` and one sequence, each MLP's SwiGLU and down
    projection in one call (the layers' MLPs must have passed `_mlp_fusable`)."""
    layers = trunk.layers
    one_row = swiglu_down is not None and inputs.shape[0] == 1
    h = trunk.embed_tokens(inputs)
    x = layers[0].input_layernorm(h)
    for i, (layer, c) in enumerate(zip(layers, cache)):
        post = layer.post_attention_layernorm
        h, x = add_norm(h, layer.self_attn(x, None, c), post.weight, post.eps)
        mlp = layer.mlp
        y = swiglu_down(mlp.gate_up_proj(x), mlp.down_proj.weight) if one_row else mlp(x)
        after = layers[i + 1].input_layernorm if i + 1 < len(layers) else trunk.norm
        h, x = add_norm(h, y, after.weight, after.eps)
    return x


def _mlp_fusable(layer: nn.Module) -> bool:
    """Whether ``layer``'s MLP is mlx-lm's ``down(swiglu(gate, up))`` with gate and up
    fused into one matmul (engine.fused_projections) and no biases."""
    mlp = layer.get("mlp")
    if not isinstance(mlp, nn.Module) or type(mlp).__name__ != "MLP":
        return False
    if not type(mlp).__module__.startswith("mlx_lm.models."):
        return False
    parts = (mlp.get("gate_up_proj"), mlp.get("down_proj"))
    return all(type(p) is nn.Linear and "bias" not in p for p in parts)


def _mlp_kernel(trunk: nn.Module, dtype: mx.Dtype) -> Callable | None:
    """``kernels.swiglu_down`` where it runs for every layer's MLP and passes its start-up
    check against the stock ops at each of their shapes, else None (the stock MLP)."""
    if not all(_mlp_fusable(layer) for layer in trunk.layers):
        return None
    shapes = {tuple(layer.mlp.down_proj.weight.shape) for layer in trunk.layers}
    if not all(swiglu_down_kernel.supported(hidden, dtype) for _, hidden in shapes):
        return None
    reason = next((r for r in (swiglu_down_kernel.check(hidden, out_size, dtype) for out_size, hidden in shapes)
                   if r is not None), None)
    if reason is not None:
        log.warning("SwiGLU kept apart from the down projection, using the stock ops: %s", reason)
        return None
    return swiglu_down_kernel.swiglu_down


def _norm_eps(trunk: nn.Module) -> list[float]:
    """The distinct eps of the norms the fused path replaces, in order of first use."""
    norms = [n for layer in trunk.layers for n in (layer.input_layernorm, layer.post_attention_layernorm)]
    return list(dict.fromkeys(n.eps for n in norms + [trunk.norm]))


def install_fused_trunk(model: nn.Module, add_norm: Callable | None = None,
                        swiglu_down: Callable | None = None) -> bool:
    """Give ``model``'s trunk the fused decode path. ``add_norm(x, r, weight, eps)`` ->
    (x + r, its RMSNorm): default ``kernels.add_rms_norm`` (CUDA only; a test passes
    ``add_rms_norm_reference`` to check the path on any backend). Returns whether the
    trunk has the path: not where the kernel cannot run (no CUDA, hidden size, dtype),
    fails its start-up check against the stock ops (``add_rms_norm.check``: a warning
    is logged), or the family or its layers are not the known ones. Safe to run again.
    ``swiglu_down(gate_up, down_weight)``, for steps of one sequence: default
    ``kernels.swiglu_down`` where it runs and passes its own check, else the stock MLP
    (run ``fuse_projections`` first: it works on the fused gate/up projection)."""
    trunk = getattr(model, "model", None)
    if getattr(model, "model_type", None) not in FUSABLE_FAMILIES or not isinstance(trunk, nn.Module):
        return False
    if not _eligible(trunk):
        return False
    if add_norm is None:
        size, dtype = trunk.norm.weight.shape[0], model_dtype(model)
        if not supported(size, dtype):
            return False
        # Never other tokens: any bit that differs, at any eps the model's norms use
        # (Qwen3 1e-6, Llama 1e-5), keeps the stock ops.
        reason = next((r for r in (check(size, dtype, eps) for eps in _norm_eps(trunk)) if r is not None), None)
        if reason is not None:
            log.warning("fused residual adds disabled, using the stock ops: %s", reason)
            return False
        add_norm = add_rms_norm
    if swiglu_down is None:
        swiglu_down = _mlp_kernel(trunk, model_dtype(model))
    elif not all(_mlp_fusable(layer) for layer in trunk.layers):
        swiglu_down = None
    if type(trunk) not in _CLASSES.values():
        trunk.__class__ = _fused_class(type(trunk))
    trunk._add_norm = add_norm  # plain attributes: a function is no parameter
    trunk._swiglu_down = swiglu_down
    return True
