"""benchmarks/prefill_shapes.py records the shapes the GPU would meet: first chunks
packed into one forward, their attention padded to a multiple of 64 wide and to a
power of two of rows, and the same prompts again meet nothing new; and the steps
and forward tokens they took."""

from __future__ import annotations

import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import prefill_shapes  # noqa: E402
from kiviq.engine.kivi_cache import packed_length  # noqa: E402


def test_a_group_of_first_chunks_is_recorded_with_the_gpus_padding_and_repeats_meet_nothing_new():
    from kiviq.engine import batch_engine, kivi_cache

    patched = kivi_cache.causal_attention, batch_engine.make_detokenizer
    engine = prefill_shapes.gpu_engine(budget=1024, width_multiple=64)
    with prefill_shapes.ShapeLog(engine) as log:
        log.phase = "a"
        steps, prompt_tokens = prefill_shapes.run_workload(engine, random.Random(1), jobs=3, tokens=100, tag="a")
        packed = packed_length(prompt_tokens, 64)  # one packed forward, its rows padded to a few lengths
        assert log.shapes["a"] == {("forward", packed, 1), ("attention", 4, 128, 128)}
        assert log.forwards["a"] == 1
        assert steps == 1 and 270 <= prompt_tokens <= 330
        assert log.tokens["a"] == packed == 320  # padding included
        log.phase = "b"
        prefill_shapes.run_workload(engine, random.Random(1), jobs=3, tokens=100, tag="b")
        assert log.shapes["b"] == log.shapes["a"]
    assert (kivi_cache.causal_attention, batch_engine.make_detokenizer) == patched  # restored for other tests


def test_steps_count_until_every_prompt_has_its_first_token():
    """Prompts that need three steps of a 1,024-token budget are counted as three
    steps, not the decode steps after them."""
    engine = prefill_shapes.gpu_engine(budget=1024, width_multiple=64)
    with prefill_shapes.ShapeLog(engine) as log:
        log.phase = "a"
        steps, prompt_tokens = prefill_shapes.run_workload(engine, random.Random(2), jobs=4, tokens=600, tag="a")
    assert 2160 <= prompt_tokens <= 2640
    assert steps == 3
    assert log.tokens["a"] >= prompt_tokens
