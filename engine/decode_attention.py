"""A decode step's attention prologue as one kernel launch per layer.

Why: a decode step is host-bound (MLX spends ~10 us of host time on every op it
evaluates), and between a layer's fused q/k/v matmul and its attention mlx-lm
runs seven small ops: three strided copies that split the product into heads,
Qwen3's two q/k RMSNorms and two RoPEs (and a 2r cache three Hadamard rotations).
``kernels.qk_rope`` does all of that in one launch and gives the same bits, so the
tokens do not change.

How: the attention modules of the families whose forward is exactly
"projections, (norms), RoPE at the cache's offset, the shared attention helper,
o_proj" (llama, mistral, qwen2, qwen3 in mlx-lm 0.32) get a subclass whose
``__call__`` takes the one-launch path for a decode step over a KIVI cache
whose store uses the kernels, and otherwise runs the stock forward. The
parameters and the module tree stay as they are (only the class changes).
Needs the fused projection (``engine.fused_projections``) and a plain RoPE
(``nn.RoPE``, rotate-half over the whole head).
"""

from __future__ import annotations

from typing import Any, Callable

import mlx.core as mx
import mlx.nn as nn

from kiviq.engine.fused_projections import FUSABLE_FAMILIES
from kiviq.engine.kivi_cache import KiviLayerCache, model_dtype
from kiviq.kernels.launch import const
from kiviq.kernels.qk_rope import qk_rope, supported

_CLASSES: dict[type, type] = {}


def _eligible(attn: nn.Module, head_dim: int) -> bool:
    rope = getattr(attn, "rope", None)
    if not (isinstance(attn.get("qkv_proj"), nn.Module) and type(rope) is nn.RoPE
            and not rope.traditional and rope.dims == head_dim):
        return False
    norms = [attn.get(n) for n in ("q_norm", "k_norm")]
    return all(n is None for n in norms) or all(type(n) is nn.RMSNorm for n in norms)


def _decode_class(stock: type) -> type:
    """``stock`` with the one-launch decode path (made once per stock class)."""
    cls = _CLASSES.get(stock)
    if cls is None:
        def __call__(self, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
            if (x.shape[1] != 1 or not isinstance(cache, KiviLayerCache) or cache.store.use_kernel is False
                    or cache.packed is not None):  # packed first chunks: one row per token, not a decode step
                return stock.__call__(self, x, mask, cache)
            return decode_forward(self, x, cache)

        cls = _CLASSES[stock] = type(f"OneLaunchDecode{stock.__name__}", (stock,), {"__call__": __call__})
    return cls


def decode_forward(attn: nn.Module, x: mx.array, cache: KiviLayerCache) -> mx.array:
    """The stock forward of one decode token per sequence, its prologue in one launch."""
    b = x.shape[0]
    offsets = cache.offset
    if not isinstance(offsets, mx.array):  # one sequence, a plain step: an int, one array for all layers
        offsets = const((offsets,) * b, mx.int32)
    norm = attn.get("q_norm")
    # A rotated (2r) store: the prologue rotates q, k and v into its basis in the same launch.
    rotated = cache.store.rotation is not None
    q, k, v = attn._qk_prep(attn.qkv_proj(x), offsets, n_heads=attn.n_heads, n_kv_heads=attn.n_kv_heads,
                            rope_base=attn.rope.base, rope_scale=attn.rope.scale,
                            q_weight=None if norm is None else norm.weight,
                            k_weight=None if norm is None else attn.k_norm.weight,
                            eps=0.0 if norm is None else norm.eps, rotate=rotated)
    k, v = cache.update_and_fetch(k, v)
    out = cache.attend(q, k, v, attn.scale, rotated=rotated)
    return attn.o_proj(out.transpose(0, 2, 1, 3).reshape(b, 1, -1))


def install_decode_attention(model: nn.Module, prep: Callable | None = None) -> int:
    """Give every eligible attention layer of ``model`` the one-launch decode path.
    ``prep``: the prologue (default ``kernels.qk_rope``, CUDA only; a test passes
    ``qk_rope_reference`` to check the path on any backend). Returns the layers
    changed: 0 where the kernel cannot run (no CUDA, head_dim, dtype) or the family
    is not known. Run after ``fuse_projections``; safe to run again."""
    if getattr(model, "model_type", None) not in FUSABLE_FAMILIES:
        return 0
    layers = getattr(getattr(model, "model", None), "layers", [])
    attns = [getattr(layer, "self_attn", None) for layer in layers]
    if not attns or any(a is None for a in attns):
        return 0
    head_dim = attns[0].rope.dims if hasattr(attns[0], "rope") else 0
    if prep is None:
        if not supported(head_dim, model_dtype(model)):
            return 0
        prep = qk_rope
    count = 0
    for attn in attns:
        if not _eligible(attn, head_dim):
            continue
        if type(attn) not in _CLASSES.values():
            attn.__class__ = _decode_class(type(attn))
        attn._qk_prep = prep  # a plain attribute: a function is no parameter
        count += 1
    return count
