"""The decode prologue in the attention launch (engine.decode_attention): which layers
get it, and that the path gives the engine's tokens unchanged. On the CPU the path runs
the reference prologue (kernels.qk_rope.Prologue.reference); the kernels' bits against
it are tests/test_prologue_gpu.py's."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from kiviq.engine import Engine, Request
from kiviq.engine.decode_attention import install_decode_attention
from kiviq.engine.fused_projections import fuse_projections
from kiviq.engine.kivi_cache import attention_shape, model_dtype
from kiviq.engine.kv_store import KiviStore, KVConfig
from kiviq.kernels.qk_rope import Prologue
from engine_runs import IdTokenizer, run_engine
from tests.test_model_families import FAMILIES, tiny_model

KV = KVConfig(bits=4, group_size=16, residual=32)


def engine_for(model, *, use_kernel=None, config=KV) -> Engine:
    layers, h_kv, d = attention_shape(model)
    store = KiviStore(layers, h_kv, d, config=config, num_blocks=128, num_slots=8, dtype=model_dtype(model),
                      use_kernel=use_kernel)
    return Engine(model, IdTokenizer(), store, max_batch_tokens=64, pipeline=True)


def requests():
    rng = np.random.default_rng(3)
    # Different lengths and join times: every step decodes rows at different RoPE offsets.
    return [Request(f"r{i}", [int(t) for t in rng.integers(1, 500, size=9 + 7 * i)], max_tokens=40 - 3 * i)
            for i in range(5)]


@pytest.fixture
def prologues(monkeypatch):
    """The prologues the decode steps ran (Prologue.reference, on the CPU)."""
    ran = []
    stock = Prologue.reference

    def spy(self, *args, **kwargs):
        ran.append(self)
        return stock(self, *args, **kwargs)
    monkeypatch.setattr(Prologue, "reference", spy)
    return ran


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_path_gives_the_stock_tokens(family, prologues):
    model = tiny_model(family)
    fuse_projections(model)
    want = run_engine(engine_for(model), requests(), join_every=3)
    assert not prologues
    assert install_decode_attention(model, anywhere=True) == len(model.model.layers)
    got = run_engine(engine_for(model), requests(), join_every=3)
    assert got == want
    assert len(prologues) > 0  # the decode steps took the path
    attn = model.model.layers[0].self_attn
    assert prologues[0] == attn._prologues[False] and prologues[0].norm == (attn.get("q_norm") is not None)
    stock = type(attn).__mro__[1]
    assert isinstance(attn, stock) and stock.__module__.startswith("mlx_lm")
    # A store told not to use kernels keeps the stock forward.
    prologues.clear()
    assert run_engine(engine_for(model, use_kernel=False), requests(), join_every=3) == want
    assert prologues == []


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_a_rotated_store_gets_q_k_v_rotated_by_the_prologue(family, prologues):
    """2r: the prologue rotates q, k and v (the kernel does it in its launch) and the
    cache rotates none of them again (the store's attention plan rotates the output
    back); the tokens are the stock path's."""
    rotated = KVConfig(bits=2, group_size=16, residual=32, rotate=True)
    model = tiny_model(family)
    fuse_projections(model)
    want = run_engine(engine_for(model, config=rotated), requests(), join_every=3)
    install_decode_attention(model, anywhere=True)
    assert run_engine(engine_for(model, config=rotated), requests(), join_every=3) == want
    assert prologues and all(p.rotate for p in prologues)
    prologues.clear()
    run_engine(engine_for(model), requests()[:1])  # a plain store: nothing rotated
    assert prologues and not any(p.rotate for p in prologues)


def test_who_gets_the_path():
    model = tiny_model("llama")
    assert install_decode_attention(model, anywhere=True) == 0  # projections not fused
    fuse_projections(model)
    assert install_decode_attention(model, anywhere=True) == len(model.model.layers)
    cls = type(model.model.layers[0].self_attn)
    assert install_decode_attention(model, anywhere=True) == len(model.model.layers)
    assert type(model.model.layers[0].self_attn) is cls  # installed once
    # A RoPE that is not the plain one (traditional, scaled variants) keeps the stock forward.
    other = tiny_model("qwen3")
    fuse_projections(other)
    other.model.layers[0].self_attn.rope = nn.RoPE(32, traditional=True)
    assert install_decode_attention(other, anywhere=True) == len(other.model.layers) - 1
    # Where the kernel cannot run (this CPU machine), nothing changes by default.
    if not mx.cuda.is_available():
        fresh = tiny_model("qwen3")
        fuse_projections(fresh)
        assert install_decode_attention(fresh) == 0
