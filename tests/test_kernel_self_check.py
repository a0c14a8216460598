"""kernels.self_check: the kernels dispatch would run here, checked once against the
reference. On CPU no kernel runs, so the checks below inject backends through
`dispatch.kernel_module` (the one backend lookup): one that is the reference itself
(must pass), and faulty ones (must be reported, naming the operation)."""

from __future__ import annotations

import itertools
import types

import mlx.core as mx
import pytest

from kiviq.kernels import dispatch, launch
from kiviq.kernels.cuda_flush import STEP_FLUSH_SLOTS
from kiviq.kernels.kivi_reference import decode_attention, flush_tails, gather_flush_layers
from kiviq.kernels.qk_rope import Prologue
from kiviq.kernels.rotation import hadamard_rotate
from kiviq.kernels.self_check import _write_token as write_token
from kiviq.kernels.self_check import self_check

LAYOUT = dict(bits=4, group_size=32, head_dim=64, num_q_heads=8, num_kv_heads=2, dtype=mx.float16)


def fake_backend(*, attend_fault=None, attend_raises=None, flush_fault=False, prologues=None,
                 skip_norm=False):
    """A backend module with the names dispatch uses, computing with the reference,
    optionally wrong: attend output passed through `attend_fault`, attend_plan raising
    `attend_raises`, or the flushed blocks' key scales doubled. Its plans run a
    decode prologue (appended to `prologues`, a list) by `Prologue.reference`, and then
    scatter the new token into the tail, as the CUDA plan's launch does; with
    `skip_norm` that prologue leaves q and k unnormalized."""
    def attend_plan(q_shape, q_dtype, pool, block_tables, num_blocks, slots, tail_lens, *, scale, bits,
                    group_size, rotate_out=False, prologue=None, after=()):
        if attend_raises is not None:
            raise attend_raises
        if prologue is not None:
            plain = attend_plan(q_shape, q_dtype, pool, block_tables, num_blocks, slots, tail_lens, scale=scale,
                                bits=bits, group_size=group_size, rotate_out=rotate_out)

            def with_prologue(qkv, p, offsets, q_norm=None, k_norm=None):
                prologues.append(prologue)
                q, k, v = prologue.reference(qkv, offsets, *((None, None) if skip_norm else (q_norm, k_norm)))
                write_token(p, slots, tail_lens, k, v)
                return plain(q, p)
            return types.SimpleNamespace(with_prologue=with_prologue)

        def attend(q, p):
            flat = q.reshape(q.shape[0], q.shape[1], q.shape[-1])
            out = decode_attention(flat, p, block_tables, num_blocks, slots, tail_lens, scale=scale, bits=bits,
                                   group_size=group_size)
            if attend_fault is not None:
                out = attend_fault(out).astype(q.dtype)
            return hadamard_rotate(out.reshape(q.shape)) if rotate_out else out.reshape(q.shape)
        return attend

    def flush_layers(pools, slots, ids, *, bits, group_size, blocks_per_slot=1):
        gather_flush_layers(pools, slots, ids, bits=bits, group_size=group_size, blocks_per_slot=blocks_per_slot)
        if flush_fault:
            for pool in pools:
                pool.k_scales[ids] = pool.k_scales[ids] * 2
            mx.eval([p.k_scales for p in pools])

    return types.SimpleNamespace(NAME="fake", supports=launch.supports, attend_plan=attend_plan,
                                 flush_supports=launch.flush_supports, kivi_flush=flush_tails,
                                 flush_layers=flush_layers,
                                 prologue_supports=None if prologues is None else lambda *_: None)


@pytest.fixture
def inject(monkeypatch):
    def use(module):
        monkeypatch.setattr(dispatch, "kernel_module", lambda: module)
        assert dispatch.backend() == "fake"
    return use


def test_reference_backend_needs_no_check():
    if dispatch.kernel_module() is None:  # CPU: nothing but the reference runs
        assert dispatch.backend() == "reference"
    assert self_check(**LAYOUT) is None


@pytest.mark.parametrize("layout", [LAYOUT, dict(LAYOUT, bits=2, dtype=mx.bfloat16, head_dim=128),
                                    dict(LAYOUT, bits=8, group_size=16, num_q_heads=6, num_kv_heads=3)])
def test_a_correct_kernel_passes(inject, layout):
    inject(fake_backend())
    assert self_check(**layout) is None


@pytest.mark.parametrize("fault", [lambda out: out * 1.01,  # 1% off everywhere
                                   lambda out: mx.concatenate([mx.full(out[:1].shape, float("nan"), out.dtype),
                                                               out[1:]])],  # NaN in one sequence
                         ids=["scaled", "nan"])
def test_a_wrong_attend_is_reported_with_its_error(inject, fault):
    inject(fake_backend(attend_fault=fault))
    reason = self_check(**LAYOUT)
    assert reason is not None and reason.startswith("attend kernel:"), reason
    assert "max error" in reason and "\n" not in reason


def test_a_wrong_flush_is_reported(inject):
    inject(fake_backend(flush_fault=True))
    reason = self_check(**LAYOUT)
    assert reason is not None and reason.startswith("flush kernel:"), reason
    assert "k_scales" in reason


def test_a_kernel_that_raises_is_reported_with_the_error(inject):
    inject(fake_backend(attend_raises=RuntimeError("nvrtc: compilation failed\nkernel.cu(12): error: expected a ;")))
    reason = self_check(**LAYOUT)
    assert reason is not None and reason.startswith("attend kernel: raised RuntimeError"), reason
    assert "expected a ;" in reason and "\n" not in reason


def fake_step_flush(monkeypatch, *, fault=False):
    """Make dispatch say that a decode step flushes inside its graph here, with a
    stand-in `step_flush` that flushes by the reference the slots before the first -1
    (the kernel's contract), optionally dropping the last of them. Returns the
    (slots, ids, params) each call got."""
    calls = []

    def step_flush(pools, slots, ids, params, *, bits, group_size, use_kernel=None):
        calls.append((slots.tolist(), ids.tolist(), params.tolist()))
        live = list(itertools.takewhile(lambda s: s >= 0, slots.tolist()[:params.tolist()[-1]]))
        live = live[:-1] if fault else live
        gather_flush_layers(pools, live, ids.tolist()[:len(live)], bits=bits, group_size=group_size)
        return [mx.zeros((1,), mx.int32)]

    monkeypatch.setattr(dispatch, "step_flush_params", lambda pool, k, use_kernel=None: (160, 2, k))
    monkeypatch.setattr(dispatch, "step_flush", step_flush)
    return calls


def test_the_flush_a_decode_step_launches_is_checked_as_a_step_launches_it(inject, monkeypatch):
    inject(fake_backend())
    calls = fake_step_flush(monkeypatch)
    assert self_check(**LAYOUT) is None
    [(slots, ids, params)] = calls
    assert params[-1] == len(slots) == len(ids) and slots[-1] == -1  # padded to the batch, as a step's
    assert sum(s >= 0 for s in slots) > STEP_FLUSH_SLOTS  # more flushing slots than a step's blocks per head


def test_a_wrong_step_flush_is_reported(inject, monkeypatch):
    inject(fake_backend())
    fake_step_flush(monkeypatch, fault=True)
    reason = self_check(**LAYOUT)
    assert reason is not None and reason.startswith("flush kernel: step_flush, layer 0:"), reason


QWEN3_PROLOGUE = Prologue(8, 2, rope_base=1e6, eps=1e-6, norm=True)


@pytest.mark.parametrize("prologue", [QWEN3_PROLOGUE, Prologue(8, 2, rope_base=1e4)], ids=["norms", "rope"])
def test_the_prologue_in_the_launch_is_checked_where_the_kernel_runs_it(inject, prologue):
    ran = []
    inject(fake_backend(prologues=ran))
    assert self_check(**LAYOUT, prologue=prologue) is None
    assert ran == [prologue]
    inject(fake_backend())  # no prologue in its launches: nothing more to check
    assert self_check(**LAYOUT, prologue=prologue) is None


def test_a_prologue_that_skips_the_norms_is_reported(inject):
    inject(fake_backend(prologues=[], skip_norm=True))
    reason = self_check(**LAYOUT, prologue=QWEN3_PROLOGUE)
    assert reason is not None and reason.startswith("prologue kernel: output differs"), reason
