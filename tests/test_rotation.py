"""KIVI 2r (``--kv-bits 2r``): the store in the Hadamard basis (CPU, reference attention).

The store holds K H and V H (KVConfig.rotate); ``KiviLayerCache.attend`` rotates q,
k and v on entry and the output on exit, so attention is unchanged in exact
arithmetic and only the quantization error differs. Checked here: the rotation op
is the explicit matrix and its own inverse; every attend path of a rotated store
equals an explicit "dequantize what the pools hold, rotate back, attend in float64"
reference; the rotation shrinks 2-bit error on data with an outlier channel; the
4-bit path never rotates; config and CLI; the engine at 2r on the real SmolLM2
(batch == single, compiled == plain, nothing quantized == the unrotated store);
the store agrees with the simulation (benchmarks/kv_quant_sim.py); factual chat
answers the fp16 cache gets right stay right at 2r.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from engine_runs import run_engine
from kiviq.engine.config import EngineConfig, KVConfig, parse_kv_bits
from kiviq.engine.kivi_cache import KiviLayerCache
from kiviq.engine.kv_store import KiviStore
from kiviq.kernels.rotation import check_rotation, hadamard, hadamard_rotate

H_KV, H_Q, D = 2, 4, 64
U = {mx.float16: 2.0**-11, mx.bfloat16: 2.0**-8, mx.float32: 2.0**-24}


def make_store(bits=2, rotate=True, g=16, r=32, d=D, dtype=mx.float32) -> KiviStore:
    return KiviStore(1, H_KV, d, config=KVConfig(bits, g, r, rotate=rotate), num_blocks=64, num_slots=4,
                     dtype=dtype)


def kv_data(rng, n, d=D, outlier=True):
    """k, v [1, H_KV, n, D] float32; channel 5 of the keys 20x larger (an outlier, as real keys have)."""
    k = rng.standard_normal((1, H_KV, n, d)).astype(np.float32)
    v = rng.standard_normal((1, H_KV, n, d)).astype(np.float32)
    if outlier:
        k[..., 5] *= 20
        v[..., 9] *= 8
    return mx.array(k), mx.array(v)


# ---- the rotation op ------------------------------------------------------------------

@pytest.mark.parametrize("n", [2, 16, 64, 128, 256])
def test_hadamard_rotate_is_the_explicit_matrix_and_its_own_inverse(n):
    x = np.random.default_rng(n).standard_normal((2, 3, 5, n))
    h = np.array(hadamard(n), dtype=np.float64)
    np.testing.assert_allclose(h, h.T)  # symmetric: H = H.T = H^-1
    y = hadamard_rotate(mx.array(x.astype(np.float32)))
    assert y.dtype == mx.float32 and y.shape == x.shape
    np.testing.assert_allclose(np.array(y), x @ h, atol=2e-6 * np.sqrt(n))  # the same matrix, scale included
    np.testing.assert_allclose(np.array(hadamard_rotate(y)), x, atol=4e-6 * np.sqrt(n))


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
def test_hadamard_rotate_keeps_the_dtype_within_a_few_roundings(dtype):
    """In fp16/bf16 the op stays in the activation dtype. Error per element over the
    row's RMS against float64: the CPU backend adds in x's dtype stage by stage
    (log2 D roundings; measured max ~10 u), GPU kernels in float32."""
    x = mx.array(np.random.default_rng(1).standard_normal((64, 128)).astype(np.float32)).astype(dtype)
    xr = np.array(x.astype(mx.float32), dtype=np.float64)
    ref = xr @ np.array(hadamard(128), dtype=np.float64)
    y = hadamard_rotate(x)
    assert y.dtype == dtype
    err = np.abs(np.array(y.astype(mx.float32)) - ref) / np.sqrt((ref**2).mean(-1, keepdims=True))
    assert err.max() < 16 * U[dtype] and err.mean() < 2 * U[dtype], (err.max() / U[dtype], err.mean() / U[dtype])


@pytest.mark.parametrize("d", [0, 12, 48, 96, 160])
def test_rotation_needs_a_power_of_two_head_dim(d):
    with pytest.raises(ValueError, match="power-of-two head_dim"):
        check_rotation(d)
    if d % 16 == 0 and d:
        with pytest.raises(ValueError, match="power-of-two head_dim"):
            make_store(d=d)


# ---- every attend path against an explicit reference -------------------------------

def unrotated_past(store: KiviStore, seq) -> tuple[np.ndarray, np.ndarray]:
    """What the rotated pools hold for seq, dequantized (``dense_past``: blocks, then
    the tail) and rotated back by the explicit matrix, float64 [H_kv, S, D]."""
    h = np.array(hadamard(D), dtype=np.float64)
    k, v = store.dense_past(0, seq)
    return np.array(k, dtype=np.float64) @ h, np.array(v, dtype=np.float64) @ h


def dense_reference(q: mx.array, k: np.ndarray, v: np.ndarray, scale: float) -> np.ndarray:
    """Causal float64 attention of q [1, H_q, L, D] (the newest L tokens) over k, v
    [H_kv, S, D] in the model's basis; returns [1, H_q, L, D]."""
    qq = np.array(q[0], dtype=np.float64)
    rep, n, length = H_Q // H_KV, k.shape[1], qq.shape[1]
    s = np.einsum("hld,hsd->hls", qq, np.repeat(k, rep, axis=0)) * scale
    s = np.where(np.arange(n)[None, :] <= (n - length + np.arange(length))[:, None], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    return np.einsum("hls,hsd->hld", p / p.sum(-1, keepdims=True), np.repeat(v, rep, axis=0))[None]


def attend(cache: KiviLayerCache, q, k, v, scale):
    cache.update_and_fetch(k, v)
    return cache.attend(q, k, v, scale)


@pytest.mark.parametrize("bits", [2, 4])
def test_rotated_attention_equals_dequantize_then_unrotate(bits):
    """First prefill chunk, a continuation chunk over a quantized past, then decode
    steps across flushes: each output equals the explicit reference over what the
    pools hold (dequantized, rotated back, attended to in float64)."""
    rng, scale = np.random.default_rng(bits), D**-0.5
    store = make_store(bits)
    seq = store.blocks.allocate()
    cache = KiviLayerCache(store, 0, [seq])
    k, v = kv_data(rng, 70)
    q = mx.array(rng.standard_normal((1, H_Q, 70, D)).astype(np.float32))
    out = attend(cache, q, k, v, scale)  # first chunk: full precision over itself
    np.testing.assert_allclose(np.array(out), dense_reference(q, np.array(k[0]), np.array(v[0]), scale), atol=2e-5)
    assert seq.blocks_used[0] == 2  # (70 - 32) // 16 blocks quantized afterwards
    pk, pv = unrotated_past(store, seq)
    k, v = kv_data(rng, 9)
    q = mx.array(rng.standard_normal((1, H_Q, 9, D)).astype(np.float32))
    out = attend(cache, q, k, v, scale)  # continuation: the quantized past, then itself
    want = dense_reference(q, np.concatenate([pk, np.array(k[0])], axis=1),
                           np.concatenate([pv, np.array(v[0])], axis=1), scale)
    np.testing.assert_allclose(np.array(out), want, atol=2e-5)
    for step in range(40):  # 79 -> 119 tokens: three flushes in begin_decode
        k, v = kv_data(rng, 1)
        q = mx.array(rng.standard_normal((1, H_Q, 1, D)).astype(np.float32))
        out = attend(cache, q, k, v, scale)  # the new token is committed first, then read
        np.testing.assert_allclose(np.array(out), dense_reference(q, *unrotated_past(store, seq), scale),
                                   atol=2e-5, err_msg=f"decode step {step}")
    assert seq.blocks_used[0] == (119 - 32) // 16


def _decode_error(bits, rotate, k, v, q, scale):
    """|2-bit store output - fp attention| after a prefill of k, v and one decode query."""
    store = make_store(bits, rotate, g=32, r=32)
    seq = store.blocks.allocate()
    cache = KiviLayerCache(store, 0, [seq])
    n = k.shape[2] - 1
    attend(cache, mx.zeros((1, H_Q, n, D)), k[:, :, :n], v[:, :, :n], scale)
    out = attend(cache, q, k[:, :, n:], v[:, :, n:], scale)
    fp = dense_reference(q, np.array(k[0], dtype=np.float64), np.array(v[0], dtype=np.float64), scale)
    return float(np.sqrt(((np.array(out) - fp) ** 2).mean() / (fp**2).mean()))


def test_rotation_shrinks_the_2bit_error_of_outlier_channels():
    """The same K/V through a plain and a rotated 2-bit store, against fp attention.
    With outlier channels (as real keys have) 2r's error is much smaller (measured
    0.31 vs 0.62 relative RMS here); on plain Gaussian data the rotation buys nothing
    and costs nothing (0.376 vs 0.379). At 8 bits the rotated store is fp to 0.4%."""
    rng, scale = np.random.default_rng(7), D**-0.5
    q = mx.array(rng.standard_normal((1, H_Q, 1, D)).astype(np.float32)) * 0.2
    k, v = kv_data(rng, 400)
    plain, rotated = _decode_error(2, False, k, v, q, scale), _decode_error(2, True, k, v, q, scale)
    assert rotated < 0.7 * plain, (rotated, plain)
    assert _decode_error(8, True, k, v, q, scale) < 1e-2
    k, v = kv_data(rng, 400, outlier=False)
    plain, rotated = _decode_error(2, False, k, v, q, scale), _decode_error(2, True, k, v, q, scale)
    assert abs(rotated / plain - 1) < 0.15, (rotated, plain)


def test_the_unrotated_path_never_rotates(monkeypatch, smollm2):
    """4-bit (and plain 2-bit) stores have no rotation: the graph is the one before 2r."""
    from kiviq.engine import Request, build_engine

    def boom(*a, **k):
        raise AssertionError("an unrotated store rotated")

    monkeypatch.setattr(mx, "hadamard_transform", boom)
    assert make_store(4, rotate=False).rotation is None and make_store(2, rotate=False).rotation is None
    model, tok = smollm2
    engine = build_engine(model, tok, kv_bits=4, kv_group_size=16, kv_residual=32, kv_memory=1 << 26,
                          max_sequences=2)
    out = run_engine(engine, [Request("a", tok.encode("The sea was calm and the light " * 6), 6)])
    assert len(out["a"]) == 6


# ---- configuration and the worker's flag ---------------------------------------------

def test_kv_bits_names_and_engine_config():
    assert parse_kv_bits("2r") == (2, True) and parse_kv_bits("4") == (4, False) and parse_kv_bits("16") == (16, False)
    for bad in ("3", "4r", "2x", "", "r"):
        with pytest.raises(ValueError, match="2, 2r, 4, 8, 16"):
            parse_kv_bits(bad)
    config = EngineConfig(kv_bits=2, kv_rotate=True)
    assert config.kv == KVConfig(2, 32, 128, 1, rotate=True) and config.kv_label == "2r" and config.kv.label == "2r"
    assert EngineConfig(kv_bits=2).kv.rotate is False and EngineConfig().kv_label == "4"
    for bad in (dict(kv_bits=4, kv_rotate=True), dict(kv_bits=16, kv_rotate=True), dict(kv_bits=2, kv_rotate=1.5)):
        with pytest.raises(ValueError, match="kv_rotate"):
            EngineConfig(**bad)


def test_worker_kv_bits_flag():
    from kiviq.worker.cli import UsageError, build_parser, engine_config

    def config(value):
        return engine_config(build_parser().parse_args(["--kv-bits", value]), environ={})

    assert (config("2r").kv_bits, config("2r").kv_rotate) == (2, True)
    assert [(config(v).kv_bits, config(v).kv_rotate) for v in ("2", "4", "8", "16")] == [
        (2, False), (4, False), (8, False), (16, False)]
    assert build_parser().parse_args([]).kv_bits == "4"
    with pytest.raises(UsageError, match=r"^--kv-bits 3: must be one of 2, 2r, 4, 8, 16"):
        config("3")


def test_worker_rejects_a_bad_kv_bits_with_one_line():
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, "-m", "kiviq.worker", "--kv-bits", "3", "--redis-url",
                           "redis://127.0.0.1:1/0"], cwd=root, capture_output=True, text=True, timeout=120,
                          env={**__import__("os").environ, "PYTHONPATH": str(root)})
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert lines[0] == ("kiviq worker: error: --kv-bits 3: must be one of 2, 2r, 4, 8, 16 "
                        "(2r: 2-bit with K and V Hadamard-rotated)")


# ---- the engine at 2r on the real model -------------------------------------------------

TEXT = ("The old lighthouse keeper climbed the spiral stairs every evening, counting each step "
        "aloud while the gulls circled and the sea rolled grey beneath the cliffs. ")


def engine_2r(model, tok, **options):
    from kiviq.engine import build_engine

    kw = dict(kv_bits=2, kv_rotate=True, kv_group_size=16, kv_residual=32, kv_memory=1 << 27, max_sequences=8,
              max_batch_tokens=96, compile_decode=False)
    return build_engine(model, tok, **{**kw, **options})


def requests(tok, n=4, max_tokens=24):
    from kiviq.engine import Request

    # Prompts of 40..150 tokens: mostly in 2-bit blocks (G=16, R=32), several prefill chunks each.
    return [Request(f"r{i}", tok.encode(TEXT * (1 + i % 3) + f"Question {i}: what happened next?"),
                    max_tokens + 3 * i) for i in range(n)]


def test_engine_2r_batch_equals_single_and_compiled_equals_plain(smollm2):
    """Through build_engine at 2r: batched first chunks, continuation chunks and decode
    with flushes; a sequence decodes as it does alone, and compiled steps (mx.compile
    over the rotation ops) give the same tokens."""
    model, tok = smollm2
    engine = engine_2r(model, tok)
    assert engine.kv_store.config.rotate and engine.kv_store.rotation is not None
    batched = run_engine(engine, requests(tok), join_every=2)
    assert engine.kv_store.blocks.used_bytes() == 0
    assert all(len(t) == 24 + 3 * i for i, t in enumerate(batched.values()))  # random text: no early EOS
    for r in requests(tok)[0:3:2]:  # the shortest and the longest prompt decode as they do alone
        assert run_engine(engine_2r(model, tok), [r])[r.request_id] == batched[r.request_id], r.request_id
    assert run_engine(engine_2r(model, tok, compile_decode=True), requests(tok), join_every=2) == batched


def test_engine_2r_with_nothing_quantized_equals_the_unrotated_store(smollm2):
    """With R above every sequence's length nothing is quantized: the rotation alone is
    an identity (float32 rounding), so greedy tokens equal the unrotated store's; with
    G=16, R=32 they differ (the quantization error differs)."""
    model, tok = smollm2
    reqs = lambda: requests(tok, 3, 16)  # noqa: E731
    rotated = run_engine(engine_2r(model, tok, kv_residual=256), reqs())
    assert rotated == run_engine(engine_2r(model, tok, kv_residual=256, kv_rotate=False), reqs())
    assert run_engine(engine_2r(model, tok), reqs()) != run_engine(engine_2r(model, tok, kv_rotate=False), reqs())


def test_benchmarks_prefill_a_rotated_engine_at_2r(smollm2):
    """benchmarks/step_trace.py's `bits=2r` arm: the benchmark's engine is the rotated
    2-bit store (and `2` is not), prefilled with every prompt."""
    from benchmarks.common import prefilled_engine

    model, tok = smollm2
    prompts = [[int(t) for t in tok.encode(f"prompt {i} " * (i + 2))] for i in range(2)]
    for bits, rotate in (parse_kv_bits("2r"), parse_kv_bits("2")):
        engine = prefilled_engine(model, tok, prompts, 2, bits=bits, rotate=rotate)
        assert engine.kv_store.config.bits == 2 and engine.kv_store.config.rotate is rotate
        assert (engine.kv_store.rotation is hadamard_rotate) is rotate
        assert engine.stats["prefill_tokens"] == sum(map(len, prompts))


def test_store_at_2r_agrees_with_the_simulation(smollm2):
    """benchmarks/kv_quant_sim.py's rot-kv (float32 K/V, rotate, fake-quantize, rotate
    back) and the real store at 2r (rotated pools, rotated q and output) agree on 640
    tokens of the quality text within issue 23's 1% (measured 0.19%), while plain
    2-bit is 2.4% away. Not closer because 2-bit codes are discontinuous: the
    simulation rotates by a float32 matmul, the store by mx.hadamard_transform, and
    their ~1e-6 rounding difference flips a few codes, which compounds over 30
    layers. With the store's op in the simulation they agree to 1e-4 (at 8 bits
    to 3e-5 either way)."""
    from benchmarks.kv_quality import chunked_nll, kivi_cache, load_text_tokens, ppl
    from benchmarks.kv_quant_sim import Setting, SimLayerCache
    from kiviq.engine.kivi_cache import AttentionHook

    model, tok = smollm2
    tokens = load_text_tokens(tok, 640)
    setting = Setting("rot-kv", key_group=16, value_group=16, residual=32, rotate_k=True, rotate_v=True)
    sim = ppl(chunked_nll(model, [SimLayerCache(setting, i, hadamard(D), None) for i in range(len(model.layers))],
                          tokens, 32)[0])
    result = {}
    for rotate in (True, False):
        cache = kivi_cache(model, 2, 16, 32, len(tokens), rotate=rotate)
        with AttentionHook(model):
            result[rotate] = ppl(chunked_nll(model, cache, tokens, 32)[0])
        cache.release()
    assert abs(result[True] / sim - 1) < 0.005, (result, sim)
    assert abs(result[False] / sim - 1) > 0.015, (result, sim)


# A chat whose earlier turns (~190 tokens) sit in 2-bit blocks when the question is
# asked (G=32, R=32: the last 32..63 tokens stay fp16). The questions are ones the fp16
# cache answers right (asserted). Measured on the 14 candidates tried: 2r kept every
# fp16-correct fact; plain 2-bit drifted once (the sky answer turned to the lighthouse).
# With the question itself in 2-bit blocks (a long instruction after it) this 135M
# model loses about half its facts at 2 or 2r bits alike.
HISTORY = [
    {"role": "user", "content": "Tell me a short story about a lighthouse keeper."},
    {"role": "assistant", "content": TEXT * 4 + "He lit the lamp, and the ships passed safely."},
    {"role": "user", "content": "Thank you. Now a different question."},
    {"role": "assistant", "content": "Of course. What would you like to know?"},
]
FACTS = {
    "What is the capital of France?": "Paris",
    "What is the capital of Japan?": "Tokyo",
    "What is the chemical symbol for water?": "H2O",
    "How many legs does a spider have?": "8",
    "What is the capital of Italy?": "Rome",
    "What is the capital of Germany?": "Berlin",
}


def test_factual_chat_answers_stay_right_at_2r(smollm2):
    from kiviq.engine import Request, build_engine

    model, tok = smollm2

    def answers(**config):
        reqs = []
        for i, q in enumerate(FACTS):
            text = tok.apply_chat_template(HISTORY + [{"role": "user", "content": q}], add_generation_prompt=True,
                                           tokenize=False)
            reqs.append(Request(f"q{i}", tok.encode(text, add_special_tokens=False), 12))
        out = run_engine(build_engine(model, tok, **config), reqs)
        return [tok.decode(out[f"q{i}"]) for i in range(len(FACTS))], len(reqs[0].prompt_tokens)

    fp16, prompt_len = answers(kv_bits=16)
    rotated, _ = answers(kv_bits=2, kv_rotate=True, kv_group_size=32, kv_residual=32, kv_memory=1 << 27,
                         max_sequences=8)
    assert prompt_len - 63 > 150  # most of the chat is in 2-bit blocks before the first answer token
    for (question, fact), a16, a2r in zip(FACTS.items(), fp16, rotated):
        assert fact in a16, (question, a16)
        assert fact in a2r, (question, a16, a2r)
