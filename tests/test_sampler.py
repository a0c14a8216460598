"""The batch sampler's logprobs (random logits, no model)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from kiviq.engine.request import SamplingParams
from kiviq.engine.sampler import RowState, sample

V = 1000


def rows(*params: SamplingParams) -> list[RowState]:
    return [RowState.create(p, [1, 2, 3]) for p in params]


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def draw(logits: mx.array, states: list[RowState]):
    out = sample(logits, states)
    mx.eval(*out.arrays())
    tokens = out.tokens.tolist()
    return tokens, out.row_logprobs(tokens)


def test_no_row_asks_builds_nothing():
    logits = mx.random.normal((3, V), key=mx.random.key(0))
    out = sample(logits, rows(SamplingParams(), SamplingParams(temperature=0.7, seed=1), SamplingParams()))
    assert out.chosen is None and out.top_ids is None and len(out.arrays()) == 1
    assert out.row_logprobs(out.tokens.tolist()) == [None, None, None]


def test_greedy_logprobs_are_log_softmax_of_the_logits():
    logits = mx.random.normal((4, V), key=mx.random.key(1)) * 3
    want = log_softmax(np.array(logits))
    tokens, lps = draw(logits, rows(SamplingParams(logprobs=5), SamplingParams(logprobs=0),
                                    SamplingParams(), SamplingParams(logprobs=20)))
    assert lps[2] is None  # did not ask
    assert lps[1].top == []
    for i in (0, 1, 3):
        lp = lps[i]
        assert lp.token_id == tokens[i] == int(np.argmax(want[i]))
        np.testing.assert_allclose(lp.logprob, want[i, tokens[i]], rtol=0, atol=1e-5)
    for i, n in ((0, 5), (3, 20)):
        top = lps[i].top
        assert len(top) == n
        ids, values = [t for t, _ in top], [v for _, v in top]
        assert ids[0] == tokens[i]  # greedy: the chosen token is the best
        assert values == sorted(values, reverse=True)
        assert ids == list(np.argsort(-want[i])[:n])
        np.testing.assert_allclose(values, want[i, ids], rtol=0, atol=1e-5)


def test_sampled_rows_report_the_tempered_distribution_before_truncation():
    """log_softmax(logits / T), and top-k/top-p/min-p do not change it."""
    logits = mx.random.normal((3, V), key=mx.random.key(2)) * 2
    params = [SamplingParams(temperature=0.7, top_k=5, seed=3, logprobs=8),
              SamplingParams(temperature=1.5, top_p=0.5, seed=4, logprobs=3),
              SamplingParams(temperature=0.9, min_p=0.2, seed=5, logprobs=0)]
    tokens, lps = draw(logits, rows(*params))
    for i, p in enumerate(params):
        want = log_softmax(np.array(logits[i]) / p.temperature)
        np.testing.assert_allclose(lps[i].logprob, want[tokens[i]], rtol=0, atol=1e-5)
        ids = [t for t, _ in lps[i].top]
        assert ids == list(np.argsort(-want)[:p.logprobs])  # the model's alternatives, not only survivors
        np.testing.assert_allclose([v for _, v in lps[i].top], want[ids], rtol=0, atol=1e-5)
    # top_k=5 truncates the first row, yet 8 alternatives with finite logprobs come back.
    assert len(lps[0].top) == 8 and all(np.isfinite(v) for _, v in lps[0].top)


def test_repetition_penalty_is_included():
    logits = mx.random.normal((1, V), key=mx.random.key(3))
    p = SamplingParams(repetition_penalty=1.3, logprobs=2)
    state = RowState.create(p, [5, 6, 7])
    penalized = np.array(logits[0])
    for t in (5, 6, 7):
        penalized[t] = penalized[t] * 1.3 if penalized[t] < 0 else penalized[t] / 1.3
    tokens, lps = draw(logits, [state])
    np.testing.assert_allclose(lps[0].logprob, log_softmax(penalized)[tokens[0]], rtol=0, atol=1e-5)


def test_logprobs_do_not_depend_on_batch_companions():
    logits = mx.random.normal((4, V), key=mx.random.key(4)) * 2
    mine = SamplingParams(temperature=0.8, top_p=0.9, seed=11, logprobs=4)
    alone_tokens, alone = draw(logits[1:2], rows(mine))
    companions = [SamplingParams(), SamplingParams(temperature=1.2, logprobs=20),
                  SamplingParams(temperature=0.5, seed=2, logprobs=1)]
    tokens, together = draw(logits, rows(companions[0], mine, *companions[1:]))
    assert tokens[1] == alone_tokens[0]
    assert together[1].token_id == alone[0].token_id
    assert len(together[1].top) == 4  # cut to its own N, not the batch's largest
    np.testing.assert_allclose(together[1].logprob, alone[0].logprob, rtol=0, atol=1e-6)
    assert [t for t, _ in together[1].top] == [t for t, _ in alone[0].top]
    np.testing.assert_allclose([v for _, v in together[1].top], [v for _, v in alone[0].top], rtol=0, atol=1e-6)
    assert together[0] is None


def test_asking_for_logprobs_does_not_change_the_draws():
    logits = mx.random.normal((3, V), key=mx.random.key(5))
    base = [SamplingParams(temperature=0.9, seed=1), SamplingParams(), SamplingParams(temperature=0.6, seed=2)]
    plain = sample(logits, rows(*base)).tokens.tolist()
    asked = [SamplingParams(p.temperature, seed=p.seed, logprobs=3) for p in base]
    assert draw(logits, rows(*asked))[0] == plain
