"""The worker's warm-up run (engine.warmup) on the real SmolLM2, CPU."""

from __future__ import annotations

from kiviq.engine import Request
from kiviq.engine.warmup import warm_up
from test_batch_engine import make_engine, prompts


def test_warm_up_leaves_the_engine_idle_and_its_counters_zero(smollm2):
    model, tok = smollm2
    engine = make_engine(model, tok, compile_decode=True, max_batch_tokens=96)
    seconds = warm_up(engine, model.args.vocab_size, batch_sizes=(1, 2))
    assert seconds > 0
    assert not engine.has_work()
    assert all(v == 0 for v in engine.stats.values())
    assert engine.kv_store.blocks.free_slots == engine.capacity
    assert engine.kv_store.blocks.free_blocks == engine.kv_store.blocks.num_blocks
    assert engine.runner.compiled.stats["traces"] >= 2  # decode steps were traced at both batch sizes


def test_warm_up_changes_no_token(smollm2):
    model, tok = smollm2
    ps = prompts(tok, 3)

    def run(engine):
        for i, p in enumerate(ps):
            engine.add(Request(f"r{i}", p, 8))
        out = {}
        while engine.has_work():
            for ev in engine.step():
                out.setdefault(ev.request_id, []).extend(ev.token_ids)
        return out

    cold = run(make_engine(model, tok, compile_decode=True))
    warmed = make_engine(model, tok, compile_decode=True)
    warm_up(warmed, model.args.vocab_size, batch_sizes=(1, 2))
    assert run(warmed) == cold
