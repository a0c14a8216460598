"""Which activation shapes the engine's steps hand to the model's quantized matmuls
while a batch is prefilled: no timing, runs anywhere (a tiny 4-bit model; the row
counts depend only on the prompts, the token budget and the scheduler).

MLX's CUDA quantized matmul picks its kernel from these shapes: M = the second-to-last
axis, the leading axes a batch of problems; `qmv` when M * batch < 8, otherwise `qmm_sm80`
with a tile height of 16, 32 or 64 rows from M, each tile height a kernel compiled on
first use (mlx/backend/cuda/quantized, 0.32). A shape the benchmark's warm-up never
produced compiles inside the timed run.

    python3 benchmarks/prefill_shapes.py --batch 32 --context 4096 --max-batch-tokens 8192
"""

from __future__ import annotations

import argparse
import collections
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402
from mlx_lm.utils import _get_classes  # noqa: E402

from benchmarks.engine import IdTokenizer, kivi_budget  # noqa: E402
from kiviq.engine import Request, build_engine  # noqa: E402

TINY = dict(model_type="llama", hidden_size=128, num_hidden_layers=1, intermediate_size=256,
            num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=512,
            rope_theta=10000.0, max_position_embeddings=131072, tie_word_embeddings=True)


def qmm_kernel(rows: tuple[int, ...]) -> str:
    """The kernel MLX 0.32's CUDA backend runs for activations whose leading axes are
    `rows` (group size 64, output width a multiple of 128, as in the Qwen3-4B shape)."""
    m = rows[-1] if rows else 1
    problems = 1
    for d in rows[:-1]:
        problems *= d
    if m * problems < 8:
        return "qmv"
    tile = max(16, min(64, 1 << (m - 1).bit_length()))
    return f"qmm_sm80 tile {tile}" + (f" x {problems} problems" if problems > 1 else "")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--gen", type=int, default=64)
    p.add_argument("--max-batch-tokens", type=int, default=8192, help="as benchmarks/engine.py builds the engine")
    args = p.parse_args()

    model_cls, args_cls = _get_classes(TINY)
    model = model_cls(args_cls.from_dict(TINY))
    nn.quantize(model, group_size=64, bits=4)
    seen: list[tuple[int, ...]] = []
    real = mx.quantized_matmul

    def spy(x, *a, **k):
        seen.append(tuple(x.shape[:-1]))
        return real(x, *a, **k)

    mx.quantized_matmul = spy
    engine = build_engine(model, IdTokenizer(), kv_bits=4, max_sequences=args.batch,
                          kv_memory=kivi_budget(model, 4, args.batch, args.context + args.gen),
                          max_batch_tokens=args.max_batch_tokens, compile_decode=False, pipeline=True,
                          flat_qmm=False)
    prompts = mx.random.randint(0, TINY["vocab_size"], (args.batch, args.context), key=mx.random.key(1)).tolist()
    for i, prompt in enumerate(prompts):
        engine.add(Request(str(i), prompt, args.gen))
    started, steps = set(), 0
    kernels = collections.Counter()
    per_forward = 7 * TINY["num_hidden_layers"] + 1  # q, k, v, o, gate, up, down per layer; the tied head
    print(f"# {' '.join(sys.argv)}\n")
    print("| step | forwards (activation rows: [problems,] M) | kernels (MLX 0.32 CUDA) |")
    print("|---|---|---|")
    while len(started) < args.batch:
        first = len(seen)
        events = engine.step()
        steps += 1
        started |= {e.request_id for e in events if e.token_ids}
        # Every matmul of a forward sees the same rows: one entry per forward.
        forwards = seen[first::per_forward]
        kinds = [qmm_kernel(s) for s in forwards]
        kernels.update(k.split(" x ")[0] + (" (batched)" if " x " in k else "") for k in kinds)
        print(f"| {steps} | {', '.join(str(list(s)) for s in forwards)} | {', '.join(kinds)} |")
    print(f"\n{steps} steps until every sequence had its first token; forwards by kernel: "
          + ", ".join(f"{k} {n}" for k, n in sorted(kernels.items())))


if __name__ == "__main__":
    main()
