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


# ---- how the batch is drawn (each against a row-by-row reference) -----------

def reference_penalty(logits: np.ndarray, history: list[int], penalty: float) -> np.ndarray:
    """mlx-lm's CTRL-style penalty over the last 20 tokens, one row."""
    out = logits.copy()
    for t in set(history[-20:]):
        out[t] = out[t] * penalty if out[t] < 0 else out[t] / penalty
    return out


def test_repetition_penalty_for_the_whole_batch_matches_row_by_row():
    from kiviq.engine.sampler import _penalize

    rng = np.random.default_rng(3)
    logits = rng.standard_normal((4, V)).astype(np.float32) * 4
    histories = [rng.integers(0, V, 40).tolist(), [], [7, 7, 7], rng.integers(0, 50, 5).tolist()]
    penalties = [1.3, 1.5, 1.0, 0.8]
    states = [RowState.create(SamplingParams(repetition_penalty=p), h) for p, h in zip(penalties, histories)]
    got = np.array(_penalize(mx.array(logits), states))
    for i, (h, p) in enumerate(zip(histories, penalties)):
        want = reference_penalty(logits[i], h, p) if p != 1.0 else logits[i]
        np.testing.assert_array_equal(got[i], want, err_msg=f"row {i}")


def test_a_batch_that_does_not_truncate_sorts_nothing(monkeypatch):
    import kiviq.engine.sampler as sampler

    def no_sort(*_):
        raise AssertionError("sorted the vocabulary for rows that do not truncate")

    monkeypatch.setattr(sampler, "_filter", no_sort)
    logits = mx.random.normal((3, V), key=mx.random.key(4))
    tokens, _ = draw(logits, rows(SamplingParams(temperature=0.8), SamplingParams(temperature=1.2, seed=5),
                                  SamplingParams()))
    assert len(tokens) == 3


def test_top_p_1_keeps_the_tail_whose_mass_above_rounds_to_1():
    from kiviq.engine.sampler import _filter

    # One dominant token: in float32 the mass above the far tail sums to 1.0.
    lp = np.full((2, V), -40.0, dtype=np.float32)
    lp[:, 0] = 0.0
    lp = lp - np.log(np.exp(lp.astype(np.float64)).sum(axis=-1, keepdims=True)).astype(np.float32)
    out = np.array(_filter(mx.array(lp), mx.array([0, 0]), mx.array([1.0, 0.5]), mx.array([0.0, 0.0])))
    assert np.isfinite(out[0]).all()  # top_p = 1: every token stays
    np.testing.assert_array_equal(out[0], lp[0])
    assert np.isfinite(out[1]).sum() == 1  # top_p = 0.5: only the dominant token


def test_truncation_is_each_rows_own():
    """top-k / top-p / min-p against a numpy reference, per row, in one batch."""
    from kiviq.engine.sampler import _filter

    rng = np.random.default_rng(6)
    lp = rng.standard_normal((4, V)).astype(np.float32) * 2
    lp = lp - np.log(np.exp(lp.astype(np.float64)).sum(-1, keepdims=True)).astype(np.float32)
    top_k, top_p, min_p = [0, 10, 0, 3], [1.0, 1.0, 0.6, 0.9], [0.0, 0.0, 0.0, 0.2]
    out = np.array(_filter(mx.array(lp), mx.array(top_k), mx.array(top_p), mx.array(min_p)))
    for i in range(4):
        order = np.argsort(-lp[i], kind="stable")
        probs = np.exp(lp[i][order].astype(np.float64))
        keep = np.ones(V, bool)
        if top_k[i]:
            keep[top_k[i]:] = False
        if top_p[i] < 1:
            keep &= (np.cumsum(probs) - probs) < top_p[i] + 1e-6
        keep &= probs >= min_p[i] * probs[0] - 1e-9
        keep[0] = True
        assert set(np.flatnonzero(np.isfinite(out[i]))) == set(order[keep]), f"row {i}"
        np.testing.assert_array_equal(out[i][np.isfinite(out[i])], lp[i][np.isfinite(out[i])])


def test_seeded_rows_draw_as_if_alone_and_share_one_key_array():
    params = SamplingParams(temperature=1.0, seed=42, top_k=50)
    logits = [mx.random.normal((3, V), key=mx.random.key(10 + k)) * 3 for k in range(4)]
    alone = RowState.create(params, [1])
    expected = []
    for step in logits:
        expected.append(draw(step[1:2], [alone])[0][0])
    batch = rows(SamplingParams(temperature=0.9), params, SamplingParams(temperature=0.5, seed=7))
    got = []
    for k, step in enumerate(logits):
        if k == 2:  # the unseeded row leaves: the others keep their keys
            batch, step = batch[1:], step[1:]
            got.append(draw(step, batch)[0][0])
        elif k == 3:
            got.append(draw(step[1:], batch)[0][0])
        else:
            got.append(draw(step, batch)[0][1])
        seeded = [r for r in batch if r.keys is not None]
        assert all(r.keys is seeded[0].keys for r in seeded)  # the next step reuses them as they are
        assert [r.at for r in seeded] == list(range(len(seeded)))
    assert got == expected
    assert alone.key.tolist() == batch[0].key.tolist()


def test_the_row_table_is_uploaded_once_while_the_batch_keeps_its_rows():
    from kiviq.engine.sampler import _row_table

    states = rows(SamplingParams(temperature=0.7), SamplingParams(top_p=0.9, temperature=1.0))
    first = _row_table(states)
    assert first.truncating is not None and first.truncating.tolist() == [1]
    assert _row_table(states) is first
    assert _row_table(states[:1]) is not first
    assert _row_table(states) is first  # the last two batches are kept
    np.testing.assert_array_equal(np.array(first.values), np.array([[0.7, 0, 1.0, 0, 0], [1.0, 0, 0.9, 0, 0]], np.float32))
