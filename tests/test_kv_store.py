"""The paged KIVI store and the mlx-lm cache adapter (CPU, plain-ops reference)."""

from __future__ import annotations

import random
import time

import mlx.core as mx
import numpy as np
import pytest

from kiviq.engine.kivi_cache import KiviLayerCache
from kiviq.engine.kv_store import KiviStore, KVConfig, OutOfKVMemory
from kiviq.kernels import decode_attention_dense, dequantize_key_blocks, dequantize_value_blocks, tokens_to_blocks
from kiviq.kernels import quantize_key_blocks, quantize_value_blocks, blocks_to_tokens
from tests.kv_helpers import append_decode, attend_decode, decode_attend

H_KV, D = 2, 64


def make_store(bits=4, g=16, r=32, blocks=64, slots=4, layers=2, dtype=mx.float32, k=1):
    return KiviStore(layers, H_KV, D, config=KVConfig(bits, g, r, k), num_blocks=blocks, num_slots=slots,
                     dtype=dtype)


def qdq(x: mx.array, bits: int, g: int) -> mx.array:
    """Quantize-dequantize the full blocks of x [H, S, D] (what the store must hold)."""
    kb = tokens_to_blocks(x, g)
    k = blocks_to_tokens(dequantize_key_blocks(*quantize_key_blocks(kb, bits=bits), bits=bits))
    v = blocks_to_tokens(dequantize_value_blocks(*quantize_value_blocks(kb, bits=bits), bits=bits))
    return k, v


@pytest.mark.parametrize("bits,k", [(2, 1), (4, 1), (8, 1), (4, 3), (2, 2)])
def test_flush_rule_and_contents_after_every_step(bits, k):
    """Tail length invariant (R .. R + k*G - 1 once past R + k*G tokens; k
    blocks per flush), quantized part a multiple of k*G, K and V aligned, and
    the stored tokens equal quantize->dequantize of what was written, through
    both the prefill path (append) and the decode path (append_decode)."""
    g, r = 16, 32
    store = make_store(bits, g, r, k=k)
    seq = store.blocks.allocate()
    rng = random.Random(bits * 10 + k)
    keys = mx.random.normal((H_KV, 0, D))
    steps = [rng.choice([1, 1, 1, 5, 17, 40]) for _ in range(40)]
    steps += [1] * (2 * k * g + 3)  # decode steps through at least two decode-path flushes
    for n in steps:
        k_new = mx.random.normal((H_KV, n, D))
        keys = mx.concatenate([keys, k_new], axis=1)
        for layer in range(store.num_layers):
            if n == 1 and keys.shape[1] > 1:  # a decode step: flushes through flush_layers
                append_decode(store, layer, [seq], k_new[None, :, 0], k_new[None, :, 0])
            else:  # V = K: both paths checked on the same data
                store.append(layer, seq, k_new, k_new)
        total = keys.shape[1]
        for layer in range(store.num_layers):
            tail, nb = seq.tail_lens[layer], seq.blocks_used[layer]
            assert nb * g + tail == total
            if total < r + k * g:
                assert nb == 0 and tail == total
            else:
                assert r <= tail <= r + k * g - 1
            assert nb % k == 0 and nb == store.blocks.blocks_needed(total)
            assert len(seq.block_ids) == nb
        past_k, past_v = store.dense_past(0, seq)
        cut = seq.blocks_used[0] * g
        want_k, want_v = qdq(keys[:, :cut], bits, g)
        np.testing.assert_allclose(np.array(past_k[:, :cut]), np.array(want_k), rtol=0, atol=1e-6)
        np.testing.assert_allclose(np.array(past_v[:, :cut]), np.array(want_v), rtol=0, atol=1e-6)
        np.testing.assert_array_equal(np.array(past_k[:, cut:]), np.array(keys[:, cut:]))


def test_batched_decode_append_equals_one_by_one():
    g, r = 16, 32
    a, b = make_store(4, g, r, slots=8), make_store(4, g, r, slots=8)
    lens = [0, 3, r + g - 2, r + g - 1, 100]
    seqs_a = [a.blocks.allocate() for _ in lens]
    seqs_b = [b.blocks.allocate() for _ in lens]
    for sa, sb, n in zip(seqs_a, seqs_b, lens):
        if n:
            x = mx.random.normal((H_KV, n, D))
            a.append(0, sa, x, x)
            b.append(0, sb, x, x)
    for _ in range(3):
        k = mx.random.normal((len(lens), H_KV, D))
        append_decode(a, 0, seqs_a, k, k)
        for i, s in enumerate(seqs_b):
            b.append(0, s, k[i][:, None], k[i][:, None])
    for sa, sb in zip(seqs_a, seqs_b):
        assert (sa.tail_lens[0], sa.blocks_used[0]) == (sb.tail_lens[0], sb.blocks_used[0])
        for x, y in zip(a.dense_past(0, sa), b.dense_past(0, sb)):
            np.testing.assert_array_equal(np.array(x), np.array(y))


def test_decode_batch_holds_the_step_values():
    """begin_decode's arrays (views of one host array) hold what the sequences say,
    for the token the step writes: it advances the bookkeeping first."""
    store = make_store(g=16, r=32, slots=4, layers=2)
    lens = [5, 140, 33]
    seqs = [store.blocks.allocate() for _ in lens]
    for layer in range(2):
        for s, n in zip(seqs, lens):
            x = mx.random.normal((H_KV, n, D))
            store.append(layer, s, x, -x)
    before = [(s.tail_lens[0], s.blocks_used[0]) for s in seqs]
    batch = store.begin_decode(seqs)
    assert np.array(batch.slots).tolist() == [s.slot for s in seqs]
    assert np.array(batch.tail_lens).tolist() == [s.tail_lens[0] for s in seqs]
    assert np.array(batch.num_blocks).tolist() == [s.blocks_used[0] for s in seqs]
    assert np.array(batch.offsets).tolist() == [nb * 16 + t for t, nb in before]
    assert np.array(batch.write_index[2][:, 0, 0]).tolist() == [s.tail_lens[0] - 1 for s in seqs]
    for row, s in zip(np.array(batch.block_tables), seqs):
        assert row[:s.blocks_used[0]].tolist() == s.block_ids[:s.blocks_used[0]]
        assert not row[s.blocks_used[0]:].any()


@pytest.mark.parametrize("k", [1, 2])
def test_step_prepared_once_for_all_layers_equals_per_layer_decode(k):
    """The engine's path (one DecodeBatch per step, flushes of every layer at
    once before the writes) leaves every pool exactly as per-layer appends
    (flush after the write) and attends to the same values."""
    g, r = 16, 32
    a, b = make_store(4, g, r, slots=8, layers=3, k=k), make_store(4, g, r, slots=8, layers=3, k=k)
    lens = [1, r + k * g - 3, r + k * g - 1, 100, 2 * k * g + r - 1]
    seqs_a, seqs_b = [a.blocks.allocate() for _ in lens], [b.blocks.allocate() for _ in lens]
    for layer in range(3):
        for sa, sb, n in zip(seqs_a, seqs_b, lens):
            x = mx.random.normal((H_KV, n, D))
            a.append(layer, sa, x, -x)
            b.append(layer, sb, x, -x)
    for step in range(k * g + 3):  # every sequence flushes at least once
        batch = a.begin_decode(seqs_a)
        flushing = sum(1 for s in seqs_b if s.tail_lens[0] == r + k * g - 1)
        assert a.blocks.free_blocks == b.blocks.free_blocks - k * flushing
        for layer in range(3):
            new = mx.random.normal((len(lens), H_KV, D))
            q = mx.random.normal((len(lens), 4, D))
            # a: the model's [B, H, 1, D] layout, as the engine passes it; b: [B, H, D].
            a.write_decode(layer, batch, new[:, :, None], -new[:, :, None])
            append_decode(b, layer, seqs_b, new, -new)
            out = attend_decode(a, layer, batch, q[:, :, None], 0.1)
            assert out.shape == (len(lens), 4, 1, D)
            np.testing.assert_array_equal(np.array(out[:, :, 0]),
                                          np.array(decode_attend(b, layer, seqs_b, q, 0.1)))
        assert len(batch.plans) == 1  # one attention launch plan, shared by the 3 layers
        mx.eval([a.pools, b.pools])
        for sa, sb in zip(seqs_a, seqs_b):
            assert (sa.tail_lens, sa.blocks_used, sa.block_ids) == (sb.tail_lens, sb.blocks_used, sb.block_ids)
        for pa, pb in zip(a.pools, b.pools):
            for x, y in zip(pa, pb):
                np.testing.assert_array_equal(np.array(x), np.array(y))
    k = mx.random.normal((1, H_KV, D))
    append_decode(a, 0, seqs_a[:1], k, k)  # layer 0 now holds one token more
    with pytest.raises(RuntimeError, match="same tokens"):
        a.begin_decode(seqs_a)


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_cache_decode_attention_matches_dense_attention_on_stored_kv(bits):
    """The merge of quantized blocks and tail is exact: attention through the
    cache equals plain softmax attention over the dequantized K/V."""
    g, r, h_q = 16, 32, 6
    store = make_store(bits, g, r)
    lens = [5, 47, 130]
    seqs = [store.blocks.allocate() for _ in lens]
    for s, n in zip(seqs, lens):
        x = mx.random.normal((H_KV, n, D))
        store.append(0, s, x, mx.random.normal((H_KV, n, D)))
    cache = KiviLayerCache(store, 0, seqs)
    q = mx.random.normal((len(lens), h_q, 1, D))
    k, v = mx.random.normal((len(lens), H_KV, 1, D)), mx.random.normal((len(lens), H_KV, 1, D))
    cache.update_and_fetch(k, v)
    out = cache.attend(q, k, v, scale=D**-0.5)
    for i, s in enumerate(seqs):
        pk, pv = store.dense_past(0, s)
        want = decode_attention_dense(q[i, :, 0], pk, pv, D**-0.5)
        np.testing.assert_allclose(np.array(out[i, :, 0]), np.array(want), rtol=1e-4, atol=1e-5)


def test_prefill_attention_is_full_precision_over_fresh_tokens():
    """A first prefill chunk attends to itself exactly as fp SDPA does."""
    store = make_store(4, 16, 32)
    seq = store.blocks.allocate()
    cache = KiviLayerCache(store, 0, [seq])
    q = mx.random.normal((1, 4, 100, D))
    k, v = mx.random.normal((1, H_KV, 100, D)), mx.random.normal((1, H_KV, 100, D))
    cache.update_and_fetch(k, v)
    out = cache.attend(q, k, v, scale=D**-0.5)
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=D**-0.5, mask="causal")
    np.testing.assert_allclose(np.array(out), np.array(want), rtol=1e-5, atol=1e-5)
    assert seq.blocks_used[0] == (100 - 32) // 16  # quantized afterwards


def test_second_prefill_chunk_sees_quantized_past_with_causal_offset():
    store = make_store(8, 16, 32)
    seq = store.blocks.allocate()
    cache = KiviLayerCache(store, 0, [seq])
    k1, v1 = mx.random.normal((1, H_KV, 70, D)), mx.random.normal((1, H_KV, 70, D))
    cache.update_and_fetch(k1, v1)
    cache.attend(mx.random.normal((1, 4, 70, D)), k1, v1, scale=0.1)
    past_k, past_v = store.dense_past(0, seq)
    q2 = mx.random.normal((1, 4, 9, D))
    k2, v2 = mx.random.normal((1, H_KV, 9, D)), mx.random.normal((1, H_KV, 9, D))
    cache.update_and_fetch(k2, v2)
    out = cache.attend(q2, k2, v2, scale=0.1)
    kk = mx.concatenate([past_k, k2[0]], axis=1)[None]
    vv = mx.concatenate([past_v, v2[0]], axis=1)[None]
    # Explicit mask: query i (absolute position 70 + i) sees keys 0 .. 70 + i.
    mask = mx.arange(79)[None, :] <= (70 + mx.arange(9))[:, None]
    want = mx.fast.scaled_dot_product_attention(q2, kk, vv, scale=0.1, mask=mask)
    np.testing.assert_allclose(np.array(out), np.array(want), rtol=1e-5, atol=1e-5)


def test_release_returns_blocks_and_slot():
    store = make_store(4, 16, 32, blocks=8, slots=2)
    seq = store.blocks.allocate()
    x = mx.random.normal((H_KV, 32 + 16 * 5, D))
    store.append(0, seq, x, x)
    assert store.blocks.free_blocks == 8 - 5 and store.blocks.free_slots == 1 and store.blocks.used_bytes() > 0
    store.blocks.free(seq)
    assert store.blocks.free_blocks == 8 and store.blocks.free_slots == 2 and store.blocks.used_bytes() == 0


def test_pool_full_raises_clear_error():
    store = make_store(4, 16, 32, blocks=2, slots=1)
    seq = store.blocks.allocate()
    with pytest.raises(OutOfKVMemory, match="full"):
        x = mx.random.normal((H_KV, 32 + 16 * 3, D))
        store.append(0, seq, x, x)


def _update_cost(slots: int) -> tuple[float, int]:
    """Median seconds and peak extra bytes of one decode-token write."""
    store = KiviStore(1, 8, 128, config=KVConfig(4, 32, 128), num_blocks=8, num_slots=slots, dtype=mx.float16)
    seq = store.blocks.allocate()
    x = mx.random.normal((8, 40, 128)).astype(mx.float16)
    store.append(0, seq, x, x)
    mx.eval(store.pools[0])
    times, peaks = [], []
    for i in range(12):
        k = mx.random.normal((1, 8, 128)).astype(mx.float16)
        mx.eval(k)
        mx.reset_peak_memory()
        base = mx.get_active_memory()
        t0 = time.perf_counter()
        append_decode(store, 0, [seq], k, k)
        mx.eval(store.pools[0].tail_k, store.pools[0].tail_v)
        times.append(time.perf_counter() - t0)
        peaks.append(mx.get_peak_memory() - base)
    return float(np.median(times)), int(max(peaks))


def test_token_write_does_not_copy_the_pool():
    """One token's write costs the same in a 32x larger pool: it updates the
    tail arrays in place (a copy would scale with the pool: 40 MiB here)."""
    small_t, small_mem = _update_cost(slots=2)
    large_t, large_mem = _update_cost(slots=64)  # tails: 2 x 64 x 8 x 160 x 128 x 2 B = 40 MiB
    assert large_mem < 1 << 20, f"a token write allocated {large_mem} bytes"
    assert large_t < 8 * small_t + 1e-3, (small_t, large_t)


@pytest.mark.parametrize("k", [1, 2])
def test_a_step_flushes_in_its_graph_once_the_kernel_writes_the_tails(monkeypatch, k):
    """Where the last step's attention kernel wrote the tails and an in-place flush kernel
    exists (CUDA), begin_decode runs no flush: the step carries it (DecodeBatch.flush:
    the flushing slots, then -1 to the batch's size; their new blocks; the kernel's
    params) and its first attention plan makes it (dispatch.step_flush, once a step) and
    follows it (after=). The bookkeeping and the step's metadata are those of the flush
    run before the step, which the reference path (and any first step) still does."""
    import kiviq.engine.kv_store as kv_store_module

    g, r = 16, 32
    flushes, made, afters = [], [], []
    real_flush = kv_store_module.flush_layers

    def flush(pools, slots, ids, *a, **kw):
        flushes.append((list(slots), list(ids)))
        real_flush(pools, slots, ids, *a, **kw)

    def step_flush(pools, slots, ids, params, **kw):
        made.append((np.array(slots).tolist(), np.array(ids).tolist(), np.array(params).tolist(), len(pools)))
        return [mx.zeros((1,), dtype=mx.int32)]

    def attend_plan(*a, after=(), **kw):
        afters.append(len(after))
        return kv_store_module.attend_plan.__wrapped__(*a, **kw)

    attend_plan.__wrapped__ = kv_store_module.attend_plan
    monkeypatch.setattr(kv_store_module, "flush_layers", flush)
    monkeypatch.setattr(kv_store_module, "step_flush", step_flush)
    monkeypatch.setattr(kv_store_module, "attend_plan", attend_plan)

    def prepared(in_graph: bool):
        store = make_store(4, g, r, slots=4, layers=2, k=k)
        store.blocks.allocate()  # slot 0 unused: the flushing slots are not 0, 1
        seqs = [store.blocks.allocate() for _ in range(3)]
        for layer in range(2):
            for s, n in zip(seqs, (r + k * g - 1, 20, r + k * g - 1)):  # the 1st and 3rd flush
                store.append(layer, s, mx.ones((H_KV, n, D)), mx.ones((H_KV, n, D)))
        if in_graph:
            store._kernel_writes_tails, store._step_flush_params = True, (r + k * g, H_KV, k)
        return store, seqs, store.begin_decode(seqs)

    eager, eager_seqs, before = prepared(in_graph=False)
    assert before.flush is None and len(flushes) == 1
    store, seqs, batch = prepared(in_graph=True)
    assert len(flushes) == 1  # none this time
    slots, ids = flushes[0]
    assert slots == [seqs[0].slot, seqs[2].slot] and len(ids) == 2 * k
    fs, fi, fp = (np.array(a).tolist() for a in batch.flush)
    assert fs == slots + [-1] and fi == ids + [-1] * k and fp == [r + k * g, H_KV, k, 3]
    for name in ("slots", "block_tables", "num_blocks", "tail_lens", "offsets"):
        assert np.array_equal(np.array(getattr(batch, name)), np.array(getattr(before, name))), name
    assert [(s.tail_lens, s.blocks_used) for s in seqs] == [(s.tail_lens, s.blocks_used) for s in eager_seqs]

    new = mx.zeros((3, H_KV, 1, D))
    for layer in range(2):
        store.write_and_attend(layer, batch, mx.zeros((3, 4, 1, D)), new, new, 0.1)
    assert made == [(fs, fi, fp, 2)] and afters == [1]  # made once, with the step's first plan


def test_only_the_cuda_kernels_flush_inside_a_step_or_follow_that_flush():
    """Off CUDA a step's flush runs before the step: the in-graph flush is refused, and
    so is an attention plan asked to follow one (it could not order its reads)."""
    from kiviq.kernels import dispatch

    store = make_store(4, 16, 32, slots=2, layers=1)
    pool = store.pools[0]
    assert dispatch.step_flush_params(pool, 1) is None and store._step_flush_params is None
    ints = mx.zeros((2,), dtype=mx.int32)
    with pytest.raises(ValueError, match="CUDA"):
        dispatch.step_flush([pool], ints, ints, ints, bits=4, group_size=16)
    with pytest.raises(ValueError, match="after="):
        dispatch.attend_plan((2, 4, D), mx.float32, pool, ints[:, None], ints, ints, ints + 1, scale=0.1, bits=4,
                             group_size=16, after=[ints])


def test_block_manager_is_pure_python_and_owns_blocks_slots_and_tables():
    import ast
    from pathlib import Path

    import kiviq.engine.block_manager as bm

    tree = ast.parse(Path(bm.__file__).read_text())
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert not any(m.startswith("mlx") for m in imported), imported

    blocks = bm.BlockManager(4, 2, num_layers=3, group_size=16, residual=32, block_bytes=10, slot_bytes=100)
    assert blocks.can_allocate(32 + 16 * 4) and not blocks.can_allocate(32 + 16 * 5)
    a, b = blocks.allocate(), blocks.allocate()
    assert not blocks.can_allocate(1)  # no slot left
    with pytest.raises(OutOfKVMemory, match="slot"):
        blocks.allocate()
    assert [blocks.block(a, 0), blocks.block(a, 1), blocks.block(b, 0)] == a.block_ids[:2] + b.block_ids
    assert blocks.block(a, 0) == a.block_ids[0]  # the second layer to reach it gets the same block
    np.testing.assert_array_equal(blocks.block_tables([b, a], [1, 2]), [[b.block_ids[0], 0], a.block_ids])
    assert blocks.block_tables([a], [1], width_multiple=4).shape == (1, 4)
    assert blocks.used_bytes() == 3 * 10 + 2 * 100 and blocks.budget_bytes() == 4 * 10 + 2 * 100
    blocks.free(a)
    blocks.free(a)  # idempotent
    assert (blocks.free_blocks, blocks.free_slots, a.slot) == (3, 1, -1)
    assert blocks.used_bytes() == 10 + 100


def stub_model(dtype=mx.float32):
    """What the store's sizing reads of an mlx-lm model: two layers of H_KV heads of
    D channels, and one parameter in ``dtype``. No weights."""
    from types import SimpleNamespace

    return SimpleNamespace(args=SimpleNamespace(num_attention_heads=4, num_key_value_heads=H_KV, head_dim=D,
                                                hidden_size=4 * D), layers=[None, None],
                           parameters=lambda: {"w": mx.zeros((1,), dtype=dtype)})


def test_blocks_for_budget_is_what_make_store_allocates():
    """The sizing rule (bytes left after the tails, capped by what max_sequences
    full-context sequences need) decides the real store's block count."""
    from kiviq.engine.block_manager import blocks_for_budget
    from kiviq.engine.kivi_cache import make_store

    config = KVConfig(4, 16, 32)
    probe = KiviStore(2, H_KV, D, config=config, num_blocks=1, num_slots=1, dtype=mx.float32)
    sizes = dict(block_bytes=probe.blocks.block_bytes, slot_bytes=probe.blocks.slot_bytes, group_size=16)
    model = stub_model()
    budget = 3 * sizes["slot_bytes"] + 50 * sizes["block_bytes"] + 7
    store = make_store(model, config, kv_memory=budget, max_sequences=3, dtype=mx.float32)
    assert store.blocks.num_blocks == blocks_for_budget(budget, max_sequences=3, **sizes) == 50
    assert store.blocks.budget_bytes() <= budget
    capped = make_store(model, config, kv_memory=budget, max_sequences=3, context=100, dtype=mx.float32)
    assert capped.blocks.num_blocks == blocks_for_budget(budget, max_sequences=3, context=100, **sizes) == 3 * 7
    with pytest.raises(ValueError, match="kv_memory"):
        make_store(model, config, kv_memory=sizes["slot_bytes"], max_sequences=3, dtype=mx.float32)


def test_default_max_sequences_is_what_the_kv_budget_holds_on_a_gpu():
    """--max-active's default: on a GPU the 4k-token sequences (a tail slot and their
    blocks) the KV budget holds, within 32-128; on a CPU 32."""
    from kiviq.engine.config import EngineConfig
    from kiviq.engine.kivi_cache import store_sizes
    from kiviq.engine.setup import GPU_SEQUENCES, SEQUENCE_TOKENS, default_max_sequences

    model = stub_model(mx.bfloat16)
    config = EngineConfig(kv_group_size=16, kv_residual=32)
    sizes = store_sizes(model, config.kv)
    per_sequence = sizes.slot_bytes + SEQUENCE_TOKENS // 16 * sizes.block_bytes

    def pick(budget, on_gpu=True):
        return default_max_sequences(model, EngineConfig(kv_group_size=16, kv_residual=32, kv_memory=budget),
                                     on_gpu=on_gpu)

    assert pick(50 * per_sequence + per_sequence - 1) == 50
    assert pick(10 * per_sequence) == GPU_SEQUENCES[0] == 32  # a small budget keeps 32
    assert pick(1000 * per_sequence) == GPU_SEQUENCES[1] == 128
    assert pick(1000 * per_sequence, on_gpu=False) == 32


def test_in_place_block_writes_run_with_the_step_before_any_read_and_die_with_a_failed_forward(monkeypatch):
    """Where `dispatch.write_blocks` writes in place (CUDA), its `done` arrays wait in
    the store: `pending()` hands them to the step's evaluation once; a read of a layer's
    blocks runs that layer's unrun writes first (a later chunk's `dense_past`: only its
    own layer, no sync for the others), a decode step all of them; a forward that fails
    while being built drops them. A later chunk's reads of the pool are then not
    evaluated before its writes (no sync per layer). Simulated on CPU: the reference
    writes, plus a marker."""
    import kiviq.engine.kv_store as kv_store_module

    real_write, real_eval = kv_store_module.write_blocks, mx.eval
    dones, evaluated = [], set()

    def in_place(*a, **kw):
        real_write(*a, **kw)
        dones.append(mx.zeros((1,), dtype=mx.int32))
        return dones[-1]

    def eval_(*arrays):
        stack = list(arrays)
        while stack:
            a = stack.pop()
            if isinstance(a, (list, tuple)):
                stack += list(a)
            elif isinstance(a, mx.array):
                evaluated.add(id(a))
        real_eval(*arrays)

    monkeypatch.setattr(kv_store_module, "write_blocks", in_place)
    monkeypatch.setattr(mx, "eval", eval_)
    g, r = 16, 32
    store = make_store(4, g, r, layers=2)
    store._blocks_in_place = True  # as blocks_written_in_place says on CUDA
    seq = store.blocks.allocate()
    chunk = mx.random.normal((H_KV, r + 2 * g, D))
    read = mx.random.normal((2,)) * 2  # stands for a later chunk's attention output
    for layer in range(2):
        store.append(layer, seq, chunk, chunk, reads=(read,))
    assert len(dones) == 2 and not evaluated & {id(d) for d in dones} and id(read) not in evaluated
    store.dense_past(1, seq)  # layer 1's blocks are read: its write runs, layer 0's waits
    assert id(dones[1]) in evaluated and id(dones[0]) not in evaluated
    store.begin_decode([seq])  # a decode step reads every layer
    assert id(dones[0]) in evaluated and store.pending()[1] == []

    other = store.blocks.allocate()
    batch = store.begin_prefill([other], [r + g], [0])
    for layer in range(2):
        x = mx.random.normal((1, H_KV, r + g, D))
        store.write_prefill(layer, batch, x, x)
    pools, writes = store.pending()
    assert pools is store.pools and [id(w) for w in writes] == [id(d) for d in dones[2:]]
    assert store.pending()[1] == []  # handed over once

    with pytest.raises(RuntimeError), store.forward_writes():
        store.append(0, seq, chunk, chunk)
        raise RuntimeError("the forward failed while being built")
    assert store.pending()[1] == [] and len(dones) == 5

    store._blocks_in_place = False  # scatters (CPU, Metal): a later chunk's reads finish first
    read = mx.random.normal((2,)) * 2
    store.append(1, seq, chunk[:, :1], chunk[:, :1], reads=(read,))
    assert id(read) in evaluated
