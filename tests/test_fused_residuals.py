"""The fused residual path of a decode step (engine.fused_residuals): which trunks get
it, and that it computes the stock trunk's numbers. On the CPU the path runs with the
reference add + norm (kernels.add_rms_norm.add_rms_norm_reference); the kernel's bits
against the stock ops are tests/test_add_rms_norm_gpu.py's."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache

from kiviq.engine.compiled_decode import CompiledDecode
from kiviq.engine.fused_projections import fuse_projections
from kiviq.engine.fused_residuals import fused_forward, install_fused_residuals
from kiviq.kernels.add_rms_norm import add_rms_norm_reference
from engine_runs import run_engine
from tests.test_decode_attention import engine_for, requests
from tests.test_model_families import FAMILIES, tiny_model


def distinct_norms(model):
    """``model`` with every RMSNorm's weight its own (they start as ones: a path that
    used the wrong norm would go unseen)."""
    norms = [model.model.norm] + [n for layer in model.model.layers
                                  for n in (layer.input_layernorm, layer.post_attention_layernorm)]
    for i, norm in enumerate(norms):
        norm.weight = mx.random.uniform(0.5, 1.5, norm.weight.shape, key=mx.random.key(i)).astype(norm.weight.dtype)
    mx.eval(model.parameters())
    return model


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_fused_trunk_computes_the_stock_numbers(family):
    """A decode token of two sequences after a prompt: the hidden states after the final
    norm are the stock trunk's, bit for bit."""
    model = distinct_norms(tiny_model(family))
    trunk = model.model
    prompt = mx.array([[5, 17, 99, 3, 250, 42, 7], [8, 1, 64, 300, 12, 9, 77]])
    step = mx.array([[11], [400]])
    caches = []
    for _ in range(2):
        cache = [KVCache() for _ in trunk.layers]
        trunk(prompt, cache)
        caches.append(cache)
    want = trunk(step, caches[0])
    got = fused_forward(trunk, step, caches[1], add_rms_norm_reference)
    assert got.dtype == want.dtype and np.array_equal(np.array(got), np.array(want))


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_path_gives_the_engines_tokens(family):
    model = distinct_norms(tiny_model(family))
    fuse_projections(model)
    want = run_engine(engine_for(model), requests(), join_every=3)
    calls = []

    def counted(*args):
        calls.append(1)
        return add_rms_norm_reference(*args)

    assert install_fused_residuals(model, add_norm=counted)
    assert run_engine(engine_for(model), requests(), join_every=3) == want
    assert len(calls) > 0 and len(calls) % (2 * len(model.model.layers)) == 0  # decode steps took it
    # Traced into compiled decode steps (engine.compiled_decode) as well.
    compiled = engine_for(model)
    compiled.runner.compiled = CompiledDecode(model, compiled.kv_store)
    calls.clear()
    assert run_engine(compiled, requests(), join_every=3) == want
    assert compiled.runner.compiled.stats["compiled"] > 0 and calls
    # A store told not to use kernels keeps the stock forward.
    calls.clear()
    assert run_engine(engine_for(model, use_kernel=False), requests(), join_every=3) == want
    assert calls == []


def test_who_gets_the_path():
    model = tiny_model("qwen3")
    assert install_fused_residuals(model, add_norm=add_rms_norm_reference)
    cls = type(model.model)
    assert cls.__mro__[1].__module__.startswith("mlx_lm") and cls.__name__.startswith("FusedResiduals")
    assert install_fused_residuals(model, add_norm=add_rms_norm_reference)
    assert type(model.model) is cls  # installed once
    # A trunk split across processes, or a layer of another shape, keeps the stock forward.
    split = tiny_model("qwen2")
    split.model.pipeline_size = 2
    assert not install_fused_residuals(split, add_norm=add_rms_norm_reference)
    sliding = tiny_model("llama")
    sliding.model.layers[1].use_sliding = True
    assert not install_fused_residuals(sliding, add_norm=add_rms_norm_reference)
    other = tiny_model("llama")
    other.model_type = "gemma"
    assert not install_fused_residuals(other, add_norm=add_rms_norm_reference)
    # Where the kernel cannot run (this CPU machine), nothing changes by default.
    if not mx.cuda.is_available():
        fresh = tiny_model("qwen3")
        assert not install_fused_residuals(fresh)
        assert type(fresh.model).__module__.startswith("mlx_lm")


def test_a_kernel_that_disagrees_with_the_stock_ops_is_not_installed(monkeypatch, caplog):
    """The start-up check (kernels.add_rms_norm.check) compares every bit; a kernel that
    differs anywhere, or raises, leaves the stock trunk and says why."""
    from kiviq.engine import fused_residuals
    from kiviq.kernels import add_rms_norm as kernel

    monkeypatch.setattr(kernel, "add_rms_norm", add_rms_norm_reference)
    assert kernel.check(2560, mx.bfloat16) is None

    def off_by_one_ulp(x, r, w, eps):
        h, y = add_rms_norm_reference(x, r, w, eps)
        return h, (y.view(mx.uint16) + (mx.arange(y.size).reshape(y.shape) == 7)).view(y.dtype)

    monkeypatch.setattr(kernel, "add_rms_norm", off_by_one_ulp)
    assert kernel.check(576, mx.float16) == "add_rms_norm's norm differs from the stock ops in 1 of 2880 values"

    def broken(*_):
        raise RuntimeError("nvrtc: error")

    monkeypatch.setattr(kernel, "add_rms_norm", broken)
    assert kernel.check(576, mx.float16) == "add_rms_norm raised RuntimeError: nvrtc: error"
    monkeypatch.setattr(fused_residuals, "supported", lambda size, dtype: True)
    model = tiny_model("qwen3")
    with caplog.at_level("WARNING", logger="kiviq.engine"):
        assert not install_fused_residuals(model)
    assert "fused residual adds disabled" in caplog.text and "nvrtc: error" in caplog.text
    assert type(model.model).__module__.startswith("mlx_lm")


def test_the_start_up_check_runs_at_each_eps_the_models_norms_use(monkeypatch):
    """A kernel right at 1e-6 but wrong at the model's 1e-5 must not be installed."""
    from kiviq.engine import fused_residuals

    model = tiny_model("llama")
    for i, layer in enumerate(model.model.layers):
        layer.post_attention_layernorm.eps = 1e-5 if i else 1e-6
    seen = []

    def check(size, dtype, eps=1e-6):
        seen.append(eps)
        return None if eps == 1e-6 else f"differs at eps {eps}"

    monkeypatch.setattr(fused_residuals, "supported", lambda size, dtype: True)
    monkeypatch.setattr(fused_residuals, "check", check)
    assert not install_fused_residuals(model)
    assert 1e-5 in seen and type(model.model).__module__.startswith("mlx_lm")
    for layer in model.model.layers:
        layer.post_attention_layernorm.eps = layer.input_layernorm.eps = model.model.norm.eps = 1e-6
    seen.clear()
    assert install_fused_residuals(model) and seen == [1e-6]
