"""The scheduler's token budget per step (pure Python: a stand-in allocator with room
for everything, sequences without tensors)."""

from __future__ import annotations

import pytest

from kiviq.engine.request import Request
from kiviq.engine.scheduler import Scheduler
from kiviq.engine.sequence import Sequence


class Roomy:
    """An allocator that always has room: only the token budget limits a step."""

    free_blocks = 10**6
    free_slots = 10**3

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // 32)

    def blocks_held(self, seq: Sequence) -> int:
        return self.blocks_needed(seq.prefilled)


def sequence(n: int, tokens: int) -> Sequence:
    return Sequence(Request(f"r{n}", list(range(tokens)), 8), arrival=n)


def run_prefill(s: Scheduler, plan) -> None:
    """What the engine does with a plan's prefill chunks: feed them, and a sequence
    whose whole prompt is in decodes from the next step."""
    for seq, n in plan.prefill:
        seq.prefilled += n
        if seq.prefilled == seq.num_tokens:
            s.prefill_done(seq)


def prefill_per_step(s: Scheduler, steps: int) -> list[tuple[int, int]]:
    """(decoding sequences, prompt tokens prefilled) of each of the next steps."""
    out = []
    for _ in range(steps):
        plan = s.schedule()
        out.append((len(plan.decode), sum(n for _, n in plan.prefill)))
        run_prefill(s, plan)
    return out


def test_a_step_prefills_what_the_budget_leaves_by_default():
    s = Scheduler(Roomy(), max_batch_tokens=4096)
    for i in range(4):
        s.add(sequence(i, 3000))
    # 12,000 prompt tokens: steps of 4096 minus one token per sequence already decoding
    assert prefill_per_step(s, 4) == [(0, 4096), (1, 4095), (2, 3809), (4, 0)]


def test_prefill_is_capped_only_while_sequences_decode():
    s = Scheduler(Roomy(), max_batch_tokens=4096, prefill_while_decoding=1024)
    for i in range(4):
        s.add(sequence(i, 3000))
    steps = prefill_per_step(s, 12)
    assert steps[0] == (0, 4096)  # nobody decodes yet: the whole budget
    assert all(n <= 1024 for d, n in steps if d)  # then at most the cap per step
    assert sum(n for _, n in steps) == 12000 and steps[-1] == (4, 0)
    # A new prompt while everything decodes also waits for the cap; once the engine
    # is idle again a prompt gets the whole budget.
    s.add(sequence(9, 5000))
    assert s.schedule().prefill == [(s.prefilling[0], 1024)]
    idle = Scheduler(Roomy(), max_batch_tokens=4096, prefill_while_decoding=1024)
    idle.add(sequence(10, 5000))
    assert sum(n for _, n in idle.schedule().prefill) == 4096


def test_the_cap_never_raises_the_budget():
    s = Scheduler(Roomy(), max_batch_tokens=512, prefill_while_decoding=4096)
    for i in range(2):
        s.add(sequence(i, 1000))
    assert all(d + n <= 512 for d, n in prefill_per_step(s, 6))


@pytest.mark.parametrize("value", [0, -5])
def test_the_worker_flag_rejects_a_cap_below_one(value):
    from kiviq.worker.cli import UsageError, build_parser, engine_config

    args = build_parser().parse_args(["--prefill-while-decoding", str(value)])
    with pytest.raises(UsageError, match="prefill_while_decoding must be >= 1.*--prefill-while-decoding"):
        engine_config(args, environ={})


def test_the_worker_flag_reaches_the_engine_config():
    from kiviq.worker.cli import build_parser, engine_config

    config = engine_config(build_parser().parse_args(["--prefill-while-decoding", "2048"]), environ={})
    assert config.prefill_while_decoding == 2048
    assert engine_config(build_parser().parse_args([]), environ={}).prefill_while_decoding is None


def test_a_split_prompt_is_cut_at_the_chunk_multiple():
    """A prompt split across steps is cut after a multiple of chunk_multiple tokens
    (its later chunks' attention shapes then repeat), and the split ends the step's
    prefill; a budget below the multiple still makes progress."""
    s = Scheduler(Roomy(), max_batch_tokens=1000, chunk_multiple=256)
    short, long = sequence(0, 300), sequence(1, 3000)
    s.add(short)
    s.add(long)
    plan = s.schedule()
    assert plan.prefill == [(short, 300), (long, 512)]  # 700 left, cut at 512
    run_prefill(s, plan)
    chunks = []
    while s.prefilling:
        plan = s.schedule()
        chunks += [n for seq, n in plan.prefill if seq is long]
        run_prefill(s, plan)
    assert chunks == [768, 768, 952]  # 999 of budget beside one decode: cut at 768; the rest whole
    tiny = Scheduler(Roomy(), max_batch_tokens=100, chunk_multiple=256)
    tiny.add(sequence(2, 300))
    assert [n for _, n in tiny.schedule().prefill] == [100]
    # What another prompt leaves, if less than a multiple, is left unused.
    s = Scheduler(Roomy(), max_batch_tokens=1000, chunk_multiple=256)
    s.add(sequence(3, 900))
    s.add(sequence(4, 3000))
    assert [n for _, n in s.schedule().prefill] == [900]


def test_a_prompt_that_fits_the_next_step_whole_is_not_split_for_a_few_tokens():
    """Up to SPLIT_WASTE of a step's budget is left unused rather than split a prompt
    that the next step takes whole; a larger remainder is still filled by a split."""
    s = Scheduler(Roomy(), max_batch_tokens=1024, chunk_multiple=1)
    first, second = sequence(0, 950), sequence(1, 500)
    s.add(first)
    s.add(second)
    plan = s.schedule()
    assert plan.prefill == [(first, 950)]  # 74 left (<= 128): not split
    run_prefill(s, plan)
    assert s.schedule().prefill == [(second, 500)]
    s = Scheduler(Roomy(), max_batch_tokens=1024, chunk_multiple=1)
    first, second = sequence(0, 600), sequence(1, 700)
    s.add(first)
    s.add(second)
    assert s.schedule().prefill == [(first, 600), (second, 424)]  # 424 left: split
    # A prompt longer than a whole step is split whatever is left.
    s = Scheduler(Roomy(), max_batch_tokens=1024, chunk_multiple=1)
    first, second = sequence(0, 950), sequence(1, 5000)
    s.add(first)
    s.add(second)
    assert s.schedule().prefill == [(first, 950), (second, 74)]
