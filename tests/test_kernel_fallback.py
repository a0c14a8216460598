"""The start-up self-check (engine.setup.kernel_choice): a kernel that disagrees
with the reference, or whose check fails, never serves tokens; the worker logs
one warning and runs the reference path (tiny random llama, CPU)."""

from __future__ import annotations

import logging
import sys
import types

import mlx.core as mx
import pytest

import kiviq.engine.kv_store as kv_store_module
from kiviq.engine import Request, build_engine
from tests.engine_runs import IdTokenizer, run_engine
from tests.engine_runs import tiny_model as tiny_llama

OPTIONS = dict(kv_bits=4, kv_group_size=16, kv_residual=32, kv_memory=64 << 20, max_sequences=4,
               compile_decode=False)


def tiny_model():
    model = tiny_llama()
    mx.eval(model.parameters())
    return model


def requests():
    # Long enough that prefill quantizes blocks and decode flushes tails.
    return [Request(f"r{i}", [1 + i, 40 + 7 * i, 9, 200 - i] * (10 + 3 * i), 24) for i in range(3)]


def fake_self_check(monkeypatch, result):
    """Install a stand-in kiviq.kernels.self_check whose self_check returns
    ``result`` (or raises it, for an exception); returns the calls it saw."""
    calls = []

    def self_check(**kwargs):
        calls.append(kwargs)
        if isinstance(result, Exception):
            raise result
        return result

    module = types.ModuleType("kiviq.kernels.self_check")
    module.self_check = self_check
    monkeypatch.setitem(sys.modules, "kiviq.kernels.self_check", module)
    return calls


def dispatch_choices(monkeypatch) -> list:
    """The use_kernel of every attention plan and flush the store asks for."""
    seen = []
    for name in ("attend_plan", "flush_layers"):
        real = getattr(kv_store_module, name)

        def spy(*a, _real=real, **kw):
            seen.append(kw.get("use_kernel", "missing"))
            return _real(*a, **kw)

        monkeypatch.setattr(kv_store_module, name, spy)
    return seen


@pytest.mark.parametrize("failure", ["decode attention differs from the reference by 0.5 at B=2",
                                     RuntimeError("kernel compile failed")], ids=["mismatch", "error"])
def test_a_failed_self_check_switches_to_the_reference_with_one_warning(monkeypatch, caplog, failure):
    model = tiny_model()
    want = run_engine(build_engine(model, IdTokenizer(), use_kernel=False, **OPTIONS), requests())

    calls = fake_self_check(monkeypatch, failure)
    seen = dispatch_choices(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="kiviq.engine"):
        engine = build_engine(model, IdTokenizer(), **OPTIONS)
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    assert "reference" in warnings[0].getMessage() and str(failure) in warnings[0].getMessage()
    assert calls == [dict(bits=4, group_size=16, head_dim=32, num_q_heads=4, num_kv_heads=2,
                          dtype=mx.float32, residual=32, prologue=None)]
    assert engine.kv_store.use_kernel is False and engine.config.use_kernel is False

    got = run_engine(engine, requests())
    assert got == want and all(got.values())
    assert seen and all(choice is False for choice in seen), seen


def test_a_passing_self_check_keeps_the_kernel_choice(monkeypatch, caplog):
    fake_self_check(monkeypatch, None)
    with caplog.at_level(logging.WARNING, logger="kiviq.engine"):
        engine = build_engine(tiny_model(), IdTokenizer(), **OPTIONS)
    assert not caplog.records
    assert engine.kv_store.use_kernel is None


def test_the_self_check_gets_the_prologue_the_decode_steps_run(monkeypatch):
    import kiviq.engine.setup as setup
    from kiviq.engine.decode_attention import install_decode_attention

    calls = fake_self_check(monkeypatch, None)
    # As on CUDA: the layers hand their projection row to the kernels.
    monkeypatch.setattr(setup, "install_decode_attention", lambda m: install_decode_attention(m, anywhere=True))
    model = tiny_model()
    build_engine(model, IdTokenizer(), **OPTIONS)
    [call] = calls
    assert call["prologue"] is model.model.layers[0].self_attn._prologues[False]


def test_a_forced_reference_runs_no_self_check(monkeypatch):
    calls = fake_self_check(monkeypatch, "should not be asked")
    engine = build_engine(tiny_model(), IdTokenizer(), use_kernel=False, **OPTIONS)
    assert calls == [] and engine.kv_store.use_kernel is False


def test_worker_flags_and_kiviq_kernels_build_the_config():
    from kiviq.worker.cli import build_parser, engine_config

    args = build_parser().parse_args(["--kv-bits", "2", "--max-active", "5", "--max-batch-tokens", "256"])
    config = engine_config(args, environ={})
    assert (config.kv_bits, config.max_sequences, config.flat_qmm, config.max_batch_tokens) == (2, 5, True, 256)
    assert config.use_kernel is None
    assert engine_config(args, environ={"KIVIQ_KERNELS": "reference"}).use_kernel is False
    with pytest.raises(SystemExit, match="KIVIQ_KERNELS"):
        engine_config(args, environ={"KIVIQ_KERNELS": "refrence"})
    with pytest.raises(SystemExit, match="kv_residual"):
        engine_config(build_parser().parse_args(["--kv-residual", "40"]), environ={})


def test_2r_self_checks_the_2bit_kernels(monkeypatch):
    """--kv-bits 2r reads 2-bit pools through the 2-bit kernels (rotated rows are just
    data to them), so its self-check runs at bits=2."""
    calls = fake_self_check(monkeypatch, None)
    engine = build_engine(tiny_model(), IdTokenizer(), **{**OPTIONS, "kv_bits": 2, "kv_rotate": True})
    assert [c["bits"] for c in calls] == [2]
    assert engine.kv_store.config.bits == 2 and engine.kv_store.rotation is not None
    assert all(len(t) == 24 for t in run_engine(engine, requests()).values())
