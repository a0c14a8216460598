"""Where a batched decode step's device time goes: a kernel-level trace.

The engine runs B sequences of a random-weight model (a ``--shape`` of
benchmarks/engine.py; prompts of ``context + i`` tokens, so the sequences
flush on different steps, as in a real batch), then ``--steps`` steps with
all B decoding are timed with ``mx.synchronize()`` at their edges.
``--arm mlxlm`` runs the same model on mlx-lm's own KV cache instead, one
request (B=1), as the reference for the B=1 target; ``--arm batchgen`` runs
mlx-lm's BatchGenerator on the same prompts, the reference for B > 1. Every arm
is timed the same way: steady-state decode steps of all B sequences (nobody
prefilling or finishing), each with ``mx.synchronize()`` at its edges, so a
step's host work and device work do not overlap in any arm (kiviq's engine runs
unpipelined by default, as the worker does).

With ``--trace`` (a CUDA device with PyTorch installed) those steps run under
``torch.profiler``: CUPTI records every kernel of the process, MLX's included.
The summary gives kernels per step, device busy time per step (the union of
kernel intervals) against the wall time (the rest is the device waiting for
the host: Python, graph building, MLX's per-op dispatch, syncs), and the
kernels grouped by name. A step whose KV tails flush is counted too: a flush
adds per-layer quantize and scatter work.

    python3 benchmarks/step_trace.py --shape qwen3-4b --batch 32 --context 4096 --steps 16 --trace
    python3 benchmarks/step_trace.py --arm mlxlm --batch 1 --context 4096 --trace
    python3 benchmarks/step_trace.py --batch 1 --host-profile
    python3 benchmarks/step_trace.py --arm batchgen --batch 32 --context 4096
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import mlx.core as mx  # noqa: E402

import engine.kv_store as kv_store_module  # noqa: E402
from benchmarks.common import command, machine, prefilled_engine, table  # noqa: E402
from benchmarks.engine import SHAPES, IdTokenizer, random_model  # noqa: E402

DEVICE_EVENTS = ("kernel", "gpu_memcpy", "gpu_memset")


def busy_time(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals."""
    total, end = 0.0, None
    for s, e in sorted(intervals):
        if end is None or s > end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total


def summarize(events: list[dict], steps: int, top: int) -> tuple[str, list[list]]:
    """The trace's headline and its per-kernel rows (us per step, calls per step)."""
    if not events:
        return "the trace holds no device events", []
    spans = [(e["ts"], e["ts"] + e["dur"]) for e in events]
    span = max(e for _, e in spans) - min(s for s, _ in spans)
    busy = busy_time(spans)
    head = (f"{len(events) / steps:.0f} device ops per step; device busy {busy / steps / 1e3:.2f} ms of a "
            f"{span / steps / 1e3:.2f} ms traced span per step ({100 * busy / span:.0f}%)")
    dur, calls = collections.Counter(), collections.Counter()
    for e in events:
        name = e["name"] if len(e["name"]) <= 80 else e["name"][:77] + "..."
        dur[name] += e["dur"]
        calls[name] += 1
    rows = [[name, f"{d / steps:.1f}", f"{calls[name] / steps:.1f}"] for name, d in dur.most_common(top)]
    return head, rows


def print_host_profile(host, steps: int, top: int) -> None:
    """The timed steps' host functions by own time (us per step), then by
    cumulative time: where the Python side of a step goes."""
    import pstats

    st = pstats.Stats(host)
    rows = []
    for (file, line, fn), (cc, nc, tt, ct, _) in st.stats.items():
        where = fn if file == "~" else f"{os.path.basename(file)}:{line} {fn}"
        rows.append((tt, ct, nc, where[:90]))
    for label, key in (("own", 0), ("cumulative", 1)):
        best = sorted(rows, key=lambda r: -r[key])[:top]
        print(f"\nhost functions by {label} time\n")
        print(table(["function", "own us / step", "cum us / step", "calls / step"],
                    [[w, f"{tt / steps * 1e6:.0f}", f"{ct / steps * 1e6:.0f}", f"{nc / steps:.1f}"]
                     for tt, ct, nc, w in best]))


def make_model(args):
    model = random_model(args.shape, getattr(mx, args.dtype), None)
    vocab = SHAPES[args.shape]["vocab_size"]
    prompts = [mx.random.randint(0, vocab, (args.context + i,), key=mx.random.key(i)).tolist()
               for i in range(args.batch)]
    return model, prompts


def engine_steps(args, model, prompts):
    """kiviq's engine, prefilled and warmed up: returns (one step, flush counts)."""
    engine = prefilled_engine(model, IdTokenizer(), prompts, args.warmup + args.steps + 2, bits=args.bits,
                              flush_blocks=args.flush_blocks)
    for _ in range(args.warmup):
        engine.step()
    flushes = []
    real_flush = kv_store_module.flush_layers

    def counted_flush(pools, slots, *a, **k):
        flushes.append(len(slots))
        return real_flush(pools, slots, *a, **k)

    kv_store_module.flush_layers = counted_flush

    def step():
        if len(engine.step()) != len(prompts):
            raise SystemExit(f"a timed step did not emit one event per sequence (B={len(prompts)})")
    return step, flushes


def mlxlm_steps(args, model, prompts):
    """mlx-lm's own KV cache, one request (B=1), greedy: the B=1 reference."""
    from mlx_lm.models.cache import make_prompt_cache

    if args.batch != 1:
        raise SystemExit("--arm mlxlm decodes one request: use --batch 1")
    cache = make_prompt_cache(model)
    logits = model(mx.array(prompts[0])[None], cache=cache)
    state = {"tok": mx.argmax(logits[:, -1], axis=-1)}
    mx.eval(state["tok"])

    def step():
        logits = model(state["tok"][:, None], cache=cache)
        state["tok"] = mx.argmax(logits[:, -1], axis=-1)
        state["tok"].item()  # the engine's step also ends with the tokens on the host
    for _ in range(args.warmup):
        step()
    return step, []


def batchgen_steps(args, model, prompts):
    """mlx-lm's BatchGenerator (its fp16/bf16 cache), every prompt in decode: the
    B > 1 reference. A call of `next_generated` is one decode step of the whole
    batch once nothing is left to prefill; it only returns then with B tokens."""
    from mlx_lm.generate import BatchGenerator

    b = len(prompts)
    gen = args.warmup + args.steps + b + 8  # decode steps taken while others still prefill, and slack
    bg = BatchGenerator(model, max_tokens=gen, completion_batch_size=b, prefill_batch_size=min(8, b))
    bg.insert(prompts, max_tokens=[gen] * b)
    while len(bg.next_generated()) < b:  # prefill (and the first decode steps) of everyone
        pass

    def step():
        if len(bg.next_generated()) != b:
            raise SystemExit(f"a timed BatchGenerator step did not return one token per sequence (B={b})")
    for _ in range(args.warmup):
        step()
    return step, []


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arm", default="kiviq", choices=["kiviq", "mlxlm", "batchgen"],
                   help="kiviq's engine, mlx-lm's own cache for one request (B=1), or mlx-lm's "
                        "BatchGenerator")
    p.add_argument("--shape", default="qwen3-4b", choices=sorted(SHAPES))
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--warmup", type=int, default=8)
    p.add_argument("--bits", type=int, default=4)
    p.add_argument("--flush-blocks", type=int, default=1, dest="flush_blocks",
                   help="kiviq: KIVI blocks quantized per flush (KVConfig.flush_blocks)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--trace", action="store_true", help="profile the timed steps with torch.profiler (CUDA)")
    p.add_argument("--host-profile", action="store_true", dest="host_profile",
                   help="profile the timed steps' host work with cProfile (Python functions and the "
                        "MLX calls they make; eval-time work shows under the call that waits)")
    p.add_argument("--top", type=int, default=25, help="kernel rows (and host functions) to print")
    args = p.parse_args()
    print(f"# {command()}\n# {machine()}\n")
    model, prompts = make_model(args)
    arms = {"kiviq": engine_steps, "mlxlm": mlxlm_steps, "batchgen": batchgen_steps}
    step, flushes = arms[args.arm](args, model, prompts)
    profiler = None
    if args.trace:
        import torch.profiler

        profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
        profiler.__enter__()
    host = None
    if args.host_profile:
        import cProfile

        host = cProfile.Profile()
        host.enable()
    times = []
    mx.synchronize()
    for _ in range(args.steps):
        t0 = time.perf_counter()
        step()
        mx.synchronize()
        times.append(time.perf_counter() - t0)
    if profiler is not None:
        profiler.__exit__(None, None, None)
    if host is not None:
        host.disable()
    ms = sorted(t * 1e3 for t in times)
    arm = {"kiviq": f"kiviq KIVI {args.bits}-bit, {args.flush_blocks} block(s) per flush", "mlxlm": "mlx-lm KVCache",
           "batchgen": "mlx-lm BatchGenerator"}[args.arm]
    print(f"{args.shape}, {args.dtype}, {arm}, B={args.batch}, context {args.context}: "
          f"{args.steps} steps, step ms min / median / max {ms[0]:.2f} / {statistics.median(ms):.2f} / "
          f"{ms[-1]:.2f}; {args.batch / statistics.median(ms) * 1e3:.0f} tok/s"
          + (f"; {len(flushes)} of the steps flushed ({sum(flushes)} tails)" if args.arm == "kiviq" else ""))
    if host is not None:
        print_host_profile(host, args.steps, args.top)
    if profiler is None:
        return
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        profiler.export_chrome_trace(path)
        with open(path) as f:
            trace = json.load(f)
    events = [e for e in trace.get("traceEvents", []) if e.get("cat") in DEVICE_EVENTS and "dur" in e]
    head, rows = summarize(events, args.steps, args.top)
    print(f"\n{head}\n")
    print(table(["device op", "us / step", "calls / step"], rows))


if __name__ == "__main__":
    main()
