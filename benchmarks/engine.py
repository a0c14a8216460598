"""Engine throughput: kiviq (KIVI 4/2-bit, continuous batching) vs mlx-lm's
BatchGenerator (fp16 cache) vs mlx-lm stream_generate (one request).

Random weights of a realistic shape (timing does not depend on weight
values). Greedy decoding; every arm gets the same prompts. Before timing,
the arms' tokens are compared and the agreement is printed: KIVI is lossy,
so kiviq is compared with its own fp16 serial engine on the first prompt
and with BatchGenerator on all (first-divergence index).

    python benchmarks/engine.py --shape qwen3-4b --batch 1 32 --context 512 4096 --gen 64
    python benchmarks/engine.py --model smollm2 --batch 1 8 32 --context 512 4096 --gen 64
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402
from mlx_lm.generate import BatchGenerator, generate_step  # noqa: E402
from mlx_lm.utils import _get_classes  # noqa: E402

from benchmarks.common import kv_budget  # noqa: E402
from kiviq.engine import Request, build_engine  # noqa: E402
from kiviq.engine.flat_quantized import flat_quantized_matmuls  # noqa: E402
from kiviq.engine.kivi_cache import attention_shape  # noqa: E402
from kiviq.engine.model_loading import dequantize_layers, load, weights_summary  # noqa: E402
from tests.engine_runs import IdTokenizer  # noqa: E402

SHAPES = {
    "qwen3-4b": dict(model_type="qwen3", hidden_size=2560, num_hidden_layers=36, intermediate_size=9728,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6,
                     vocab_size=151936, rope_theta=1000000.0, max_position_embeddings=40960,
                     tie_word_embeddings=True),
    "smollm2-135m": dict(model_type="llama", hidden_size=576, num_hidden_layers=30, intermediate_size=1536,
                         num_attention_heads=9, num_key_value_heads=3, rms_norm_eps=1e-5, vocab_size=49152,
                         rope_theta=100000.0, max_position_embeddings=8192, tie_word_embeddings=True),
}


def random_model(shape: str, dtype, quantize: int | None, dequantize: bool = False):
    """Random weights of `shape` in `dtype`; with `quantize`, quantized to that many bits,
    and with `dequantize` then dequantized back to `dtype` as the loader does it on a GPU
    (engine.model_loading.dequantize_layers): the quantized model's values, float matmuls."""
    model_cls, args_cls = _get_classes(SHAPES[shape])
    mx.random.seed(0)
    model = model_cls(args_cls.from_dict(SHAPES[shape]))
    model.set_dtype(dtype)
    if quantize:
        nn.quantize(model, group_size=64, bits=quantize)
        if dequantize:
            dequantize_layers(model, dtype)
    mx.eval(model.parameters())
    return model


def kivi_budget(model, bits: int, batch: int, tokens: int, flush_blocks: int = 1) -> int:
    """KV bytes B sequences of `tokens` tokens need in kiviq's store (tails + blocks,
    plus the scheduler's 64-token reserve and 64 MiB), so the pool is sized to the
    run, not to 64 GiB."""
    return kv_budget(model, bits, [tokens + 64] * batch, flush_blocks) + (64 << 20)


def fp16_cache_bytes(model, batch: int, tokens: int) -> int:
    """Bytes of mlx-lm's fp16/bf16 KV cache for B sequences of `tokens` tokens."""
    layers, n_kv, head_dim = attention_shape(model)
    return batch * tokens * layers * 2 * n_kv * head_dim * 2


def run_kiviq(model, prompts, gen, bits, flush_blocks=1, plain=False):
    """kiviq's engine as the worker builds it (compiled, pipelined decode steps);
    ``plain``: neither (each step built op by op and waited for). The model's
    quantized matmuls as they are: the worker's flat ones are the arm's
    (`flat_arm`), since the model is shared with the other arms. ``bits`` as
    ``--kv-bits`` names it (2r: the rotated 2-bit cache)."""
    from kiviq.engine.config import parse_kv_bits

    bits, rotate = parse_kv_bits(str(bits))
    budget = kivi_budget(model, bits, len(prompts), len(prompts[0]) + gen, flush_blocks)
    engine = build_engine(model, IdTokenizer(), kv_bits=bits, kv_rotate=rotate, kv_flush_blocks=flush_blocks,
                          max_sequences=len(prompts), kv_memory=budget, max_batch_tokens=8192,
                          compile_decode=not plain, pipeline=not plain, flat_qmm=False)
    out = {i: [] for i in range(len(prompts))}
    mx.synchronize()
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add(Request(str(i), p, gen))
    first_all = None
    while engine.has_work():
        for ev in engine.step():
            out[int(ev.request_id)] += ev.token_ids
        if first_all is None and all(out.values()):
            mx.synchronize()
            first_all = time.perf_counter()
    mx.synchronize()
    t1 = time.perf_counter()
    decode_tokens = sum(len(v) - 1 for v in out.values())
    return out, first_all - t0, decode_tokens / (t1 - first_all), mx.get_peak_memory()


def run_batchgen(model, prompts, gen):
    bg = BatchGenerator(model, max_tokens=gen, completion_batch_size=len(prompts),
                        prefill_batch_size=min(8, len(prompts)))
    mx.synchronize()
    t0 = time.perf_counter()
    uids = bg.insert(prompts, max_tokens=[gen] * len(prompts))
    index = {u: i for i, u in enumerate(uids)}
    out = {i: [] for i in range(len(prompts))}
    first_all = None
    done = set()
    while len(done) < len(prompts):
        for r in bg.next_generated():
            out[index[r.uid]].append(r.token)
            if r.finish_reason is not None:
                done.add(r.uid)
        if first_all is None and all(out.values()):
            mx.synchronize()
            first_all = time.perf_counter()
    mx.synchronize()
    t1 = time.perf_counter()
    bg.close()
    decode_tokens = sum(len(v) - 1 for v in out.values())
    return out, first_all - t0, decode_tokens / (t1 - first_all), mx.get_peak_memory()


def run_single(model, prompt, gen):
    mx.synchronize()
    t0 = time.perf_counter()
    toks, first = [], None
    # stream_generate's token loop, minus the detokenizer random weights lack.
    for token, _ in generate_step(mx.array(prompt), model, max_tokens=gen):
        toks.append(int(token))
        if first is None:
            first = time.perf_counter()
    mx.synchronize()
    t1 = time.perf_counter()
    return {0: toks}, first - t0, (len(toks) - 1) / (t1 - first), mx.get_peak_memory()


def flat_arm(model, fn):
    """`fn` run with `model`'s quantized matmuls flattened (restored after)."""
    def run(prompts):
        with flat_quantized_matmuls(model):
            return fn(prompts)
    return run


def first_divergence(a: list[int], b: list[int]) -> int:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="qwen3-4b", choices=sorted(SHAPES))
    p.add_argument("--model", default=None,
                   help="real weights instead of --shape: a model path, or 'smollm2' for the packaged "
                        "SmolLM2-135M-Instruct (engine.model_loading.load)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--quantize", type=int, default=None, help="quantize weights to this many bits")
    p.add_argument("--dequantize", action=argparse.BooleanOptionalAction, default=None,
                   help="with --model: as engine.model_loading.load(dequantize=...) (default: the loader's "
                        "choice for this device); with --quantize: dequantize the quantized weights back "
                        "to --dtype (default: keep them quantized)")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    p.add_argument("--context", type=int, nargs="+", default=[512, 4096])
    p.add_argument("--gen", type=int, default=64)
    p.add_argument("--bits", nargs="+", default=["4", "2"], choices=["2", "2r", "4", "8"],
                   help="kiviq arms, as --kv-bits names them (2r: rotated 2-bit, arm kiviq-2rbit)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--flush-blocks", type=int, nargs="+", default=[1],
                   help="kiviq: KIVI blocks quantized per flush; several values run one kiviq arm each "
                        "(named kiviq-<b>bit-k<K> for K != 1)")
    p.add_argument("--max-kv-gb", type=float, default=100.0,
                   help="skip an arm whose KV cache would need more than this")
    p.add_argument("--plain-arm", action="store_true",
                   help="also run kiviq 4-bit with plain decode steps (not compiled, not pipelined)")
    p.add_argument("--qmm-ab", action="store_true", dest="qmm_ab",
                   help="with and without the flat quantized matmuls (engine.flat_quantized; kiviq arms use them by "
                        "default): also run batchgen with them (batchgen-flat) and each kiviq arm without "
                        "them (<arm>-unflat)")
    p.add_argument("--arms", nargs="+", default=None,
                   help="subset of arms: batchgen kiviq-4bit kiviq-2bit kiviq-2rbit single")
    args = p.parse_args()
    if not mx.metal.is_available() and not (hasattr(mx, "cuda") and mx.cuda.is_available()):
        print("note: no GPU backend; CPU numbers are not the target of this benchmark", file=sys.stderr)
    if args.model:
        model = load(None if args.model == "smollm2" else args.model, dequantize=args.dequantize)[0]
        vocab = model.args.vocab_size
        what = (f"{args.model} real weights, as engine.model_loading loads them (dequantize={args.dequantize}: "
                f"{weights_summary(model)})")
    else:
        model = random_model(args.shape, getattr(mx, args.dtype), args.quantize, bool(args.dequantize))
        vocab = SHAPES[args.shape]["vocab_size"]
        weights = f"{args.quantize}-bit" + (", dequantized" if args.dequantize else "") if args.quantize else "unquantized"
        what = f"{args.shape} random weights, {args.dtype}, weights {weights}"
    print(f"# {what}; greedy, {args.gen} new tokens; repeats {args.repeats} (min/median/max of decode tok/s)")
    print("| B | context | arm | decode tok/s (min/med/max) | TTFT all s (min / med) | peak GB | agreement vs batchgen "
          "| tokens of the first repeat (sha256; equal across processes on the same weights) |")
    print("|---|---|---|---|---|---|---|---|")
    for b in args.batch:
        for ctx in args.context:
            arms = [("batchgen", lambda ps: run_batchgen(model, ps, args.gen))]
            # kiviq's arms run with flat quantized matmuls, as the worker does.
            kiviq = {f"kiviq-{k}bit" + (f"-k{fb}" if fb != 1 else ""):
                     (lambda k, fb: lambda ps: run_kiviq(model, ps, args.gen, k, flush_blocks=fb))(k, fb)
                     for k in args.bits for fb in args.flush_blocks}
            arms += [(name, flat_arm(model, fn)) for name, fn in kiviq.items()]
            if args.plain_arm:
                arms.append(("kiviq-4bit-plain",
                             flat_arm(model, lambda ps: run_kiviq(model, ps, args.gen, 4, plain=True))))
            if args.qmm_ab:
                arms += [("batchgen-flat", flat_arm(model, lambda ps: run_batchgen(model, ps, args.gen)))]
                arms += [(f"kiviq-{k}bit-unflat", (lambda k: lambda ps: run_kiviq(model, ps, args.gen, k))(k))
                         for k in args.bits]
            if b == 1:
                arms.append(("mlx-lm single", lambda ps: run_single(model, ps[0], args.gen)))
            if args.arms:
                arms = [(n, f) for n, f in arms
                        if n in args.arms or n.rsplit("-k", 1)[0] in args.arms
                        or (n == "mlx-lm single" and "single" in args.arms)]
            skipped = []
            fp16_gb = fp16_cache_bytes(model, b, ctx + args.gen) / 1e9
            if fp16_gb > args.max_kv_gb:
                skipped = [n for n, _ in arms if n in ("batchgen", "mlx-lm single")]
                arms = [(n, f) for n, f in arms if n not in skipped]
            for name in skipped:
                print(f"| {b} | {ctx} | {name} | not run: fp16 cache needs {fp16_gb:.0f} GB "
                      f"(> {args.max_kv_gb:.0f}) | - | - | - |", flush=True)
            if not arms:
                continue
            # Warm-up (untimed): compiles every kernel the arms use at this batch size.
            warm = mx.random.randint(0, vocab, (b, min(ctx, 160)), key=mx.random.key(7)).tolist()
            for name, fn in arms:
                fn(warm)
                mx.clear_cache()
            results = {name: [] for name, _ in arms}
            tokens = {}
            failed = {}  # arm -> why it stopped (out of device memory)
            for rep in range(args.repeats):  # arms interleaved, fresh prompts each repeat
                key = mx.random.key(1000 * rep + b * 7 + ctx)
                prompts = mx.random.randint(0, vocab, (b, ctx), key=key).tolist()
                for name, fn in arms:
                    if name in failed:
                        continue
                    mx.reset_peak_memory()
                    try:
                        out, ttft, tps, peak = fn(prompts)
                    except RuntimeError as e:
                        if "out of memory" not in str(e):
                            raise
                        # A system that cannot hold the batch is a result, not a crash:
                        # the other arms still run.
                        failed[name] = f"out of device memory (peak {mx.get_peak_memory() / 1e9:.0f} GB)"
                    if name in failed:  # outside the handler: its traceback holds the arm's arrays
                        gc.collect()
                        mx.clear_cache()
                        continue
                    results[name].append((tps, ttft, peak))
                    tokens.setdefault(name, out)
                    mx.clear_cache()
            for name, why in failed.items():
                print(f"| {b} | {ctx} | {name} | failed: {why} | - | - | - | - |", flush=True)
            arms = [(n, f) for n, f in arms if n not in failed]
            if not arms:
                continue
            ref_name = "batchgen" if "batchgen" in tokens else arms[0][0]
            ref = tokens[ref_name]
            vs = "" if ref_name == "batchgen" else f" (vs {ref_name})"
            for name, _ in arms:
                tps = sorted(r[0] for r in results[name])
                # min as well as median: a one-time cost in one repeat (MLX compiling a
                # kernel for a shape the warm-up did not reach) shows as a gap.
                ttfts = sorted(r[1] for r in results[name])
                ttft = f"{ttfts[0]:.2f} / {ttfts[len(ttfts) // 2]:.2f}"
                peak = max(r[2] for r in results[name]) / 1e9
                agree = sum(first_divergence(tokens[name][i], ref[i]) for i in ref) / len(ref)
                digest = hashlib.sha256(repr(sorted(tokens[name].items())).encode()).hexdigest()[:12]
                print(f"| {b} | {ctx} | {name} | {tps[0]:.0f} / {tps[len(tps) // 2]:.0f} / {tps[-1]:.0f} | "
                      f"{ttft} | {peak:.1f} | mean first divergence {agree:.1f} of {args.gen}{vs} | {digest} |",
                      flush=True)


if __name__ == "__main__":
    main()
