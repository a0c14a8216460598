"""Batched first-chunk prefill: one right-padded forward per group of new
sequences, their keys and values written into the store by prepared indices
(KiviStore.begin_prefill / write_prefill), logits only after each last token."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from kiviq.engine import Request, SamplingParams
from kiviq.engine.kv_store import KiviStore, KVConfig
from kiviq.engine.model_runner import vocabulary_projection
from kiviq.engine.scheduler import pack_first_chunks
from test_batch_engine import make_engine, prompts

H_KV, D = 2, 64


def _store(bits, g=16, r=32, k=1, layers=2):
    return KiviStore(layers, H_KV, D, config=KVConfig(bits, g, r, k), num_blocks=96, num_slots=6, dtype=mx.float16)


@pytest.mark.parametrize("bits,k", [(4, 1), (2, 2), (8, 1)])
def test_batched_prefill_writes_what_appending_each_sequence_writes(bits, k):
    """Rows of lengths below, at and past the flush thresholds, padded to one width:
    every pool array equals the one-sequence-at-a-time path, bit for bit, and the
    bookkeeping too."""
    lengths = [5, 47, 48, 49, 130, 131]  # R + k*G - 1, R + k*G, ... at G=16, R=32
    width = max(lengths)
    rng = np.random.default_rng(bits)
    k_all = mx.array(rng.standard_normal((len(lengths), H_KV, width, D)).astype(np.float16))
    v_all = mx.array(rng.standard_normal((len(lengths), H_KV, width, D)).astype(np.float16))
    one, batched = _store(bits, k=k), _store(bits, k=k)
    seqs_one = [one.blocks.allocate() for _ in lengths]
    seqs_b = [batched.blocks.allocate() for _ in lengths]
    for layer in range(one.num_layers):
        for i, (s, n) in enumerate(zip(seqs_one, lengths)):
            one.append(layer, s, k_all[i, :, :n] + layer, v_all[i, :, :n] - layer)
    batch = batched.begin_prefill(seqs_b, lengths, width)
    for layer in range(batched.num_layers):
        batched.write_prefill(layer, batch, k_all + layer, v_all - layer)
    mx.eval(one.pools, batched.pools)
    for a, b in zip(seqs_one, seqs_b):
        assert (a.tail_lens, a.blocks_used, a.block_ids) == (b.tail_lens, b.blocks_used, b.block_ids)
    for pa, pb in zip(one.pools, batched.pools):
        for name, x, y in zip(pa._fields, pa, pb):
            assert mx.array_equal(x, y).item(), name


def test_begin_prefill_takes_first_chunks_only():
    store = _store(4)
    seq = store.blocks.allocate()
    store.append(0, seq, mx.zeros((H_KV, 3, D)), mx.zeros((H_KV, 3, D)))
    with pytest.raises(ValueError, match="first chunks"):
        store.begin_prefill([seq], [4], 4)


def test_pack_first_chunks_groups_similar_lengths_within_the_budget():
    assert pack_first_chunks([], 100) == []
    assert pack_first_chunks([10, 10, 10], 100) == [[0, 1, 2]]
    assert pack_first_chunks([10, 10, 10], 20) == [[0, 1], [2]]
    assert pack_first_chunks([500], 100) == [[0]]  # longer than the budget: alone
    # Longest first; a short chunk does not pad a long one's forward.
    assert pack_first_chunks([20, 100, 98, 19], 1000) == [[1, 2], [0, 3]]
    lengths = [1200 + (i * 37) % 240 - 120 for i in range(64)]
    groups = pack_first_chunks(lengths, 16384, multiple=64)
    assert sorted(i for g in groups for i in g) == list(range(64))
    for g in groups:
        padded = len(g) * -(-max(lengths[i] for i in g) // 64) * 64
        assert padded <= 16384 and padded - sum(lengths[i] for i in g) <= 0.125 * padded
    assert len(groups) <= 7  # 77k tokens in forwards of <= 16k
    assert pack_first_chunks([100, 90, 80], 256, multiple=128) == [[0, 1], [2]]  # 2 x 128 fit, 3 do not


def test_batched_prefill_equals_one_by_one(smollm2):
    """Greedy tokens and logprobs of prompts prefilled in one padded forward (with
    flushes inside the prompts) equal those of each prompt prefilled alone."""
    model, tok = smollm2
    ps = prompts(tok, 5)

    def run(reqs):
        engine = make_engine(model, tok, max_batch_tokens=4096, pipeline=False)
        for r in reqs:
            engine.add(r)
        out = {}
        while engine.has_work():
            for ev in engine.step():
                lps = [round(lp.logprob, 3) for lp in ev.logprobs or []]
                out.setdefault(ev.request_id, []).append((ev.token_ids, lps))
        return out

    def reqs():
        return [Request(f"r{i}", p, 6, SamplingParams(logprobs=2)) for i, p in enumerate(ps)]

    together = run(reqs())
    alone = {}
    for r in reqs():
        alone.update(run([r]))
    assert together == alone


def test_a_failing_row_of_a_batched_prefill_fails_alone(smollm2, monkeypatch):
    model, tok = smollm2
    engine = make_engine(model, tok, pipeline=False)
    ps = prompts(tok, 3)
    for i, p in enumerate(ps):
        engine.add(Request(f"r{i}", p, 3))
    real = engine.runner.prefill_first

    def prefill_first(seqs, chunks):  # r1's prompt breaks any forward it is in
        if any(len(c) == len(ps[1]) and c == ps[1] for c in chunks):
            raise RuntimeError("poison")
        return real(seqs, chunks)

    monkeypatch.setattr(engine.runner, "prefill_first", prefill_first)
    ends = {}
    while engine.has_work():
        for ev in engine.step():
            if ev.finish_reason:
                ends[ev.request_id] = (ev.finish_reason, ev.error)
    assert ends["r1"][0] == "error" and "poison" in ends["r1"][1]
    assert ends["r0"][0] == ends["r2"][0] == "length"
    assert engine.kv_store.blocks.free_slots == engine.capacity


def test_prefill_logits_come_from_the_last_rows_only(smollm2):
    """The vocabulary projection of the last hidden rows equals the model's own
    logits there (SmolLM2 is a llama: its head is the tied embedding)."""
    model, _ = smollm2
    head = vocabulary_projection(model)
    assert head is not None
    tokens = mx.array([[1, 2, 3, 4, 5]])
    full = model(tokens)[0, -1]
    mine = head(model.model(tokens)[:, -1])[0]
    assert mx.allclose(full.astype(mx.float32), mine.astype(mx.float32), atol=1e-3).item()


def test_batched_prefill_updates_the_pool_in_place(smollm2):
    """A prefill forward allocates the same whatever the pool's size: its writes
    are scatters that update the pool in place (no copy of whole pool arrays)."""
    model, tok = smollm2

    def prefill_peak(blocks):
        engine = make_engine(model, tok, blocks=blocks, pipeline=False, max_batch_tokens=4096)
        for i, p in enumerate(prompts(tok, 4)):
            engine.add(Request(f"r{i}", p, 4))
        mx.synchronize()
        base = mx.get_active_memory()
        mx.reset_peak_memory()
        engine.step()
        mx.synchronize()
        assert engine.scheduler.running and not engine.scheduler.prefilling
        return mx.get_peak_memory() - base

    small, large = prefill_peak(128), prefill_peak(8192)  # ~34 MiB more pool per layer array
    assert large < small + (4 << 20), (small, large)
