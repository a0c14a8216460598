"""KV cache quality on the real model: perplexity and greedy agreement, fp vs KIVI.

Model: the default SmolLM2-135M-Instruct (``engine.load(None)``; float32 on CPU).

1. Perplexity, teacher-forced, on benchmarks/data/kjv_prose.txt (public-domain KJV
   prose; its '#' header lines are skipped; the text is encoded without special
   tokens and the first ``--tokens`` tokens are used). The sequence is fed in
   chunks of ``--chunk`` tokens through a cache, so every chunk attends to the
   past through that cache:
     * fp: mlx-lm's own KVCache (``make_prompt_cache``); checked against one
       full-sequence forward without a cache (logits equal within fp32 rounding);
     * KIVI: the real store (``KiviSequenceCache`` over a store from
       ``engine.kivi_cache.make_store``). With chunks of 32 and R=128, a chunk sees
       its own tokens and the last R..R+G-1 past tokens in full precision and
       everything older through quantized blocks. ``--chunk 1`` runs every token
       through the decode path (``KiviStore.decode_attend``) instead of prefill.
       ``2r`` in ``--bits`` is the worker's ``--kv-bits 2r``: the same store with K
       and V Hadamard-rotated (KVConfig.rotate), to compare with
       benchmarks/kv_quant_sim.py's ``rot-kv`` row.
     * bytes: each KIVI row reports the real pool's block bytes per token per layer
       (codes, scales, zeros: ``KiviStore.blocks.block_bytes / (G * layers)``) and,
       as benchmarks/kv_memory.py counts one 8192-token sequence, its blocks plus
       an fp16 tail slot of R + k*G tokens, over an fp16 cache's bytes (the
       issue-23 target convention; on a CPU the tails are float32, on a GPU fp16).
     * sanity: KIVI with R >= the whole text (nothing ever quantized) must equal fp.
   Perplexity = exp(mean NLL of tokens 1..N-1).

2. Greedy agreement: ``--prompts`` fixed chat-templated prompts x ``--max-tokens``
   new tokens through ``engine.build_engine`` (fp: kv_bits=16, the serial engine on
   mlx-lm's cache; KIVI: the batching engine over a KIVI store, all prompts at
   once unless --max-batch says otherwise). Generation is greedy and stops at EOS.

   First divergence of a KIVI output from the fp output: a generation is its
   tokens followed by its end (EOS, or the max-token cut); the first divergence
   is the first index i at which the two differ, where "one stopped at EOS at i,
   the other produced a token at i" counts as differing at i. Two identical
   generations (same tokens, same end) never diverge and score ``--max-tokens``.
   So a score of 256 means "never diverged", and a score s < 256 means the first
   s generated tokens were identical.
   Generated token i is predicted from len(prompt) + i cached tokens, so with
   short prompts nothing is quantized before token R + G - len(prompt) (printed
   per prompt). Sanity row: KIVI with R >= prompt + generation (nothing ever
   quantized) through the same batching engine: its divergences, if any, are
   batching/rounding noise, not quantization.

Run (CPU; the measured table is in docs/performance.md):
    PYTHONPATH=. python benchmarks/kv_quality.py
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

# The repository root first: run as a script, this file's folder would come first
# and benchmarks/engine.py would shadow the engine package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.common import command, machine, table  # noqa: E402

DATA = Path(__file__).parent / "data" / "kjv_prose.txt"

PROMPTS = [
    "What is the capital of France, and what river flows through it?",
    "Explain in three sentences why the sky is blue.",
    "Write a Python function that returns the n-th Fibonacci number iteratively.",
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "List five fruits that are high in vitamin C.",
    "How many days are there in a leap year, and why do leap years exist?",
    "Write a SQL query that selects the ten most recent orders from a table named orders.",
    "Describe the water cycle for a ten-year-old.",
    "Give me a packing list for a three-day hiking trip.",
    "What is the difference between a list and a tuple in Python?",
    "Write a haiku about autumn leaves.",
    "Summarize the plot of Romeo and Juliet in a paragraph.",
    "Write a JavaScript function that checks whether a string is a palindrome.",
    "What are the three primary colors, and how are secondary colors made?",
    "Tell a story about a robot learning to paint.",
    "List the planets of the solar system in order from the Sun.",
    "Explain what photosynthesis is and why it matters.",
    "Write a bash command that counts the lines in every .txt file in a directory.",
    "Give three tips for getting better sleep.",
    "Who wrote Pride and Prejudice, and what is it about?",
]


def load_text_tokens(tokenizer, n_tokens: int) -> list[int]:
    lines = DATA.read_text(encoding="utf-8").split("\n")
    body = "\n".join(line for line in lines if not line.startswith("#"))
    ids = tokenizer.encode(body, add_special_tokens=False)
    if len(ids) < n_tokens:
        raise SystemExit(f"{DATA} has only {len(ids)} tokens, asked for {n_tokens}")
    return ids[:n_tokens]


def chunked_nll(model, cache, tokens: list[int], chunk: int, reference_logits: mx.array | None = None
                ) -> tuple[np.ndarray, float]:
    """Teacher-forced NLL of tokens[1:] fed in chunks through ``cache``.

    Returns (nll per predicted token, max |logit - reference logit| or nan).
    """
    nlls, max_diff = [], 0.0
    n = len(tokens)
    for start in range(0, n - 1, chunk):
        end = min(start + chunk, n - 1)  # the last token is only a target
        logits = model(mx.array(tokens[start:end])[None], cache=cache)[0].astype(mx.float32)
        targets = mx.array(tokens[start + 1:end + 1])
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        nll = -mx.take_along_axis(logprobs, targets[:, None], axis=-1)[:, 0]
        if reference_logits is not None:
            diff = mx.max(mx.abs(logits - reference_logits[start:end]))
            mx.eval(nll, diff)
            max_diff = max(max_diff, diff.item())
        mx.eval(nll)
        nlls.append(np.array(nll))
    return np.concatenate(nlls), (max_diff if reference_logits is not None else float("nan"))


def full_forward_nll(model, tokens: list[int]) -> tuple[np.ndarray, mx.array]:
    """One forward over the whole sequence, no cache: NLL and logits [N-1, V]."""
    logits = model(mx.array(tokens[:-1])[None])[0].astype(mx.float32)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    nll = -mx.take_along_axis(logprobs, mx.array(tokens[1:])[:, None], axis=-1)[:, 0]
    mx.eval(nll, logits)
    return np.array(nll), logits


def kivi_cache(model, bits: int, group_size: int, residual: int, n_tokens: int, flush_blocks: int = 1,
               rotate: bool = False):
    from kiviq.engine.kivi_cache import KiviSequenceCache, make_store
    from kiviq.engine.kv_store import KVConfig

    store = make_store(model, KVConfig(bits, group_size, residual, flush_blocks, rotate=rotate), max_sequences=1,
                       context=n_tokens + group_size)
    return KiviSequenceCache(store)


def kv_name(bits: int, rotate: bool) -> str:
    """The ``--kv-bits`` name: '2r' for rotated 2-bit."""
    return f"{bits}{'r' if rotate else ''}"


def store_bytes(store, length: int = 8192) -> tuple[float, float]:
    """(block bytes per token per layer, x fp16 for one ``length``-token sequence):
    the sequence's blocks plus an fp16 tail slot of R + k*G tokens, as
    benchmarks/kv_memory.py counts it, over ``length`` fp16 tokens."""
    cfg, pool = store.config, store.pools[0]
    layers, h_kv, d = store.num_layers, pool.tail_k.shape[1], pool.tail_k.shape[3]
    per_token = store.blocks.block_bytes / (cfg.group_size * layers)
    fp16 = 2 * h_kv * d * 2
    tail_rows = cfg.residual + cfg.flush_tokens
    total = store.blocks.blocks_needed(length) * cfg.group_size * per_token + tail_rows * fp16
    return per_token, total / (length * fp16)


def ppl(nll: np.ndarray) -> float:
    return math.exp(float(np.mean(nll.astype(np.float64))))


def perplexity_section(model, tokenizer, args) -> None:
    from mlx_lm.models.cache import make_prompt_cache

    from kiviq.engine.kivi_cache import AttentionHook, attention_shape

    tokens = load_text_tokens(tokenizer, args.tokens)
    print(f"\n## Perplexity: {len(tokens)} tokens of {DATA.name}, chunks of {args.chunk}\n", flush=True)
    rows = []

    ref_logits = None
    if args.check:
        t0 = time.perf_counter()
        full_nll, ref_logits = full_forward_nll(model, tokens)
        print(f"  full forward (no cache): ppl {ppl(full_nll):.4f} ({time.perf_counter() - t0:.0f} s)", flush=True)
    t0 = time.perf_counter()
    fp_nll, diff = chunked_nll(model, make_prompt_cache(model), tokens, args.chunk, ref_logits)
    fp = ppl(fp_nll)
    print(f"  fp (mlx-lm KVCache): ppl {fp:.4f} ({time.perf_counter() - t0:.0f} s)", flush=True)
    if args.check:
        print(f"  check: chunked fp vs full forward: max |logit diff| {diff:.2e}, "
              f"max |NLL diff| {np.abs(fp_nll - full_nll).max():.2e}, "
              f"ppl {fp:.4f} vs {ppl(full_nll):.4f}", flush=True)
        del ref_logits
        assert diff < 1e-2, "chunked fp cache disagrees with the full forward"
    _, n_kv, head_dim = attention_shape(model)
    rows.append(["fp (mlx-lm KVCache, float32)", "-", "-", f"{fp:.4f}", "-", "-", 2 * n_kv * head_dim * 2, "1"])

    configs = [(b, rot, args.group_size, args.residual, k) for k in args.flush_blocks for b, rot in args.bits]
    configs += [(b, rot, g, r, 1) for b, rot, g, r in args.variants]
    if args.check:
        # Nothing is ever quantized when the tail holds the whole text: must be fp.
        r_all = -(-len(tokens) // args.group_size) * args.group_size
        configs.insert(0, (4, False, args.group_size, r_all, 1))
        if any(rot for _, rot, *_ in configs):  # the rotation alone changes nothing either
            configs.insert(1, (2, True, args.group_size, r_all, 1))
    for bits, rotate, g, r, k in configs:
        t0 = time.perf_counter()
        cache = kivi_cache(model, bits, g, r, len(tokens), k, rotate)
        with AttentionHook(model):  # the KIVI caches attend only through the hook
            nll, _ = chunked_nll(model, cache, tokens, args.chunk)
        quantized = cache.store.blocks.blocks_needed(len(tokens)) * g
        per_token, ratio = store_bytes(cache.store)
        cache.release()
        p = ppl(nll)
        label = f"KIVI {kv_name(bits, rotate)}" + (f", {k} blocks per flush" if k > 1 else "")
        label += " (sanity: R >= text, nothing quantized)" if r >= len(tokens) else ""
        print(f"  {label} G={g} R={r}: ppl {p:.4f} ({100 * (p / fp - 1):+.2f}%), "
              f"{quantized} of {len(tokens)} tokens quantized at the end, {per_token:g} B/token/layer, "
              f"{ratio:.4f}x fp16 at 8192 tokens ({time.perf_counter() - t0:.0f} s)", flush=True)
        if r >= len(tokens):
            assert abs(p / fp - 1) < 1e-3, "KIVI cache with nothing quantized should equal fp"
        rows.append([label, g, r, f"{p:.4f}", f"{100 * (p / fp - 1):+.2f}%", f"{float(np.mean(nll - fp_nll)):+.4f}",
                     f"{per_token:g}", f"{ratio:.4f}" if r < len(tokens) else "-"])
    print()
    print(table(["cache (--kv-bits)", "G", "R", "perplexity", "vs fp", "mean NLL - fp (nats)",
                 "block bytes/token/layer", "x fp16, 8192-token sequence with its tail"], rows))


def prompt_tokens(tokenizer, n: int) -> list[list[int]]:
    out = []
    for text in PROMPTS[:n]:
        rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                 add_generation_prompt=True, tokenize=False)
        out.append(tokenizer.encode(rendered, add_special_tokens=False))
    return out


def generate_all(model, tokenizer, prompts: list[list[int]], kv_bits: int, residual: int, args,
                 rotate: bool = False) -> list[tuple[list[int], str]]:
    """Greedy generations (tokens, finish reason) for every prompt, in prompt order."""
    from kiviq.engine import Request, build_engine

    kwargs = {}
    if kv_bits != 16:
        kwargs = dict(kv_group_size=args.group_size, kv_residual=residual, kv_rotate=rotate,
                      max_sequences=args.max_batch or len(prompts), kv_memory=args.kv_memory)
    engine = build_engine(model, tokenizer, kv_bits=kv_bits, **kwargs)
    results: dict[str, tuple[list[int], str | None]] = {}
    for i, p in enumerate(prompts):
        engine.add(Request(f"p{i}", p, max_tokens=args.max_tokens))
        results[f"p{i}"] = ([], None)
    while engine.has_work():
        for ev in engine.step():
            toks, _ = results[ev.request_id]
            toks.extend(ev.token_ids)
            if ev.finish_reason is not None:
                if ev.finish_reason not in ("stop", "length"):
                    raise RuntimeError(f"{ev.request_id} ended with {ev.finish_reason}: {ev.error}")
                results[ev.request_id] = (toks, ev.finish_reason)
    return [results[f"p{i}"] for i in range(len(prompts))]


def first_divergence(a: tuple[list[int], str], b: tuple[list[int], str], max_tokens: int) -> int:
    """Index of the first differing generated token, an EOS counting as a token
    (see the module docstring); ``max_tokens`` when the generations are identical."""
    ta, tb = a[0], b[0]
    n = min(len(ta), len(tb))
    for i in range(n):
        if ta[i] != tb[i]:
            return i
    if len(ta) == len(tb):
        return max_tokens  # same tokens and the same end (EOS at n, or the cut at max_tokens)
    return n  # one stopped (EOS) at n where the other went on


def greedy_section(model, tokenizer, args) -> None:
    prompts = prompt_tokens(tokenizer, args.prompts)
    g, r = args.group_size, args.residual
    print(f"\n## Greedy agreement: {len(prompts)} prompts x {args.max_tokens} new tokens "
          f"(G={g}, R={r})\n", flush=True)
    # (label, kv_bits, rotate, residual); fp = the serial engine on mlx-lm's cache.
    configs = [(f"KIVI {kv_name(b, rot)}", b, rot, r) for b, rot in args.bits]
    if args.check:
        # A tail longer than prompt + generation: nothing is quantized, so any
        # divergence here is the batching engine's rounding, not KIVI's.
        r_all = -(-(max(len(p) for p in prompts) + args.max_tokens) // g) * g
        configs.append((f"KIVI 4, R={r_all} (nothing quantized)", 4, False, r_all))
    fp_t0 = time.perf_counter()
    fp = generate_all(model, tokenizer, prompts, 16, r, args)
    print(f"  fp: {sum(len(t) for t, _ in fp)} tokens in {time.perf_counter() - fp_t0:.0f} s", flush=True)
    runs = []
    for label, bits, rotate, res in configs:
        t0 = time.perf_counter()
        runs.append(generate_all(model, tokenizer, prompts, bits, res, args, rotate))
        print(f"  {label}: {sum(len(t) for t, _ in runs[-1])} tokens in {time.perf_counter() - t0:.0f} s",
              flush=True)
    per_prompt = []
    for i in range(len(prompts)):
        # Generated token i is predicted from len(prompt) + i cached tokens; blocks
        # exist once the cache holds R + G tokens.
        row = [i, len(prompts[i]), f"{len(fp[i][0])} ({fp[i][1]})", max(0, r + g - len(prompts[i]))]
        row += [first_divergence(fp[i], run[i], args.max_tokens) for run in runs]
        per_prompt.append(row)
    print(table(["prompt", "prompt tokens", "fp tokens (end)", "first token reading a block"]
                + [f"{label}: first divergence" for label, *_ in configs], per_prompt))
    summary = []
    for j, (label, *_) in enumerate(configs):
        divs = [row[4 + j] for row in per_prompt]
        identical = sum(1 for i in range(len(prompts)) if runs[j][i] == fp[i])
        summary.append([label, f"{np.mean(divs):.1f}", min(divs), f"{np.median(divs):g}",
                        f"{identical}/{len(prompts)}"])
    print()
    print(table(["cache", "mean first divergence", "min", "median", "identical outputs"], summary))
    if args.save:
        import json

        data = {"prompts": PROMPTS[:len(prompts)], "prompt_tokens": prompts,
                "fp": [{"tokens": t, "end": e} for t, e in fp]}
        for (label, *_), run in zip(configs, runs):
            data[label] = [{"tokens": t, "end": e} for t, e in run]
        Path(args.save).write_text(json.dumps(data))
        print(f"\n  generations saved to {args.save}")


def parse_bits(text: str) -> tuple[int, bool]:
    """A KIVI ``--kv-bits`` name (2, 2r, 4, 8) -> (bits, rotate)."""
    from kiviq.engine.config import parse_kv_bits

    try:
        bits, rotate = parse_kv_bits(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if bits == 16:
        raise argparse.ArgumentTypeError("16 is the fp row, always run; give KIVI bits (2, 2r, 4, 8)")
    return bits, rotate


def parse_variant(text: str) -> tuple[int, bool, int, int]:
    bits, g, r = text.split("/")
    return (*parse_bits(bits), int(g), int(r))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=4096, help="perplexity: tokens of text")
    ap.add_argument("--chunk", type=int, default=32, help="perplexity: tokens per forward (1 = decode path)")
    ap.add_argument("--bits", type=parse_bits, nargs="+", default=[(8, False), (4, False), (2, False), (2, True)],
                    metavar="BITS", help="KIVI rows, as --kv-bits names them (default: 8 4 2 2r)")
    ap.add_argument("--group-size", type=int, default=32)
    ap.add_argument("--residual", type=int, default=128)
    ap.add_argument("--flush-blocks", type=int, nargs="+", default=[1],
                    help="perplexity: KVConfig.flush_blocks values to run at --group-size/--residual")
    ap.add_argument("--variants", type=parse_variant, nargs="*", default=[(2, False, 32, 256), (2, False, 16, 128)],
                    metavar="BITS/G/R", help="extra perplexity configs, BITS as in --bits (default: 2/32/256 2/16/128)")
    ap.add_argument("--prompts", type=int, default=len(PROMPTS), help=f"greedy: prompts (max {len(PROMPTS)})")
    ap.add_argument("--max-tokens", type=int, default=256, help="greedy: new tokens per prompt")
    ap.add_argument("--max-batch", type=int, default=0, help="greedy: KIVI sequences at once (0: all prompts)")
    ap.add_argument("--kv-memory", type=int, default=1 << 30, help="greedy: KIVI store budget in bytes")
    ap.add_argument("--save", metavar="FILE.json", help="greedy: write every generation's tokens here")
    ap.add_argument("--skip-perplexity", action="store_true")
    ap.add_argument("--skip-greedy", action="store_true")
    ap.add_argument("--no-check", dest="check", action="store_false",
                    help="skip the fp full-forward check and the nothing-quantized KIVI sanity runs")
    args = ap.parse_args()
    if not 1 <= args.prompts <= len(PROMPTS):
        ap.error(f"--prompts must be in 1..{len(PROMPTS)}")

    from kiviq.engine import load

    print(f"# {command()}")
    print(f"# {machine()}")
    t0 = time.perf_counter()
    model, tokenizer = load(None)
    print(f"# SmolLM2-135M-Instruct loaded in {time.perf_counter() - t0:.0f} s", flush=True)
    if not args.skip_perplexity:
        perplexity_section(model, tokenizer, args)
    if not args.skip_greedy:
        greedy_section(model, tokenizer, args)


if __name__ == "__main__":
    main()
