"""Sibling projections as one matmul (engine.fused_projections): every supported
family gives the same logits after fusing, each weight is held once, and a model
of another family is left as it is."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models.cache import make_prompt_cache

from kiviq.engine.fused_projections import ProjectionPart, fuse_projections
from tests.test_model_families import FAMILIES, run, tiny_model

TOKENS = [5, 77, 300, 12, 9, 401, 33, 250, 7, 64, 1, 2]


def parameter_bytes(model: nn.Module) -> int:
    return sum(a.nbytes for _, a in tree_flatten(model.parameters()))


def qwen2_with_biases():
    model = tiny_model("qwen2")  # q/k/v carry biases in this family: make them count
    for layer in model.model.layers:
        for name in ("q_proj", "k_proj", "v_proj"):
            proj = getattr(layer.self_attn, name)
            proj.bias = mx.random.normal(proj.bias.shape)
    mx.eval(model.parameters())
    return model


def family_model(family: str, quantized: bool):
    model = qwen2_with_biases() if family == "qwen2" else tiny_model(family)
    if quantized:
        nn.quantize(model, group_size=32, bits=4)
        mx.eval(model.parameters())
    return model


@pytest.mark.parametrize("quantized", [False, True], ids=["float", "4-bit"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_fused_model_gives_the_same_logits(family, quantized):
    model = family_model(family, quantized)
    # A batch of two rows, so the fused product's slices have gaps between rows.
    batch = mx.array([TOKENS[:6], TOKENS[6:]])
    want_batch = model(batch)
    want = run(model, make_prompt_cache(model), TOKENS, prefill=8)
    size = parameter_bytes(model)

    assert fuse_projections(model) == 2 * len(model.model.layers)  # q/k/v and gate/up per layer
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    assert isinstance(attn.k_proj, ProjectionPart) and isinstance(mlp.up_proj, ProjectionPart)
    assert type(attn.qkv_proj) is (nn.QuantizedLinear if quantized else nn.Linear)
    assert parameter_bytes(model) == size  # each weight once, in the fused module only

    got = run(model, make_prompt_cache(model), TOKENS, prefill=8)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.array(model(batch)), np.array(want_batch), rtol=1e-5, atol=1e-5)


def test_fusing_twice_changes_nothing_and_parts_stand_alone():
    model = tiny_model("llama")
    attn = model.model.layers[1].self_attn
    x, other = mx.random.normal((2, 3, 128), key=mx.random.key(1)), mx.random.normal((1, 1, 128))
    want_k, want_v = attn.k_proj(x), attn.v_proj(other)
    assert fuse_projections(model) == 4
    assert fuse_projections(model) == 0
    # A part called alone, or on an input its siblings never see, still gives its columns.
    np.testing.assert_allclose(np.array(attn.v_proj(other)), np.array(want_v), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.array(attn.k_proj(x)), np.array(want_k), rtol=1e-5, atol=1e-6)
    # The shared product is dropped once every sibling took its columns.
    q, k, v = attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
    assert attn.q_proj._product.y is None
    assert (q.shape[-1], k.shape[-1], v.shape[-1]) == (4 * 32, 2 * 32, 2 * 32)


def test_a_family_outside_the_known_ones_is_left_alone():
    model = tiny_model("llama")
    model.model_type = "some_other_family"  # its attention may not call q/k/v on one input
    assert fuse_projections(model) == 0
    assert isinstance(model.model.layers[0].self_attn.q_proj, nn.Linear)
