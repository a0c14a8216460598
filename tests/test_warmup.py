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


def test_warm_up_on_a_gpu_also_meets_a_full_step_and_a_later_chunk(smollm2):
    """Where prefill widths are padded (a GPU: attention graphs per shape), the
    warm-up also runs a prefill step as wide as the step budget, a prompt longer
    than a step (a later chunk attending to its past), and first chunks whose
    width is an odd multiple of 64 as well as ones of a multiple of 128 (cuDNN
    compiles a kernel for each kind): what a bulk burst meets first. The runner's
    padding is set by hand here, on the CPU."""
    model, tok = smollm2
    engine = make_engine(model, tok, max_batch_tokens=512)  # 4x the small steps' width
    engine.runner.prefill_width_multiple = 64
    runner, firsts, chunks, widths = engine.runner, [], [], []
    prefill_first, prefill = runner.prefill_first, runner.prefill

    def logged_first(seqs, batch, groups=None):
        firsts.append(sum(map(len, batch)))
        for group in groups or [range(len(batch))]:  # each group's attention width
            widths.append(-(-max(len(batch[i]) for i in group) // 64) * 64)
        return prefill_first(seqs, batch, groups)

    def logged_chunk(seq, tokens):
        chunks.append(len(tokens))
        return prefill(seq, tokens)

    runner.prefill_first, runner.prefill = logged_first, logged_chunk
    warm_up(engine, model.args.vocab_size, batch_sizes=(1,))
    assert max(firsts) == 512  # one step of first chunks filled the budget
    assert {w // 64 % 2 for w in widths} == {0, 1}  # widths of an even and an odd count of 64s
    assert chunks  # and a later chunk attended to a past
    assert not engine.has_work() and engine.kv_store.blocks.free_blocks == engine.kv_store.blocks.num_blocks
