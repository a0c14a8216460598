"""Batched first-chunk prefill: the first chunks of new sequences packed into one
forward (a row per token, no padding between them), attending in right-padded
groups, their keys and values written into the store by prepared indices
(KiviStore.begin_prefill / write_prefill), logits only after each last token."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from kiviq.engine import Request, SamplingParams
from kiviq.engine.kivi_cache import causal_attention, pack_first_chunks_layout, packed_length
from kiviq.engine.kv_store import KiviStore, KVConfig
from kiviq.engine.model_runner import vocabulary_projection
from kiviq.engine.scheduler import pack_first_chunks
from engine_runs import run_engine
from test_batch_engine import make_engine, prompts

H_KV, D = 2, 64


def _store(bits, g=16, r=32, k=1, layers=2):
    return KiviStore(layers, H_KV, D, config=KVConfig(bits, g, r, k), num_blocks=96, num_slots=6, dtype=mx.float16)


@pytest.mark.parametrize("bits,k", [(4, 1), (2, 2), (8, 1)])
@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_batched_prefill_writes_what_appending_each_sequence_writes(bits, k, packed):
    """Rows of lengths below, at and past the flush thresholds, padded to one width
    or packed one after another in one row: every pool array equals the
    one-sequence-at-a-time path, bit for bit, and the bookkeeping too."""
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
    if packed:  # [1, H_kv, sum(lengths), D]: chunk i from starts[i] on
        starts = [sum(lengths[:i]) for i in range(len(lengths))]
        k_in = mx.concatenate([k_all[i, :, :n] for i, n in enumerate(lengths)], axis=1)[None]
        v_in = mx.concatenate([v_all[i, :, :n] for i, n in enumerate(lengths)], axis=1)[None]
    else:
        starts, k_in, v_in = [i * width for i in range(len(lengths))], k_all, v_all
    batch = batched.begin_prefill(seqs_b, lengths, starts)
    for layer in range(batched.num_layers):
        batched.write_prefill(layer, batch, k_in + layer, v_in - layer)
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
        store.begin_prefill([seq], [4], [0])


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


def test_packed_layout_places_each_chunk_and_its_attention_rows():
    """Chunks in group order, one after another; RoPE positions restart per chunk;
    each group's attention rows gather its chunks right-padded (a padding slot
    repeats the row's first token), and every real row finds its output back."""
    layout = pack_first_chunks_layout([3, 5, 2], [[1, 0], [2]], multiple=4, pow2_rows=True)
    assert layout.starts == [5, 0, 8]
    assert layout.tokens == 12  # 10 rounded up to 4
    assert layout.positions.tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 0, 1, 0, 0]
    g0, g1 = layout.groups
    assert (g0.rows, g0.width, g0.attention_rows) == (2, 8, 2)
    assert g0.index.tolist() == [0, 1, 2, 3, 4, 0, 0, 0, 5, 6, 7, 5, 5, 5, 5, 5]
    assert (g1.rows, g1.width, g1.attention_rows, g1.index.tolist()) == (1, 4, 1, [8, 9, 8, 8])
    back = layout.back.tolist()
    assert back[:10] == [0, 1, 2, 3, 4, 8, 9, 10, 16, 17]  # row 5 is chunk 0's first: group 0, row 1
    three = pack_first_chunks_layout([1, 1, 1], [[0, 1, 2]], pow2_rows=True).groups[0]
    assert (three.rows, three.attention_rows) == (3, 4)


@pytest.mark.parametrize("n,multiple,rows", [(10, 1, 10), (5, 64, 64), (1000, 64, 1024), (1025, 64, 1088),
                                             (16000, 64, 16384), (16385, 64, 17408)])
def test_a_packed_forward_is_padded_to_few_lengths(n, multiple, rows):
    assert packed_length(n, multiple) == rows
    assert rows - n <= max(multiple - 1, n // 16)


def test_packed_lengths_come_from_a_small_set():
    """Where a GPU pads (multiple 64), the forwards of 1..16,384 tokens take 128 lengths at most."""
    lengths = {packed_length(n, 64) for n in range(1, 16385)}
    assert len(lengths) <= 128 and all(x % 64 == 0 for x in lengths)


def test_prefill_with_the_gpus_padding_gives_the_same_tokens(smollm2):
    """The GPU's padding (packed forward to a few lengths, attention groups to
    multiples of 64 wide and a power of two of rows), forced on the CPU, changes
    no greedy token: padding is never attended by a real token (the logprobs move
    by rounding only: the matmuls run on more rows)."""
    model, tok = smollm2
    ps = prompts(tok, 5)

    def run(pad):
        engine = make_engine(model, tok, max_batch_tokens=4096, pipeline=False)
        if pad:  # the scheduler's cut is left alone: the prompts fit one step
            engine.runner.prefill_width_multiple, engine.runner.prefill_chunk_multiple = 64, 256
        for i, p in enumerate(ps):
            engine.add(Request(f"r{i}", p, 6, SamplingParams(logprobs=2)))
        out = {}
        while engine.has_work():
            for ev in engine.step():
                out.setdefault(ev.request_id, []).append((ev.token_ids, [lp.logprob for lp in ev.logprobs or []]))
        return out

    assert_same_tokens(run(True), run(False))


def test_batched_prefill_equals_one_by_one(smollm2):
    """Greedy tokens of prompts prefilled in one forward (with flushes inside the
    prompts) equal those of each prompt prefilled alone, and their logprobs up to
    rounding (the matmuls run on other row counts)."""
    model, tok = smollm2
    ps = prompts(tok, 5)

    def run(reqs):
        engine = make_engine(model, tok, max_batch_tokens=4096, pipeline=False)
        for r in reqs:
            engine.add(r)
        out = {}
        while engine.has_work():
            for ev in engine.step():
                out.setdefault(ev.request_id, []).append((ev.token_ids, [lp.logprob for lp in ev.logprobs or []]))
        return out

    def reqs():
        return [Request(f"r{i}", p, 6, SamplingParams(logprobs=2)) for i, p in enumerate(ps)]

    together = run(reqs())
    alone = {}
    for r in reqs():
        alone.update(run([r]))
    assert_same_tokens(together, alone)


def assert_same_tokens(a: dict, b: dict, atol: float = 1e-3) -> None:
    """Runs' events per request, as (token ids, logprobs) pairs: the same tokens,
    the same logprobs within ``atol``."""
    assert {r: [t for t, _ in evs] for r, evs in a.items()} == {r: [t for t, _ in evs] for r, evs in b.items()}
    for r, evs in a.items():
        for (_, x), (_, y) in zip(evs, b[r]):
            assert np.allclose(x, y, atol=atol), (r, x, y)


def test_a_failing_row_of_a_batched_prefill_fails_alone(smollm2, monkeypatch):
    model, tok = smollm2
    engine = make_engine(model, tok, pipeline=False)
    ps = prompts(tok, 3)
    for i, p in enumerate(ps):
        engine.add(Request(f"r{i}", p, 3))
    real = engine.runner.prefill_first

    def prefill_first(seqs, chunks, groups=None):  # r1's prompt breaks any forward it is in
        if any(len(c) == len(ps[1]) and c == ps[1] for c in chunks):
            raise RuntimeError("poison")
        return real(seqs, chunks, groups)

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


@pytest.mark.parametrize("rows,multiple", [(4, 1), (None, 8), (4, 8)], ids=["rows", "length", "both"])
def test_causal_attention_on_padded_shapes_equals_unpadded(rows, multiple):
    """Prefill attention on a bucketed shape (rows padded to a power of two, a later
    chunk's L and S extended to a multiple) gives the unpadded result: padded rows
    are batch entries of their own, appended keys lie past every real diagonal."""
    rng = np.random.default_rng(multiple)
    b, length, past = 3, 5, 8
    q = mx.array(rng.standard_normal((b, 4, length, D)).astype(np.float32))
    k = mx.array(rng.standard_normal((b, H_KV, past + length, D)).astype(np.float32))
    v = mx.array(rng.standard_normal((b, H_KV, past + length, D)).astype(np.float32))
    plain = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask="causal")
    padded = causal_attention(q, k, v, 0.125, rows=rows, multiple=multiple)
    assert padded.shape == plain.shape
    assert mx.allclose(padded, plain, atol=1e-5).item()


def test_bucketed_prefill_shapes_change_no_token(smollm2):
    """With a GPU's prefill padding (set by hand on the CPU: widths of 64, attention
    rows to a power of two, later chunks' attention padded to a multiple of their
    cut, here 32) greedy tokens equal those of the same chunks unpadded, and every
    split prompt is cut at the multiple. (Where a prompt is cut changes what its
    later chunks attend to, a quantized past, so both runs cut at 32.)"""
    model, tok = smollm2
    ps = prompts(tok, 5)

    def run(padded):
        engine = make_engine(model, tok, max_batch_tokens=80, pipeline=False)  # prompts of 38-98 tokens
        engine.scheduler.chunk_multiple = 32
        pasts = []
        if padded:
            engine.runner.prefill_width_multiple = 64
            engine.runner.prefill_chunk_multiple = 32
        prefill = engine.runner.prefill

        def logged(seq, tokens):  # a later chunk: its past is what came before
            pasts.append(seq.blocks_used[0] * 16 + seq.tail_lens[0])
            return prefill(seq, tokens)

        engine.runner.prefill = logged
        return run_engine(engine, [Request(f"r{i}", p, 6) for i, p in enumerate(ps)]), pasts

    plain, plain_pasts = run(False)
    padded, pasts = run(True)
    assert padded == plain and pasts == plain_pasts
    assert len(pasts) >= 3 and all(p % 32 == 0 for p in pasts)


def test_importing_kiviq_turns_mlx_cache_thrashing_errors_off():
    """MLX's CUDA caches raise once a process has missed twice their capacity
    (tests/test_engine_gpu.py shows it): kiviq turns that check off, before any of
    its modules imports mlx, unless the user chose."""
    code = "import os, sys, kiviq; print(os.environ['MLX_ENABLE_CACHE_THRASHING_CHECK'], 'mlx' in sys.modules)"
    env = {k: v for k, v in os.environ.items() if k != "MLX_ENABLE_CACHE_THRASHING_CHECK"}
    for given, seen in ((None, "0 False"), ("1", "1 False")):
        if given is not None:
            env["MLX_ENABLE_CACHE_THRASHING_CHECK"] = given
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        assert out.stdout.strip() == seen


def test_attention_shapes_benchmark_times_each_shape():
    """benchmarks/attention_shapes.py (what a new attention shape costs on a GPU) runs
    anywhere: one row per shape, and a chunk longer than its keys is refused."""
    bench = str(Path(__file__).resolve().parents[1] / "benchmarks" / "attention_shapes.py")
    small = ["--heads", "4", "--kv-heads", "2", "--head-dim", "32", "--dtype", "float32"]
    out = subprocess.run([sys.executable, bench, "--shapes", "2:24", "1:8:40", *small],
                         capture_output=True, text=True, check=True).stdout
    table = out.split("\n\n")[-1]
    assert "| 2:24 |" in table and "| 1:8:40 |" in table
    assert out.count("| 2:24 |") == 1 and out.count("first call ms") == 1  # one table; progress on stderr
    bad = subprocess.run([sys.executable, bench, "--shapes", "1:50:20", *small], capture_output=True, text=True)
    assert bad.returncode != 0 and "at least its own 50 keys" in bad.stderr


def test_a_prefill_step_holds_about_what_the_bare_model_holds():
    """A packed prefill step's memory peak stays near the bare model's over the same
    tokens: each layer's writes into the store run as the layer is built, and the
    forward is paced (engine.layer_pacer), so no layer's keys and values wait for
    the end of the forward. (Left for the end, they made a SmolLM2 prefill step
    peak at 2.5x the bare model on the CPU, and a Qwen3-4B-shape step of 16k tokens
    at 22.3 GiB instead of 6.8 on an H100.)"""
    from engine_runs import IdTokenizer, tiny_model
    from test_batch_engine import make_engine

    # Enough layers that keys and values held to the end would outweigh one layer's work.
    model = tiny_model(hidden_size=256, num_hidden_layers=12, intermediate_size=512, head_dim=64)
    model.set_dtype(mx.float32)
    mx.eval(model.parameters())
    rng = np.random.default_rng(0)
    rows, width = 4, 128

    def peak(run) -> int:
        mx.synchronize()
        held = mx.get_active_memory()
        mx.reset_peak_memory()
        run()
        mx.synchronize()
        return mx.get_peak_memory() - held

    def bare():
        mx.eval(model.model(mx.array(rng.integers(1, 512, (rows, width))))[:, -1])

    engine = make_engine(model, IdTokenizer(), max_batch_tokens=rows * width)

    def step(tag):
        for i in range(rows):
            engine.add(Request(f"{tag}{i}", rng.integers(1, 512, width).tolist(), max_tokens=1))
        steps = 0
        while engine.has_work():
            engine.step()
            steps += 1
        assert steps == 1  # one packed forward of all rows

    step("warm")
    bare_peak = min(peak(bare) for _ in range(2))
    step_peak = peak(lambda: step("measured"))
    assert step_peak <= 1.3 * bare_peak, (step_peak, bare_peak)


def test_the_pacer_waits_for_the_layer_ahead_layers_back(monkeypatch):
    """Each layer's output is launched when the layer is built; building waits for
    the output ``ahead`` layers back, so at most ahead + 1 layers are queued."""
    import kiviq.engine.layer_pacer as layer_pacer

    calls = []

    class RecordingMX:
        @staticmethod
        def async_eval(x):
            calls.append(("launch", x))

        @staticmethod
        def eval(x):
            calls.append(("wait", x))

    monkeypatch.setattr(layer_pacer, "mx", RecordingMX)
    pacer = layer_pacer.LayerPacer(ahead=2)
    outs = [object() for _ in range(5)]
    assert [pacer(o) for o in outs] == outs
    assert calls == [("launch", outs[0]), ("launch", outs[1]), ("launch", outs[2]), ("wait", outs[0]),
                     ("launch", outs[3]), ("wait", outs[1]), ("launch", outs[4]), ("wait", outs[2])]
