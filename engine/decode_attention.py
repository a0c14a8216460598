"""A decode step's attention prologue inside the attention kernel's launch.

Why: a decode step is host-bound (MLX spends ~10 us of host time on every op it
evaluates), and between a layer's fused q/k/v matmul and its attention mlx-lm
runs seven small ops: three strided copies that split the product into heads,
Qwen3's two q/k RMSNorms and two RoPEs (and a 2r cache three Hadamard rotations).
On CUDA the split attention kernel does all of that for the heads it reads
(``KiviLayerCache.attend_projection``, ``kernels.qk_rope.Prologue``), with the
same bits, so the tokens do not change and the layer's attention is two launches
after its projection.

How: the attention modules of the families whose forward is exactly
"projections, (norms), RoPE at the cache's offset, the shared attention helper,
o_proj" (llama, mistral, qwen2, qwen3 in mlx-lm 0.32) get a subclass whose
``__call__`` hands a decode step's projection row to a KIVI cache whose store
uses the kernels, and otherwise runs the stock forward. The parameters and the
module tree stay as they are (only the class changes). Needs the fused projection
(``engine.fused_projections``) and a plain RoPE (``nn.RoPE``, rotate-half over the
whole head).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn

from kiviq.engine.fused_projections import FUSABLE_FAMILIES
from kiviq.engine.kivi_cache import KiviLayerCache, model_dtype
from kiviq.kernels import kivi_cuda
from kiviq.kernels.launch import const
from kiviq.kernels.qk_rope import PROLOGUE_DTYPES, PROLOGUE_HEAD_DIMS, Prologue

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
    """The stock forward of one decode token per sequence, its prologue in the attention launch."""
    b = x.shape[0]
    offsets = cache.offset
    if not isinstance(offsets, mx.array):  # one sequence, a plain step: an int, one array for all layers
        offsets = const((offsets,) * b, mx.int32)
    norm = attn.get("q_norm")
    out = cache.attend_projection(attn.qkv_proj(x), offsets, attn._prologues[cache.store.rotation is not None],
                                  None if norm is None else norm.weight,
                                  None if norm is None else attn.k_norm.weight, attn.scale)
    return attn.o_proj(out.transpose(0, 2, 1, 3).reshape(b, 1, -1))


def _prologues(attn: nn.Module) -> dict[bool, Prologue]:
    """The layer's prologue for a plain store (False) and a rotated one (True)."""
    norm = attn.get("q_norm")
    spec = dict(n_heads=attn.n_heads, n_kv_heads=attn.n_kv_heads, rope_base=attn.rope.base,
                rope_scale=attn.rope.scale, eps=0.0 if norm is None else norm.eps, norm=norm is not None)
    return {rotate: Prologue(**spec, rotate=rotate) for rotate in (False, True)}


def decode_prologue(model: nn.Module, *, rotate: bool) -> Prologue | None:
    """The prologue a decode step's attention kernels run for ``model`` (its layers'
    are alike: `_prologues`), or None where `install_decode_attention` gave its
    layers no such path."""
    layers = getattr(getattr(model, "model", None), "layers", None) or []
    prologues = getattr(getattr(layers[0], "self_attn", None), "_prologues", None) if layers else None
    return None if prologues is None else prologues[rotate]


def install_decode_attention(model: nn.Module, *, anywhere: bool = False) -> int:
    """Give every eligible attention layer of ``model`` the prologue-in-the-kernel
    decode path. Returns the layers changed: 0 where the kernel cannot run (no CUDA,
    head_dim, dtype) or the family is not known. ``anywhere``: install it where the
    kernel cannot run too (a test: the path then runs ``Prologue.reference``, the
    stock ops). Run after ``fuse_projections``; safe to run again."""
    if getattr(model, "model_type", None) not in FUSABLE_FAMILIES:
        return 0
    layers = getattr(getattr(model, "model", None), "layers", [])
    attns = [getattr(layer, "self_attn", None) for layer in layers]
    if not attns or any(a is None for a in attns):
        return 0
    head_dim = attns[0].rope.dims if hasattr(attns[0], "rope") else 0
    if not anywhere and not (kivi_cuda.available() and head_dim in PROLOGUE_HEAD_DIMS
                             and model_dtype(model) in PROLOGUE_DTYPES):
        return 0
    count = 0
    for attn in attns:
        if not _eligible(attn, head_dim):
            continue
        if type(attn) not in _CLASSES.values():
            attn.__class__ = _decode_class(type(attn))
        attn._prologues = _prologues(attn)  # a plain attribute: no parameter
        count += 1
    return count
