"""Compile before serving: a short synthetic run through the engine's own paths.

The first time MLX meets an op on a GPU it compiles its kernel (NVRTC), builds a
cuDNN attention graph per attention shape, and ``mx.compile`` traces a decode
step per (batch, table width). A bulk run right after a worker starts paid for
all of that in its first seconds (measured: all first tokens after 19.6 s cold
against 4.3 s warm on an H200). ``warm_up`` runs requests of random tokens that
take every path a real run takes -- batched first-chunk prefill with flushes,
on a GPU a prefill step as wide as the step budget and first chunks of both
kinds of width cuDNN compiles attention for, a later chunk attending to its
past, plain, traced and replayed decode steps at a few batch sizes, sampling
with and without logprobs -- then frees everything and zeroes the engine's
counters, so the worker's metrics see only real work.
"""

from __future__ import annotations

import random
import time
from typing import Any

import mlx.core as mx

from kiviq.engine.model_runner import PREFILL_WIDTH_MULTIPLE
from kiviq.engine.request import Request, SamplingParams
from kiviq.engine.setup import context_length

DECODE_STEPS = 6  # enough for a plain step, a trace and replays at each batch size
FULL_STEP_CHUNK = 1024  # prompt tokens per row of the warm-up's full-budget prefill step
# Row i of a group samples with WARM_UP_SAMPLING[i % 4]: greedy with logprobs, a seeded
# row, an unseeded truncating row, a seeded truncating row; so a group of four meets
# every op the sampler has (sort and scatter back, shared and per-key noise).
WARM_UP_SAMPLING = (SamplingParams(logprobs=2), SamplingParams(temperature=0.7, seed=1),
                    SamplingParams(temperature=0.8, top_p=0.9), SamplingParams(temperature=0.7, top_k=20, seed=3))


def _prompt(rng: random.Random, vocab: int, n: int) -> list[int]:
    return [rng.randrange(10, vocab) for _ in range(n)]


def warm_up(engine: Any, vocab_size: int, *, batch_sizes: tuple[int, ...] = (1, 2, 4)) -> float:
    """Run the synthetic workload on ``engine`` (an idle batching Engine); returns
    the seconds it took. The engine is idle again afterwards, its stats zeroed."""
    if engine.has_work():
        raise RuntimeError("warm_up needs an idle engine")
    start = time.perf_counter()
    rng = random.Random(0)
    store = engine.kv_store.config
    budget = engine.scheduler.max_batch_tokens
    # Long enough to flush blocks inside the prompt, short enough for any budget.
    flushing = min(store.residual + 2 * store.flush_tokens + 5, max(1, budget // 2 - max(batch_sizes)))
    width = -(-flushing // PREFILL_WIDTH_MULTIPLE) * PREFILL_WIDTH_MULTIPLE
    capacity = engine.capacity
    n = 0
    for b in batch_sizes:
        if b > capacity:
            break
        for i in range(b):  # a group of first chunks
            sampling = WARM_UP_SAMPLING[i % len(WARM_UP_SAMPLING)]
            engine.add(Request(f"warm-up-{n}", _prompt(rng, vocab_size, width - i), DECODE_STEPS + 2, sampling))
            n += 1
        _drain(engine)
    wide = engine.runner.prefill_width_multiple > 1  # a GPU: attention graphs and kernels per shape
    odd = width + PREFILL_WIDTH_MULTIPLE if width % (2 * PREFILL_WIDTH_MULTIPLE) == 0 else width
    if wide and budget >= 2 * odd and capacity >= 2:
        # cuDNN compiles its attention kernels for lengths that are a multiple of 128
        # apart from those for the rest; with the default KIVI settings the widths above
        # are multiples of 128, so a group of an odd multiple of 64 meets the others here
        # instead of in a bulk burst's first step (on an H200 that step took 1.0 s, not 0.5).
        for i in range(2):
            engine.add(Request(f"warm-up-{n}", _prompt(rng, vocab_size, odd - i), 2))
            n += 1
        _drain(engine)
    if wide and budget > width and capacity >= 1:
        # What a bulk burst meets first: a step of first chunks filling the budget
        # (its matmuls and attention at full size).
        chunk = min(budget, FULL_STEP_CHUNK)
        for i in range(min(capacity, budget // chunk)):
            engine.add(Request(f"warm-up-{n}", _prompt(rng, vocab_size, chunk - i), 2))
            n += 1
        _drain(engine)
    long = budget + flushing  # a prompt longer than a step: a later chunk with a past
    if (budget < 4 * width or wide) and capacity >= 1 and long < context_length(engine.runner.model):
        engine.add(Request(f"warm-up-{n}", _prompt(rng, vocab_size, long), 2))
        _drain(engine)
    mx.synchronize()
    # Its buffers were made for shapes a run may never meet: back to the device, not
    # held in MLX's cache from whatever else runs on this GPU.
    mx.clear_cache()
    for key in engine.stats:
        engine.stats[key] = 0
    return time.perf_counter() - start


def _drain(engine: Any) -> None:
    while engine.has_work():
        for event in engine.step():
            if event.finish_reason == "error":
                raise RuntimeError(f"warm-up request failed: {event.error}")
