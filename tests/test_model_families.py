"""Stock mlx-lm model families run unchanged on KIVI caches (tiny random
weights; the real SmolLM2 is covered end to end)."""

from __future__ import annotations

import sys

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import base as mlx_lm_base
from mlx_lm.models.cache import make_prompt_cache

from kiviq.engine.kivi_cache import AttentionHook, KiviSequenceCache, kiviq_sdpa, make_store
from kiviq.engine.kv_store import KVConfig
from tests.engine_runs import tiny_model as tiny_llama

FAMILIES = {
    "llama": {},
    "mistral": {},  # mlx-lm maps it onto the llama implementation
    "qwen2": {},
    "qwen3": {"head_dim": 32},
}


def tiny_model(model_type: str):
    model = tiny_llama(model_type=model_type, **FAMILIES[model_type])
    mx.eval(model.parameters())
    return model


def run(model, cache, tokens: list[int], prefill: int) -> np.ndarray:
    """Prefill, then teacher-forced decode; the logits of every decode step."""
    model(mx.array(tokens[:prefill])[None], cache=cache)
    out = []
    for t in tokens[prefill:]:
        logits = model(mx.array([[t]]), cache=cache)[0, -1]
        mx.eval(logits)
        out.append(np.array(logits.astype(mx.float32)))
    return np.stack(out)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_runs_on_kivi_cache_close_to_fp_cache(family):
    model = tiny_model(family)
    tokens = [int(t) for t in np.random.default_rng(1).integers(0, 512, size=110)]
    want = run(model, make_prompt_cache(model), tokens, prefill=70)
    store = make_store(model, KVConfig(bits=8, group_size=16, residual=32), kv_memory=64 << 20,
                       max_sequences=1, dtype=mx.float32)
    cache = KiviSequenceCache(store)
    module = sys.modules[type(model.layers[0].self_attn).__module__]
    stock = mlx_lm_base.scaled_dot_product_attention
    assert module.scaled_dot_product_attention is stock  # building a store patches nothing
    with AttentionHook(model):
        assert module.scaled_dot_product_attention is kiviq_sdpa
        got = run(model, cache, tokens, prefill=70)
    assert module.scaled_dot_product_attention is stock and mlx_lm_base.scaled_dot_product_attention is stock
    assert cache.sequence.blocks_used[0] > 0  # the quantized path really ran
    # 8-bit KIVI: logits stay within a few percent of their spread.
    err = np.abs(got - want).max() / want.std()
    assert err < 0.05, err
    cache.release()
    assert store.blocks.used_bytes() == 0
