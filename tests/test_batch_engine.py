"""The continuous-batching engine on the real SmolLM2 (CPU, reference attention)."""

from __future__ import annotations

import copy

import mlx.core as mx
import numpy as np
import pytest

from kiviq.engine import Engine, Request, SamplingParams
from kiviq.engine.kivi_cache import attention_shape, model_dtype
from kiviq.engine.kv_store import KiviStore, KVConfig
from engine_runs import run_engine as run

# Small G and R so that short test prompts already live mostly in quantized blocks.
KV = KVConfig(bits=4, group_size=16, residual=32)
TEXT = ("The old lighthouse keeper climbed the spiral stairs every evening, counting each step "
        "aloud while the gulls circled and the sea rolled grey beneath the cliffs. ")


def make_engine(model, tok, *, blocks=256, slots=16, reserve_tokens=64, max_batch_tokens=256,
                pipeline=True, config=KV, compile_decode=False, prefill_while_decoding=None) -> Engine:
    layers, h_kv, d = attention_shape(model)
    store = KiviStore(layers, h_kv, d, config=config, num_blocks=blocks, num_slots=slots, dtype=model_dtype(model))
    return Engine(model, tok, store, max_batch_tokens=max_batch_tokens, reserve_tokens=reserve_tokens,
                  pipeline=pipeline, compile_decode=compile_decode, prefill_while_decoding=prefill_while_decoding)


def prompts(tok, n):
    # Different lengths: 1..3 copies of the text plus a distinct tail.
    return [tok.encode(TEXT * (1 + i % 3) + f"Question {i}: what happened next?") for i in range(n)]


def test_batch_equals_single(smollm2):
    model, tok = smollm2
    ps = prompts(tok, 12)
    reqs = lambda: [Request(f"r{i}", ps[i], max_tokens=3 + i) for i in range(12)]
    engine = make_engine(model, tok)
    batched = run(engine, reqs(), join_every=2)  # join (and leave) mid-run
    assert engine.kv_store.blocks.used_bytes() == 0
    for req in reqs():
        alone = run(make_engine(model, tok), [req])
        assert batched[req.request_id] == alone[req.request_id], req.request_id
        assert len(alone[req.request_id]) <= req.max_tokens


def test_batch_equals_single_with_multi_block_flushes(smollm2):
    """KVConfig.flush_blocks = 3: each tail is quantized 3 blocks at a time, when its own
    length says so, so a sequence still decodes exactly as it does alone."""
    model, tok = smollm2
    config = KVConfig(bits=4, group_size=16, residual=32, flush_blocks=3)
    ps = prompts(tok, 4)
    # >= 3 * G = 48 new tokens: every sequence flushes during decode, not only in its prefill.
    reqs = lambda: [Request(f"r{i}", ps[i], max_tokens=50 + 3 * i) for i in range(4)]
    engine = make_engine(model, tok, config=config)
    batched = run(engine, reqs(), join_every=2)
    assert engine.kv_store.blocks.used_bytes() == 0
    for req in reqs():
        assert batched[req.request_id] == run(make_engine(model, tok, config=config), [req])[req.request_id]


def _drive(engine, pending, abort=("g0", 14)):
    """Feed a request every 3 steps, abort one mid-run; every request's
    (tokens, text, finish reason)."""
    out, step = {}, 0
    while pending or engine.has_work():
        if pending and step % 3 == 0:
            engine.add(pending.pop(0))
        if step == abort[1]:
            engine.abort(abort[0])
        for ev in engine.step():
            assert ev.finish_reason != "error", ev.error
            tokens, text, reason = out.get(ev.request_id, ([], "", None))
            out[ev.request_id] = (tokens + ev.token_ids, text + ev.text, ev.finish_reason or reason)
        step += 1
    assert engine.kv_store.blocks.used_bytes() == 0
    return out


def _mixed_requests(ps):
    return [Request("g0", ps[0], 20), Request("g1", ps[1], 9),
            Request("s", ps[2], 16, SamplingParams(temperature=0.8, top_k=40, seed=11)),
            Request("t", ps[3], 24, SamplingParams(temperature=0.7, min_p=0.05, seed=5)),
            Request("stop", ps[4], 30, stop=["the"]),
            Request("late", ps[5], 12)]


_PLAIN_MIXED: dict = {}


@pytest.mark.parametrize("pipeline", [False, True])
def test_compiled_decode_equals_plain(smollm2, pipeline):
    """Decode steps replayed through mx.compile (engine.compiled_decode) give the
    same events as steps built op by op: greedy, seeded, stop-string and aborted
    requests joining and leaving (the batch size changes), tails flushing and
    block tables widening (retraces), with and without pipelining."""
    model, tok = smollm2
    ps = prompts(tok, 6)
    # One long request: its block table widens every G = 16 tokens, well after the others left.
    reqs = lambda: _mixed_requests(ps) + [Request("long", ps[1], 70)]
    if id(model) not in _PLAIN_MIXED:  # the same reference for both parameters
        _PLAIN_MIXED[id(model)] = _drive(make_engine(model, tok, pipeline=False), reqs(), abort=("g1", 5))
    plain = copy.deepcopy(_PLAIN_MIXED[id(model)])
    engine = make_engine(model, tok, pipeline=pipeline, compile_decode=True)
    compiled = _drive(engine, reqs(), abort=("g1", 5))
    if pipeline:  # an abort drops a draw still in flight (as in the test above)
        assert plain["g1"][0][: len(compiled["g1"][0])] == compiled["g1"][0]
        del plain["g1"], compiled["g1"]
    assert compiled == plain
    stats = engine.runner.compiled.stats
    assert stats["compiled"] > 40 and stats["traces"] >= 4, stats


def test_build_engine_compiles_decode_steps_where_mlx_runs_on_a_gpu(smollm2):
    """The worker's engine: pipelined everywhere, compiled by default only on a GPU
    (on a CPU the traces cost more than they save); compile_decode=True forces it,
    with block tables padded for fewer retraces."""
    from kiviq.engine import build_engine
    from kiviq.engine.setup import COMPILED_TABLE_COLUMNS

    model, tok = smollm2
    default = build_engine(model, tok, kv_memory=1 << 28, max_sequences=2)
    assert default.pipeline
    assert (default.runner.compiled is not None) == (mx.default_device() == mx.gpu)
    forced = build_engine(model, tok, kv_memory=1 << 28, max_sequences=2, compile_decode=True, pipeline=False)
    assert forced.runner.compiled is not None and not forced.pipeline
    assert forced.kv_store.table_width_multiple == COMPILED_TABLE_COLUMNS
    plain = build_engine(model, tok, kv_memory=1 << 28, max_sequences=2, compile_decode=False)
    assert plain.runner.compiled is None and plain.kv_store.table_width_multiple == 1


def test_build_engine_picks_the_sequences_at_once_for_the_device(smollm2):
    """Without max_sequences the engine's config says what it chose (the worker's
    --max-active): the KV budget's 4k-token sequences on a GPU, 32 on a CPU; the
    store has that many tail slots."""
    from kiviq.engine import build_engine
    from kiviq.engine.setup import default_max_sequences

    model, tok = smollm2
    engine = build_engine(model, tok, kv_memory=1 << 28)
    chosen = engine.config.max_sequences
    assert chosen == default_max_sequences(model, engine.config)
    assert engine.capacity == chosen == engine.kv_store.blocks.num_slots
    if mx.default_device() != mx.gpu:
        assert chosen == 32


def test_compiled_decode_replays_a_batch_size_seen_again(smollm2):
    """Under continuous batching B moves back and forth (2 -> 1 -> 2 here, as a
    sequence finishes and another joins): a shape traced before replays at once,
    with no plain step and no new trace; the tokens are the plain engine's."""
    model, tok = smollm2
    ps = prompts(tok, 3)

    def drive(engine):
        engine.kv_store.table_width_multiple = 32  # one table width for the whole run
        out = {}
        engine.add(Request("a", ps[0], 40))
        engine.add(Request("b", ps[1], 8))
        step = 0
        while engine.has_work():
            if step == 14:
                engine.add(Request("c", ps[2], 12))
            for ev in engine.step():
                out[ev.request_id] = out.get(ev.request_id, []) + ev.token_ids
            step += 1
        return out

    compiled = make_engine(model, tok, pipeline=False, compile_decode=True)
    assert drive(compiled) == drive(make_engine(model, tok, pipeline=False))
    # (2, W) and (1, W) traced once each; B = 2 again after c joins replays.
    assert compiled.runner.compiled.stats["traces"] == 2, compiled.runner.compiled.stats


def test_compiled_decode_updates_the_pool_in_place(smollm2):
    """Compiled steps (the trace and the replays) still write the tails in place:
    a step allocates the same whatever the pool's size (a copy of the tails would
    be ~1 GiB here)."""
    model, tok = smollm2

    def worst_step_peak(slots):
        engine = make_engine(model, tok, slots=slots, pipeline=False, compile_decode=True)
        engine.add(Request("r", prompts(tok, 1)[0], 12))
        engine.step()  # the prefill
        peaks = []
        for _ in range(5):  # a plain step, the trace, replays
            mx.synchronize()
            base = mx.get_active_memory()
            mx.reset_peak_memory()
            engine.step()
            mx.synchronize()
            peaks.append(mx.get_peak_memory() - base)
        assert engine.runner.compiled.stats["compiled"] >= 3
        return max(peaks)

    small, large = worst_step_peak(2), worst_step_peak(512)  # tails: 18 MiB per array at 512 slots
    assert large < small + (1 << 20), (small, large)


def test_pipelined_decode_equals_step_by_step(smollm2):
    """Overlapping a step's device work with the next step's graph building changes
    no token: greedy, seeded and stop-string requests joining, ending and aborted
    mid-run give the same events with pipelining on and off."""
    model, tok = smollm2
    ps = prompts(tok, 6)

    def reqs():
        return _mixed_requests(ps)

    def drive(engine):
        return _drive(engine, reqs())

    plain = make_engine(model, tok, pipeline=False)
    piped = make_engine(model, tok, pipeline=True)
    a, b = drive(piped), drive(plain)
    # An abort drops a draw still in flight: the aborted request may end one token
    # earlier, never with a different token.
    assert b["g0"][0][: len(a["g0"][0])] == a["g0"][0] and len(a["g0"][0]) >= len(b["g0"][0]) - 1
    del a["g0"], b["g0"]
    assert a == b
    assert plain.stats["pipelined_steps"] == 0
    assert piped.stats["pipelined_steps"] > 10
    assert piped.stats["decode_tokens"] >= plain.stats["decode_tokens"] - 1


def test_pipelined_decode_writes_the_pool_in_place(smollm2):
    """A step in flight while the next is built must not make MLX copy the pool
    (the next step's token writes and flushes would then copy whole tails)."""
    model, tok = smollm2
    engine = make_engine(model, tok, blocks=2048, slots=16)
    for i, p in enumerate(prompts(tok, 4)):
        engine.add(Request(f"r{i}", p, 200))
    for _ in range(8):  # prefill, then steady pipelined decoding
        engine.step()
    pools = sum(p.nbytes for p in engine.kv_store.pools)
    mx.eval(engine.kv_store.pools)
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    before = engine.stats["pipelined_steps"]
    for _ in range(40):  # includes flushes (G = 16)
        engine.step()
    assert engine.stats["pipelined_steps"] - before >= 39
    assert mx.get_peak_memory() - base < pools / 4, (mx.get_peak_memory() - base, pools)


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
    assert engine.kv_store.blocks.used_bytes() == 0
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
    held = engine.kv_store.blocks.used_bytes()
    assert engine.abort("abort") and engine.kv_store.blocks.used_bytes() < held  # freed at once
    while engine.has_work():
        for ev in engine.step():
            texts[ev.request_id] = texts.get(ev.request_id, "") + ev.text
            reasons[ev.request_id] = ev.finish_reason
    assert reasons["eos"] == "stop" and "Paris" in texts["eos"]
    assert reasons["stop"] == "stop" and "France is" not in texts["stop"]
    assert texts["eos"].startswith(texts["stop"])
    assert reasons["len"] == "length"
    assert engine.kv_store.blocks.used_bytes() == 0 and not engine.abort("abort")


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


def test_a_failed_decode_step_ends_its_batch_and_the_engine_serves_on(smollm2):
    """A decode step that raises (a device error: nobody's fault in particular) ends
    every sequence of its batch with the error, after the tokens of the step that was
    in flight; their memory is freed and the next requests run as on a fresh engine."""
    model, tok = smollm2
    ps = prompts(tok, 3)
    reqs = lambda: [Request(f"r{i}", ps[i], max_tokens=12) for i in range(3)]
    undisturbed = run(make_engine(model, tok), reqs())
    engine = make_engine(model, tok)  # pipelined: a step is in flight when the next one fails
    got = {r.request_id: [] for r in reqs()}
    for r in reqs():
        engine.add(r)
    while engine.stats["pipelined_steps"] < 3:
        for ev in engine.step():
            assert ev.finish_reason is None, ev
            got[ev.request_id] += ev.token_ids
    decode = engine.runner.decode

    def lost(*args, **kwargs):
        raise RuntimeError("device lost")

    engine.runner.decode = lost
    events = engine.step()
    ends = {ev.request_id: ev for ev in events if ev.finish_reason}
    assert sum(1 for ev in events if ev.token_ids and not ev.finish_reason) == 3  # the step in flight
    for ev in events:
        got[ev.request_id] += ev.token_ids
    assert set(ends) == set(got) and all(e.finish_reason == "error" and e.error == "RuntimeError: device lost"
                                         for e in ends.values())
    assert all(len(t) > 3 and t == undisturbed[rid][:len(t)] for rid, t in got.items())  # the in-flight step's too
    assert not engine.has_work() and engine.kv_store.blocks.used_bytes() == 0
    engine.runner.decode = decode
    again = Request("again", ps[1], max_tokens=12)
    assert run(engine, [again])["again"] == run(make_engine(model, tok), [again])["again"]


def run_with_logprobs(engine, requests) -> dict[str, tuple[list[int], list | None]]:
    """Like engine_runs.run_engine, keeping each request's logprobs (None for
    requests whose events carry none)."""
    out = {r.request_id: ([], None) for r in requests}
    for r in requests:
        engine.add(r)
    while engine.has_work():
        for ev in engine.step():
            assert ev.finish_reason != "error", ev.error
            tokens, lps = out[ev.request_id]
            tokens += ev.token_ids
            if ev.logprobs is not None:
                assert len(ev.logprobs) == len(ev.token_ids)
                out[ev.request_id] = (tokens, (lps or []) + ev.logprobs)
    return out


def forward_logprobs(model, prompt: list[int], generated: list[int]) -> np.ndarray:
    """log_softmax of a plain mlx-lm forward (no cache) at each generated position: [n, V]."""
    logits = model(mx.array(prompt + generated)[None])[0, len(prompt) - 1: len(prompt) + len(generated) - 1]
    logits = logits.astype(mx.float32)
    return np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))


def test_greedy_logprobs_match_a_direct_forward(smollm2):
    """The engine's logprobs of greedy tokens equal the model's own
    log_softmax, alone or batched: tightly while the context is all in the
    fp16 tail, within KIVI 4-bit error once it is mostly quantized."""
    model, tok = smollm2
    short = tok.encode("The capital of France is")  # < R + G tokens: never quantized
    long = tok.encode(TEXT * 3)  # ~100 tokens: mostly 4-bit blocks
    reqs = [Request("short", short, 12, SamplingParams(logprobs=5)),
            Request("plain", short, 6),
            Request("long", long, 12, SamplingParams(logprobs=3))]
    out = run_with_logprobs(make_engine(model, tok), reqs)
    assert out["plain"][1] is None
    # Short: float32 rounding only. Long (measured, 24 tokens): chosen tokens
    # within 0.03 in logprob; unlikely alternatives move more in logprob
    # (up to 0.5 at p ~ 0.004) but under 0.03 in probability.
    for rid, prompt, atol, prob_atol in (("short", short, 2e-3, 1e-3), ("long", long, 0.1, 0.05)):
        tokens, lps = out[rid]
        assert len(tokens) == len(lps) == 12
        want = forward_logprobs(model, prompt, tokens)
        for j, (t, lp) in enumerate(zip(tokens, lps)):
            assert lp.token_id == t and lp.top[0][0] == t  # greedy: the chosen token is the best
            assert abs(lp.logprob - want[j, t]) < atol, (rid, j, lp.logprob, want[j, t])
            values = [v for _, v in lp.top]
            assert values == sorted(values, reverse=True)
            np.testing.assert_allclose(np.exp(values), np.exp(want[j, [i for i, _ in lp.top]]), atol=prob_atol, rtol=0)
            if rid == "short":
                np.testing.assert_allclose(values, want[j, [i for i, _ in lp.top]], atol=atol, rtol=0)
    # Alone, the short request reports the same numbers.
    alone_tokens, alone = run_with_logprobs(make_engine(model, tok), reqs[:1])["short"]
    assert alone_tokens == out["short"][0]
    np.testing.assert_allclose([lp.logprob for lp in alone], [lp.logprob for lp in out["short"][1]], atol=1e-4)


def test_serial_engine_logprobs_match_mlx_lm(smollm2):
    """--kv-bits 16: the chosen tokens' logprobs equal those mlx-lm's
    generate_step yields (greedy, so at temperature 1 both ways)."""
    from mlx_lm.generate import generate_step

    from kiviq.engine import SerialEngine

    model, tok = smollm2
    prompt = tok.encode(TEXT)
    ref = [(int(t), np.array(lp)) for (t, lp), _ in zip(generate_step(mx.array(prompt), model), range(10))]
    out = run_with_logprobs(SerialEngine(model, tok), [Request("s", prompt, 10, SamplingParams(logprobs=2))])["s"]
    tokens, lps = out
    assert tokens == [t for t, _ in ref]
    for (t, want), lp in zip(ref, lps):
        assert abs(lp.logprob - float(want[t])) < 1e-4
        assert [i for i, _ in lp.top] == list(np.argsort(-want)[:2])


def test_prefill_token_count_includes_every_chunk(smollm2):
    """stats["prefill_tokens"] (the worker's prefill throughput metric, and what the
    benchmarks wait on) counts each chunk of a prompt longer than the step's token
    budget, not only its last chunk."""
    model, tok = smollm2
    ps = prompts(tok, 3)
    engine = make_engine(model, tok, max_batch_tokens=24)
    assert all(len(p) > 24 for p in ps)  # every prompt is prefilled in several chunks
    run(engine, [Request(f"r{i}", p, max_tokens=2) for i, p in enumerate(ps)])
    assert engine.stats["preemptions"] == 0
    assert engine.stats["prefill_tokens"] == sum(map(len, ps))


def test_a_prompt_arriving_mid_generation_prefills_in_capped_steps(smollm2):
    """prefill_while_decoding: while a sequence generates, each step feeds at most that
    many prompt tokens of a newcomer, so the running sequence gets a token every step
    and never waits for the whole prompt; both finish."""
    model, tok = smollm2
    short, long = tok.encode("Count to ten:"), tok.encode(TEXT * 3)
    engine = make_engine(model, tok, max_batch_tokens=256, prefill_while_decoding=16)
    engine.add(Request("running", short, max_tokens=40))
    engine.step()  # its prefill (nobody decodes yet: no cap)
    engine.add(Request("newcomer", long, max_tokens=2))
    fed, counted, decoded = [], engine.stats["prefill_tokens"], engine.stats["decode_tokens"]
    while engine.stats["prefill_tokens"] < len(short) + len(long):
        engine.step()
        fed.append(engine.stats["prefill_tokens"] - counted)
        counted = engine.stats["prefill_tokens"]
    assert len(long) > 16 * 3 and max(fed) == 16 and len(fed) == -(-len(long) // 16)
    # The running sequence got its tokens meanwhile (events trail by a pipelined step).
    assert engine.stats["decode_tokens"] - decoded >= len(fed) - 1
    while engine.has_work():
        engine.step()


def test_wider_block_tables_change_no_token(smollm2):
    """KiviStore.table_width_multiple pads the decode block tables (fewer retraces of
    a compiled step); the padding columns are never read, so every request gets the
    same tokens, compiled or not."""
    model, tok = smollm2
    ps = prompts(tok, 4)
    reqs = lambda: [Request(f"r{i}", ps[i], 20 + 5 * i) for i in range(4)]
    plain = run(make_engine(model, tok, pipeline=False), reqs(), join_every=2)
    for compile_decode in (False, True):
        engine = make_engine(model, tok, pipeline=False, compile_decode=compile_decode)
        engine.kv_store.table_width_multiple = 8
        assert run(engine, reqs(), join_every=2) == plain
    assert engine.runner.compiled.stats["compiled"] > 20


def test_engine_config_names_the_bad_field():
    from kiviq.engine.config import EngineConfig

    for bad, field in ((dict(kv_bits=3), "kv_bits"), (dict(kv_residual=40), "kv_residual"),
                       (dict(kv_flush_blocks=0), "kv_flush_blocks"), (dict(max_sequences=0), "max_sequences"),
                       (dict(max_batch_tokens=0), "max_batch_tokens"), (dict(kv_memory=0), "kv_memory"),
                       (dict(use_kernel=True), "use_kernel"), (dict(kv_group_size=7, kv_residual=14), "kv_group_size")):
        with pytest.raises(ValueError, match=field):
            EngineConfig(**bad)
    config = EngineConfig(kv_bits=2, kv_group_size=16, kv_residual=32, kv_flush_blocks=2)
    assert config.kv == KVConfig(2, 16, 32, 2)
    with pytest.raises(AttributeError):
        config.kv_bits = 4  # frozen
