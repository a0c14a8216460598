"""The batch sampler on the GPU against the CPU: the ops it relies on (sort,
scatter through the permutation, vmapped key splits and Gumbel draws) run on
MLX's CUDA or Metal backend and give what the CPU gives."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from kiviq.engine.request import SamplingParams
from kiviq.engine.sampler import RowState, _filter, _penalize, sample

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not mx.is_available(mx.gpu), reason="needs an MLX GPU backend")]

V = 49152  # the default model's vocabulary


def on(device, fn, *args):
    with mx.stream(device):
        out = fn(*args)
        mx.eval(out)
    return np.array(out)


def test_truncation_keeps_the_same_tokens_on_the_gpu():
    rng = np.random.default_rng(0)
    lp = rng.standard_normal((6, V)).astype(np.float32) * 3
    lp = lp - np.log(np.exp(lp.astype(np.float64)).sum(-1, keepdims=True)).astype(np.float32)
    top_p = np.array([1.0, 1.0, 0.9, 0.5, 0.95, 1.0])
    args = (mx.array(lp), mx.array([0, 40, 0, 0, 5, 0]), mx.array(top_p, dtype=mx.float32),
            mx.array([0.0, 0.0, 0.0, 0.0, 0.0, 0.1]))
    gpu, cpu = on(mx.gpu, _filter, *args), on(mx.cpu, _filter, *args)
    np.testing.assert_array_equal(gpu[np.isfinite(gpu)], lp[np.isfinite(gpu)])
    # top-k, min-p and top_p=1 rows: the same set. top-p rows: the GPU's scan sums
    # the float32 mass in another order than the CPU's (over 49k terms either errs
    # by up to ~2e-4), so a token whose exact mass above it lies within 1e-3 of
    # top_p may fall on either side; no other may.
    mass_above = np.empty_like(lp, dtype=np.float64)
    for row in range(lp.shape[0]):
        order = np.argsort(-lp[row], kind="stable")
        probs = np.exp(lp[row, order].astype(np.float64))
        mass_above[row, order] = np.cumsum(probs) - probs
    differ = np.isfinite(gpu) != np.isfinite(cpu)
    at_edge = np.abs(mass_above - top_p[:, None]) < 1e-3
    assert not (differ & ~at_edge).any(), np.argwhere(differ & ~at_edge)
    assert not differ[top_p >= 1.0].any()
    assert np.isfinite(gpu[0]).all() and np.isfinite(gpu[1]).sum() == 40


def test_the_penalty_scatter_is_the_cpus():
    rng = np.random.default_rng(1)
    logits = mx.array(rng.standard_normal((3, V)).astype(np.float32))
    states = [RowState.create(SamplingParams(repetition_penalty=p), h)
              for p, h in ((1.3, rng.integers(0, V, 30).tolist()), (1.0, [1, 2]), (0.7, [5, 5, 9]))]
    np.testing.assert_array_equal(on(mx.gpu, _penalize, logits, states), on(mx.cpu, _penalize, logits, states))


def test_a_mixed_batch_draws_by_its_rows_rules_on_the_gpu():
    """Greedy rows take the argmax, top_k=1 rows too, seeded rows draw as they
    would alone, every draw lies inside its row's truncated set."""
    logits = mx.random.normal((6, V), key=mx.random.key(2)) * 4
    params = [SamplingParams(), SamplingParams(temperature=0.8, top_k=1), SamplingParams(temperature=1.0, seed=3),
              SamplingParams(temperature=0.9, top_p=0.5, seed=4), SamplingParams(temperature=1.2),
              SamplingParams(temperature=0.7, repetition_penalty=1.2, min_p=0.05, logprobs=3)]
    states = [RowState.create(p, [11, 12]) for p in params]
    out = sample(logits, states)
    mx.eval(*out.arrays())
    tokens = out.tokens.tolist()
    best = np.argmax(np.array(logits), axis=-1)
    assert tokens[0] == best[0] and tokens[1] == best[1]
    for i in (2, 3):  # seeded: the same draw alone
        alone = sample(logits[i:i + 1], [RowState.create(params[i], [11, 12])])
        assert alone.tokens.tolist() == [tokens[i]]
    lp = np.array(logits[3]) / 0.9
    lp = lp - np.log(np.exp(lp.astype(np.float64) - lp.max()).sum()) - lp.max()
    order = np.argsort(-lp)
    mass_above = np.cumsum(np.exp(lp[order])) - np.exp(lp[order])
    assert tokens[3] in set(order[mass_above < 0.5 + 1e-5])
    assert out.row_logprobs(tokens)[5].token_id == tokens[5]
    assert len(set(tokens)) > 1 and all(0 <= t < V for t in tokens)


def test_the_engine_samples_mixed_batches_on_the_gpu():
    """The warm-up's sampling (every op of the sampler) runs in the engine, pipelined;
    seeded requests draw the same tokens whatever the global generator gives the
    unseeded ones beside them (the batches' shapes are the same in both runs)."""
    from kiviq.engine import Engine, Request
    from kiviq.engine.kivi_cache import attention_shape, model_dtype
    from kiviq.engine.kv_store import KiviStore, KVConfig
    from kiviq.engine.warmup import warm_up
    from engine_runs import IdTokenizer, run_engine
    from tests.test_model_families import tiny_model

    model = tiny_model("qwen3")
    layers, h_kv, d = attention_shape(model)
    store = KiviStore(layers, h_kv, d, config=KVConfig(bits=4, group_size=16, residual=32), num_blocks=256,
                      num_slots=8, dtype=model_dtype(model))
    engine = Engine(model, IdTokenizer(), store, max_batch_tokens=128, pipeline=True)
    warm_up(engine, model.args.vocab_size)
    assert not engine.has_work()
    params = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.9, top_k=30, seed=11),
              SamplingParams(temperature=0.7, seed=2, top_p=0.8), SamplingParams(temperature=1.2, top_p=0.9),
              SamplingParams(temperature=0.8, seed=5, logprobs=2)]
    runs = []
    for global_seed in (1, 2):
        mx.random.seed(global_seed)
        runs.append(run_engine(engine, [Request(f"r{i}", list(range(i, i + 20 + 3 * i)), 16 + i, p)
                                        for i, p in enumerate(params)], join_every=2))
    for i, p in enumerate(params):
        assert len(runs[0][f"r{i}"]) == 16 + i
        if p.seed is not None:
            assert runs[0][f"r{i}"] == runs[1][f"r{i}"], f"seeded row {i}"
    assert runs[0]["r0"] != runs[1]["r0"]  # the unseeded rows did meet other noise
