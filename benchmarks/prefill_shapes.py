"""The prefill shapes a bulk workload meets, run after run, counted on any machine.

On a GPU each new shape costs a first run time: MLX builds a cuDNN attention
graph per attention shape (30-65 ms on the H200) and meets each new forward
shape once (~20-30 ms); docs/performance.md, "Bulk prefill". Which shapes a run
meets is decided by the engine's scheduling and padding alone, so this runs the
real engine (scheduler, first-chunk packing, splits, the warm-up) with the GPU's
padding multiples forced, on a tiny random model with the Qwen3-4B attention
shape, and counts per run: forwards, the distinct forward (rows, 1: first chunks
packed a row per token; a later chunk's (1, length)) and attention (rows, queries,
keys) shapes, and those that neither the warm-up nor
an earlier run met. Attention itself is skipped (only its shape matters), so it
takes seconds on a CPU. Beside the shapes, what a scheduling change trades them
against: the steps until every prompt has its first token (each a pass over the
model's weights) and the tokens the forwards computed, padding included, per prompt
token.

    python benchmarks/prefill_shapes.py --jobs 64 --prompt-tokens 1200 --runs 5 --budget 16384
"""

from __future__ import annotations

import argparse
import os
import random
import sys
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import mlx.core as mx  # noqa: E402

from benchmarks.common import command, table  # noqa: E402
from kiviq.engine import batch_engine, kivi_cache  # noqa: E402
from kiviq.engine.config import EngineConfig  # noqa: E402
from kiviq.engine.model_runner import PREFILL_CHUNK_MULTIPLE, PREFILL_WIDTH_MULTIPLE  # noqa: E402
from kiviq.engine.request import Request, SamplingParams  # noqa: E402
from kiviq.engine.setup import build_engine  # noqa: E402
from kiviq.engine.warmup import warm_up  # noqa: E402

VOCAB = 1024


class _Detokenizer:
    last_segment = ""

    def add_token(self, token: int) -> None:
        pass

    def finalize(self) -> None:
        pass


class _Tokenizer:
    eos_token_ids: set = set()


def tiny_model():
    """Qwen3-4B's attention (32 query heads, 8 kv heads, head_dim 128), 2 layers of hidden 64."""
    from mlx_lm.models import qwen3

    mx.random.seed(0)
    model = qwen3.Model(qwen3.ModelArgs(
        model_type="qwen3", hidden_size=64, num_hidden_layers=2, intermediate_size=64, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6, vocab_size=VOCAB, rope_theta=1e6,
        max_position_embeddings=40960, tie_word_embeddings=True))
    mx.eval(model.parameters())
    return model


class ShapeLog:
    """Records the shapes of the engine's prefill forwards and attention calls
    under the current ``phase``, while entered (the attention and the detokenizer
    are module functions, patched and restored)."""

    def __init__(self, engine):
        self.phase = "warm-up"
        self.shapes: dict[str, set] = defaultdict(set)
        self.forwards: dict[str, int] = defaultdict(int)
        self.tokens: dict[str, int] = defaultdict(int)  # rows x width of the forwards, padding included
        runner = engine.runner
        first, later = runner.prefill_first, runner.prefill

        def prefill_first(seqs, chunks, groups=None):  # one packed forward: a row per token
            self._forward(("forward", runner.prefill_layout([len(c) for c in chunks], groups).tokens, 1))
            return first(seqs, chunks, groups)

        def prefill(seq, tokens):
            self._forward(("forward", 1, len(tokens)))
            return later(seq, tokens)

        def attention(queries, keys, values, scale, *, rows=None, multiple=1):
            b, _, length, _ = queries.shape
            extra = -length % multiple
            self.shapes[self.phase].add(("attention", rows or b, length + extra, keys.shape[2] + extra))
            return mx.zeros_like(queries)

        runner.prefill_first, runner.prefill = prefill_first, prefill
        self._patches = [(kivi_cache, "causal_attention", attention),
                         (batch_engine, "make_detokenizer", lambda tokenizer: _Detokenizer())]
        self._saved: list = []

    def __enter__(self) -> "ShapeLog":
        self._saved = [(module, name, getattr(module, name)) for module, name, _ in self._patches]
        for module, name, value in self._patches:
            setattr(module, name, value)
        return self

    def __exit__(self, *exc) -> None:
        for module, name, value in self._saved:
            setattr(module, name, value)

    def _forward(self, shape: tuple) -> None:
        self.shapes[self.phase].add(shape)
        self.forwards[self.phase] += 1
        self.tokens[self.phase] += shape[1] * shape[2]


def gpu_engine(budget: int, width_multiple: int):
    """The engine as a GPU worker builds it, padding included, on the tiny model."""
    engine = build_engine(tiny_model(), _Tokenizer(), EngineConfig(max_batch_tokens=budget, max_sequences=128,
                                                                    kv_memory=4 << 30, compile_decode=False))
    engine.runner.prefill_width_multiple = width_multiple
    engine.runner.prefill_chunk_multiple = engine.scheduler.chunk_multiple = PREFILL_CHUNK_MULTIPLE
    return engine


def run_workload(engine, rng: random.Random, jobs: int, tokens: int, tag: str) -> tuple[int, int]:
    """``jobs`` prompts of ``tokens`` +-10% random tokens, two new tokens each, all at
    once. Returns the engine steps until every prompt had its first token, and the
    prompt tokens."""
    prompt_tokens = 0
    for i in range(jobs):
        n = rng.randint(int(tokens * 0.9), int(tokens * 1.1))
        prompt_tokens += n
        engine.add(Request(f"{tag}-{i}", [rng.randrange(10, VOCAB) for _ in range(n)], 2, SamplingParams()))
    started: set[str] = set()
    steps = 0
    while engine.has_work():
        events = engine.step()
        if len(started) < jobs:
            steps += 1
            started.update(ev.request_id for ev in events if ev.token_ids or ev.finish_reason)
    return steps, prompt_tokens


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--jobs", type=int, default=64)
    p.add_argument("--prompt-tokens", type=int, default=1200, help="mean prompt length (each +-10%%)")
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--budget", type=int, default=16384, help="tokens per step (the H200's default at Qwen3-4B)")
    p.add_argument("--width-multiple", type=int, default=PREFILL_WIDTH_MULTIPLE,
                   help="first chunks' forwards are padded to a multiple of this")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    engine = gpu_engine(args.budget, args.width_multiple)

    def count(shapes: set, kind: str) -> int:
        return sum(1 for s in shapes if s[0] == kind)

    rows = []
    with ShapeLog(engine) as log:
        warm_up(engine, VOCAB)
        known = set(log.shapes["warm-up"])
        rng = random.Random(args.seed)
        for run in range(1, args.runs + 1):
            log.phase = f"run {run}"
            steps, prompt_tokens = run_workload(engine, rng, args.jobs, args.prompt_tokens, log.phase)
            seen = log.shapes[log.phase]
            new = seen - known
            known |= seen
            rows.append([run, steps, f"{log.tokens[log.phase] / prompt_tokens:.3f}",
                         log.forwards[log.phase], count(seen, "forward"), count(seen, "attention"),
                         count(new, "forward"), count(new, "attention"),
                         ", ".join(f"{r}x{q}/{k}" for _, r, q, k in sorted(s for s in new if s[0] == "attention"))
                         or "-"])
    print(f"# {command()}")
    print(f"# {args.jobs} prompts of {args.prompt_tokens} +-10% tokens a run, {args.budget} tokens a step, first "
          f"chunks padded to {args.width_multiple}, splits to {PREFILL_CHUNK_MULTIPLE}; the warm-up met "
          f"{count(log.shapes['warm-up'], 'forward')} forward and {count(log.shapes['warm-up'], 'attention')} "
          f"attention shapes\n")
    print(table(["run", "steps to all first tokens", "forward tokens / prompt tokens", "forwards",
                 "forward shapes", "attention shapes", "new forward shapes", "new attention shapes",
                 "new attention: rows x queries / keys"], rows))


if __name__ == "__main__":
    main()
