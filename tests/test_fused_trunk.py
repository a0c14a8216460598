"""The fused residual path of a decode step (engine.fused_trunk): which trunks get
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
from kiviq.engine.fused_trunk import fused_forward, install_fused_trunk
from kiviq.kernels.add_rms_norm import add_rms_norm_reference
from kiviq.kernels.swiglu_down import swiglu_down_reference
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

    assert install_fused_trunk(model, add_norm=counted)
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
    assert install_fused_trunk(model, add_norm=add_rms_norm_reference)
    cls = type(model.model)
    assert cls.__mro__[1].__module__.startswith("mlx_lm") and cls.__name__.startswith("FusedTrunk")
    assert install_fused_trunk(model, add_norm=add_rms_norm_reference)
    assert type(model.model) is cls  # installed once
    # A trunk split across processes, or a layer of another shape, keeps the stock forward.
    split = tiny_model("qwen2")
    split.model.pipeline_size = 2
    assert not install_fused_trunk(split, add_norm=add_rms_norm_reference)
    sliding = tiny_model("llama")
    sliding.model.layers[1].use_sliding = True
    assert not install_fused_trunk(sliding, add_norm=add_rms_norm_reference)
    other = tiny_model("llama")
    other.model_type = "gemma"
    assert not install_fused_trunk(other, add_norm=add_rms_norm_reference)
    # Where the kernel cannot run (this CPU machine), nothing changes by default.
    if not mx.cuda.is_available():
        fresh = tiny_model("qwen3")
        assert not install_fused_trunk(fresh)
        assert type(fresh.model).__module__.startswith("mlx_lm")


def test_a_kernel_that_disagrees_with_the_stock_ops_is_not_installed(monkeypatch, caplog):
    """The start-up check (kernels.add_rms_norm.check) compares every bit; a kernel that
    differs anywhere, or raises, leaves the stock trunk and says why."""
    from kiviq.engine import fused_trunk
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
    monkeypatch.setattr(fused_trunk, "supported", lambda size, dtype: True)
    model = tiny_model("qwen3")
    with caplog.at_level("WARNING", logger="kiviq.engine"):
        assert not install_fused_trunk(model)
    assert "fused residual adds disabled" in caplog.text and "nvrtc: error" in caplog.text
    assert type(model.model).__module__.startswith("mlx_lm")


def test_the_start_up_check_runs_at_each_eps_the_models_norms_use(monkeypatch):
    """A kernel right at 1e-6 but wrong at the model's 1e-5 must not be installed."""
    from kiviq.engine import fused_trunk

    model = tiny_model("llama")
    for i, layer in enumerate(model.model.layers):
        layer.post_attention_layernorm.eps = 1e-5 if i else 1e-6
    seen = []

    def check(size, dtype, eps=1e-6):
        seen.append(eps)
        return None if eps == 1e-6 else f"differs at eps {eps}"

    monkeypatch.setattr(fused_trunk, "supported", lambda size, dtype: True)
    monkeypatch.setattr(fused_trunk, "check", check)
    assert not install_fused_trunk(model)
    assert 1e-5 in seen and type(model.model).__module__.startswith("mlx_lm")
    for layer in model.model.layers:
        layer.post_attention_layernorm.eps = layer.input_layernorm.eps = model.model.norm.eps = 1e-6
    seen.clear()
    assert install_fused_trunk(model) and seen == [1e-6]


def counting(calls: list, fn):
    def counted(*args):
        calls.append(args[0].shape)
        return fn(*args)
    return counted


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_one_sequence_runs_swiglu_and_down_together_with_the_stock_numbers(family):
    """At one sequence each MLP is one ``swiglu_down`` call on the fused gate/up product
    (the reference here; the kernel's bits are tests/test_swiglu_down_gpu.py's); at two it
    is the stock MLP. Both give the stock trunk's hidden states, bit for bit."""
    model = distinct_norms(tiny_model(family))
    fuse_projections(model)
    trunk = model.model
    calls = []
    swiglu_down = counting(calls, swiglu_down_reference)
    for prompt, step in ((mx.array([[5, 17, 99, 3, 250]]), mx.array([[11]])),
                         (mx.array([[5, 17, 99, 3, 250], [8, 1, 64, 300, 12]]), mx.array([[11], [400]]))):
        caches = []
        for _ in range(2):
            cache = [KVCache() for _ in trunk.layers]
            trunk(prompt, cache)
            caches.append(cache)
        calls.clear()
        want = trunk(step, caches[0])
        got = fused_forward(trunk, step, caches[1], add_rms_norm_reference, swiglu_down)
        assert got.dtype == want.dtype and np.array_equal(np.array(got), np.array(want))
        assert len(calls) == (len(trunk.layers) if step.shape[0] == 1 else 0)
        assert all(shape[-1] == 2 * trunk.layers[0].mlp.down_proj.weight.shape[1] for shape in calls)


def test_the_engines_one_sequence_steps_take_swiglu_down():
    model = distinct_norms(tiny_model("qwen3"))
    fuse_projections(model)
    want = run_engine(engine_for(model), requests(), join_every=3)
    calls = []
    assert install_fused_trunk(model, add_norm=add_rms_norm_reference,
                               swiglu_down=counting(calls, swiglu_down_reference))
    assert run_engine(engine_for(model), requests(), join_every=3) == want
    assert calls and len(calls) % len(model.model.layers) == 0  # the steps where one sequence decoded
    alone = [requests()[0]]
    calls.clear()
    assert run_engine(engine_for(model), alone) == run_engine(engine_for(distinct_norms(tiny_model("qwen3"))), alone)
    steps, left = divmod(len(calls), len(model.model.layers))
    assert left == 0 and steps >= alone[0].max_tokens - 1  # every decode step (pipelined: one ahead)


def test_which_mlps_take_swiglu_down():
    """Only mlx-lm's bias-free MLP whose gate and up are one fused matmul (run
    ``fuse_projections`` first); any other keeps the stock MLP, and the trunk still gets
    its fused adds."""
    fused = tiny_model("llama")
    fuse_projections(fused)
    assert install_fused_trunk(fused, add_norm=add_rms_norm_reference, swiglu_down=swiglu_down_reference)
    assert fused.model._swiglu_down is swiglu_down_reference
    unfused = tiny_model("llama")
    assert install_fused_trunk(unfused, add_norm=add_rms_norm_reference, swiglu_down=swiglu_down_reference)
    assert unfused.model._swiglu_down is None
    biased = tiny_model("llama")
    fuse_projections(biased)
    biased.model.layers[1].mlp.down_proj.bias = mx.zeros((biased.model.layers[1].mlp.down_proj.weight.shape[0],))
    assert install_fused_trunk(biased, add_norm=add_rms_norm_reference, swiglu_down=swiglu_down_reference)
    assert biased.model._swiglu_down is None
    if not mx.cuda.is_available():  # the kernel runs nowhere here: the default is the stock MLP
        assert install_fused_trunk(fused, add_norm=add_rms_norm_reference)
        assert fused.model._swiglu_down is None


def test_a_swiglu_down_that_disagrees_with_the_stock_ops_is_not_installed(monkeypatch, caplog):
    """Its start-up check (kernels.swiglu_down.check) compares every bit at each MLP
    shape; a kernel that differs, or raises, leaves the stock MLP and says why, while
    the residual adds stay fused."""
    from kiviq.engine import fused_trunk
    from kiviq.kernels import swiglu_down as kernel

    monkeypatch.setattr(kernel, "swiglu_down", swiglu_down_reference)
    assert kernel.check(1536, 576, mx.bfloat16) is None

    def off_by_one_ulp(gate_up, weight):
        y = swiglu_down_reference(gate_up, weight)
        return (y.view(mx.uint16) + (mx.arange(y.size).reshape(y.shape) == 5)).view(y.dtype)

    monkeypatch.setattr(kernel, "swiglu_down", off_by_one_ulp)
    assert kernel.check(1536, 576, mx.float16) == "swiglu_down differs from the stock ops in 1 of 576 values"

    def broken(*_):
        raise RuntimeError("nvrtc: error")

    monkeypatch.setattr(kernel, "swiglu_down", broken)
    assert kernel.check(1536, 576, mx.float16) == "swiglu_down raised RuntimeError: nvrtc: error"
    monkeypatch.setattr(fused_trunk.swiglu_down_kernel, "supported", lambda hidden, dtype: True)
    model = tiny_model("qwen3")
    fuse_projections(model)
    with caplog.at_level("WARNING", logger="kiviq.engine"):
        assert install_fused_trunk(model, add_norm=add_rms_norm_reference)
    assert model.model._swiglu_down is None
    assert "SwiGLU kept apart from the down projection" in caplog.text and "nvrtc: error" in caplog.text
