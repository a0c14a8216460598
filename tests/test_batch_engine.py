"""The continuous-batching engine on the real SmolLM2 (CPU, reference attention)."""

from __future__ import annotations

from engine import Engine, Request, SamplingParams
from engine.kivi_cache import attention_shape, install_attention_hook, model_dtype
from engine.kv_store import KiviStore, KVConfig
from engine_runs import run_engine as run

# Small G and R so that short test prompts already live mostly in quantized blocks.
KV = KVConfig(bits=4, group_size=16, residual=32)
TEXT = ("The old lighthouse keeper climbed the spiral stairs every evening, counting each step "
        "aloud while the gulls circled and the sea rolled grey beneath the cliffs. ")


def make_engine(model, tok, *, blocks=256, slots=16, reserve_tokens=64, max_batch_tokens=256) -> Engine:
    install_attention_hook()
    layers, h_kv, d = attention_shape(model)
    store = KiviStore(layers, h_kv, d, config=KV, num_blocks=blocks, num_slots=slots, dtype=model_dtype(model))
    return Engine(model, tok, store, max_batch_tokens=max_batch_tokens, reserve_tokens=reserve_tokens)


def prompts(tok, n):
    # Different lengths: 1..3 copies of the text plus a distinct tail.
    return [tok.encode(TEXT * (1 + i % 3) + f"Question {i}: what happened next?") for i in range(n)]


def test_batch_equals_single(smollm2):
    model, tok = smollm2
    ps = prompts(tok, 12)
    reqs = lambda: [Request(f"r{i}", ps[i], max_tokens=3 + i) for i in range(12)]
    engine = make_engine(model, tok)
    batched = run(engine, reqs(), join_every=2)  # join (and leave) mid-run
    assert engine.kv_store.used_bytes() == 0
    for req in reqs():
        alone = run(make_engine(model, tok), [req])
        assert batched[req.request_id] == alone[req.request_id], req.request_id
        assert len(alone[req.request_id]) <= req.max_tokens


def test_seeded_sampling_is_independent_of_companions(smollm2):
    model, tok = smollm2
    ps = prompts(tok, 4)
    seeded = lambda: Request("s", ps[0], 12, SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=7))
    alone = run(make_engine(model, tok), [seeded()])["s"]
    others = [Request("g", ps[1], 12), Request("u", ps[2], 12, SamplingParams(temperature=1.0)),
              Request("t", ps[3], 12, SamplingParams(temperature=0.5, min_p=0.1, seed=3))]
    together = run(make_engine(model, tok), [others[0], seeded(), *others[1:]])["s"]
    assert together == alone
    again = run(make_engine(model, tok), [seeded()])["s"]
    assert again == alone


def test_preemption_completes_everything_correctly(smollm2):
    """A KV budget that holds only ~3 of 8 sequences: the newest get preempted
    and recomputed; every output equals the one produced alone."""
    model, tok = smollm2
    ps = [tok.encode(TEXT + f"Story {i}:") for i in range(8)]  # ~40 tokens each
    reqs = lambda: [Request(f"p{i}", ps[i], max_tokens=24) for i in range(8)]
    # 40 + 24 tokens hold (64 - 32) // 16 = 2 blocks; 7 blocks fit about 3 sequences.
    engine = make_engine(model, tok, blocks=7, slots=8, reserve_tokens=0)
    batched = run(engine, reqs())
    assert engine.stats["preemptions"] > 0
    assert engine.kv_store.used_bytes() == 0
    for req in reqs()[-3:]:  # the newest are the ones preempted
        assert batched[req.request_id] == run(make_engine(model, tok), [req])[req.request_id]


def test_stop_string_eos_max_tokens_and_abort(smollm2):
    model, tok = smollm2
    engine = make_engine(model, tok)
    chat = tok.encode(tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                              add_generation_prompt=True, tokenize=False), add_special_tokens=False)
    engine.add(Request("eos", chat, max_tokens=64))
    engine.add(Request("stop", chat, max_tokens=64, stop=["France is"]))
    engine.add(Request("len", ps := tok.encode(TEXT), max_tokens=5))
    engine.add(Request("abort", ps, max_tokens=64))
    texts, reasons = {}, {}
    for _ in range(3):
        for ev in engine.step():
            texts[ev.request_id] = texts.get(ev.request_id, "") + ev.text
            reasons[ev.request_id] = ev.finish_reason
    held = engine.kv_store.used_bytes()
    assert engine.abort("abort") and engine.kv_store.used_bytes() < held  # freed at once
    while engine.has_work():
        for ev in engine.step():
            texts[ev.request_id] = texts.get(ev.request_id, "") + ev.text
            reasons[ev.request_id] = ev.finish_reason
    assert reasons["eos"] == "stop" and "Paris" in texts["eos"]
    assert reasons["stop"] == "stop" and "France is" not in texts["stop"]
    assert texts["eos"].startswith(texts["stop"])
    assert reasons["len"] == "length"
    assert engine.kv_store.used_bytes() == 0 and not engine.abort("abort")


def test_request_too_large_for_store_fails_alone(smollm2):
    model, tok = smollm2
    engine = make_engine(model, tok, blocks=4, slots=4)
    big = tok.encode(TEXT * 6)  # ~180 tokens: needs 9 blocks
    small = tok.encode("Hello")
    out = {}
    engine.add(Request("big", big, 4))
    engine.add(Request("small", small, 4))
    while engine.has_work():
        for ev in engine.step():
            if ev.finish_reason:
                out[ev.request_id] = (ev.finish_reason, ev.error)
    assert out["big"][0] == "error" and "KV" in out["big"][1]
    assert out["small"][0] in ("stop", "length")
