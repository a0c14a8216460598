"""Bulk prefill through the engine: how fast a burst of long prompts gets its
first tokens, warm and cold.

The engine is built as the worker builds it (``build_engine`` with the worker's
defaults unless ``--max-batch-tokens`` is given), on a random-weight model of a
realistic shape. ``--requests`` prompts of about ``--prompt-tokens`` tokens
(+-10%, distinct random tokens, a different set every run) are added at once;
a run ends when every request has ``--gen`` tokens. Reported per run: the time
until every request had its first token and the prompt tokens/s over it, the
generated tokens/s end to end, and the inter-token latency of sequences that
were decoding while others prefilled (p50 / p99). The first run of a process
pays for compiling new shapes (cold); later ones are warm. Each run's greedy
tokens are digested: runs with the same index see the same prompts, so two
commands (a budget sweep, an older checkout) can be compared token for token.

    python3 benchmarks/prefill.py --shape qwen3-4b --requests 64 --prompt-tokens 1200 --gen 256 --runs 3
    python3 benchmarks/prefill.py --shape qwen3-4b --requests 64 --gen 1 --max-batch-tokens 4096 16384
    python3 benchmarks/prefill.py --shape qwen3-4b --requests 64 --gen 1 --runs 2 --trace
    python3 benchmarks/prefill.py --shape qwen3-4b --requests 64 --gen 256 --runs 2 --warm-up
    python3 benchmarks/prefill.py --shape qwen3-4b --requests 64 --gen 256 --runs 2 --warm-up --shapes
    python3 benchmarks/prefill.py --shape qwen3-4b --requests 64 --gen 1 --runs 2 --warm-up --host-profile

``--shapes`` sorts each run's steps by whether they met a prefill or decode shape
new to the process (what compiles cost) and lists the first run's slowest such steps.

``--ceiling`` also times the bare model (mlx-lm, no cache) over the same
prompts in right-padded forwards of the same budget: what the matmuls and the
attention alone cost, the ceiling of any cache.

To compare code trees, and a change against the spread between processes of one
build, ``--processes N --tree NAME=TREE ...`` runs the whole command in N fresh
processes per tree, the trees interleaved, and summarizes each tree's warm runs
(min / median / max over every process), its first runs against the same
process's warm median, and whether every tree gave the same tokens run by run:

    python3 benchmarks/prefill.py --requests 64 --prompt-tokens 1200 --gen 1 --runs 6 --warm-up \
        --processes 2 --tree before=<rev or dir> --tree after=.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import hashlib
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.common import command, device_trace, host_probe, machine, run_in_trees, spread, table  # noqa: E402
from benchmarks.engine import SHAPES, random_model  # noqa: E402
from kiviq.engine import Request, build_engine  # noqa: E402
from tests.engine_runs import IdTokenizer  # noqa: E402


COLUMNS = ["budget", "cap while decoding", "run", "", "all first tokens s", "prompt tok/s", "total s",
           "generated tok/s", "ITL in burst p50/p99 ms", "ITL after p50/p99 ms", "peak above held GiB",
           "KiB / budget token", "tokens"]


def make_prompts(run: int, n: int, tokens: int, vocab: int) -> list[list[int]]:
    """n distinct prompts of tokens +-10%, the same for the same run index."""
    rng = np.random.default_rng(1000 + run)
    lengths = rng.integers(int(tokens * 0.9), int(tokens * 1.1) + 1, size=n)
    return [rng.integers(10, vocab, size=int(m)).tolist() for m in lengths]


class ShapeLog:
    """The shapes each engine step ran (prefill rows x width, decode batch x table
    columns), and the wall time of steps that met a shape for the first time in the
    process (compiles: cuDNN graphs, traces, kernels) against steps of known shapes."""

    def __init__(self, engine, seen: set):
        self.seen = seen  # shapes met in this process (cuDNN graphs are per process)
        self.step_keys: list = []
        self.new = {"prefill": [0, 0.0], "decode": [0, 0.0], "known": [0, 0.0]}
        self.first_seen: list = []  # (key, seconds) of this run's new shapes
        runner, store = engine.runner, engine.runner.store
        decode, prefill, prefill_first = runner.decode, runner.prefill, runner.prefill_first
        begin_decode, widths = store.begin_decode, []

        def logged_begin(*a, **kw):
            batch = begin_decode(*a, **kw)
            widths.append(batch.block_tables.shape[1])
            return batch

        def logged_prefill_first(seqs, chunks, groups=None):  # the packed forward and its attention groups
            layout = runner.prefill_layout([len(c) for c in chunks], groups)
            self.step_keys.append(("prefill", layout.tokens, tuple((g.attention_rows, g.width) for g in layout.groups)))
            return prefill_first(seqs, chunks, groups)

        def logged_decode(seqs, tokens):
            widths.clear()
            out = decode(seqs, tokens)
            self.step_keys.append(("decode", len(seqs), widths[-1] if widths else 0))
            return out

        def logged_prefill(seq, tokens):
            self.step_keys.append(("chunk", 1, len(tokens)))
            return prefill(seq, tokens)

        runner.decode, runner.prefill, runner.prefill_first = logged_decode, logged_prefill, logged_prefill_first
        store.begin_decode = logged_begin

    def start_run(self) -> None:
        self.seen.update(self.step_keys)  # steps outside a run (a warm-up) are known shapes
        self.step_keys = []
        self.new = {"prefill": [0, 0.0], "decode": [0, 0.0], "known": [0, 0.0]}
        self.first_seen = []

    def step_done(self, seconds: float) -> None:
        keys, self.step_keys = self.step_keys, []
        fresh = [k for k in keys if k not in self.seen]
        self.seen.update(keys)
        kind = "known" if not fresh else "decode" if all(k[0] == "decode" for k in fresh) else "prefill"
        self.new[kind][0] += 1
        self.new[kind][1] += seconds
        if fresh:
            self.first_seen.append((fresh, seconds))

    def summary(self) -> str:
        p, d, k = (self.new[x] for x in ("prefill", "decode", "known"))
        return (f"{p[0]} steps with new prefill shapes {p[1]:.2f} s, {d[0]} with new decode shapes "
                f"{d[1]:.2f} s, {k[0]} of known shapes {k[1]:.2f} s")


def run_engine(engine, prompts: list[list[int]], gen: int, shapes: ShapeLog | None = None,
               on_step: Callable[[list], None] | None = None) -> dict:
    """Add every prompt at once and step until all are done; times the phases.
    ``on_step`` gets each step's events, as the worker's loop would."""
    mx.synchronize()
    start = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add(Request(str(i), p, gen))
    tokens = {str(i): [] for i in range(len(prompts))}
    last: dict[str, float] = {}
    first_all, gaps_burst, gaps = None, [], []
    if shapes:
        shapes.start_run()
    before = start
    while engine.has_work():
        events = engine.step()
        now = time.perf_counter()
        if shapes:
            shapes.step_done(now - before)
        before = now
        if on_step is not None:
            on_step(events)
        prefilling = bool(engine.scheduler.waiting or engine.scheduler.prefilling)
        for ev in events:
            if ev.finish_reason == "error":
                raise SystemExit(f"request {ev.request_id} failed: {ev.error}")
            if ev.request_id in last and ev.token_ids:
                (gaps_burst if prefilling else gaps).append(now - last[ev.request_id])
            if ev.token_ids:
                last[ev.request_id] = now
            tokens[ev.request_id] += ev.token_ids
        if first_all is None and len(last) == len(prompts):
            first_all = now - start
    total = time.perf_counter() - start
    digest = hashlib.sha256(repr(sorted(tokens.items())).encode()).hexdigest()[:12]
    return dict(first_all=first_all, total=total, generated=sum(map(len, tokens.values())),
                prompt=sum(map(len, prompts)), digest=digest, itl_burst=gaps_burst, itl=gaps)


def bare_model(model, prompts: list[list[int]], budget: int) -> float:
    """Seconds for the bare model (no cache) over the prompts in right-padded
    forwards of about ``budget`` tokens, longest first; logits of the last row only."""
    order = sorted(prompts, key=len, reverse=True)
    mx.synchronize()
    start = time.perf_counter()
    i = 0
    while i < len(order):
        width = len(order[i])
        rows = order[i: i + max(1, budget // width)]
        i += len(rows)
        x = mx.array([r + [0] * (width - len(r)) for r in rows])
        hidden = model.model(x)
        mx.eval(model.model.embed_tokens.as_linear(hidden[:, -1]))
    mx.synchronize()
    return time.perf_counter() - start


def pct(values: list[float], q: float) -> str:
    if not values:
        return "-"
    return f"{1e3 * float(np.percentile(values, q)):.0f}"


def across_processes(args) -> None:
    """``--processes`` / ``--tree``: per tree, the warm runs of every process (time to
    all first tokens, prompt tokens/s, generated tokens/s), each process's first run
    over its own warm median, and per run index whether every process of every tree
    gave the same tokens."""
    print(f"# {command()}\n# {machine()}\n")
    results = run_in_trees("prefill.py", args.trees, args.processes)

    rows = []
    for name, procs in results.items():
        warm = [r for p in procs for r in p["runs"] if r["state"] == "warm"]
        firsts = []
        for p in procs:
            own = [r["first_all"] for r in p["runs"] if r["state"] == "warm"]
            firsts += [r["first_all"] / statistics.median(own) for r in p["runs"] if r["state"] != "warm" and own]
        rows.append([name, len(procs), len(warm), spread([r["first_all"] for r in warm], ".2f"),
                     spread([r["prompt_tok_s"] for r in warm], ",.0f"), spread([r["generated_tok_s"] for r in warm], ",.0f"),
                     " ".join(f"{x:.2f}" for x in firsts) or "-",
                     spread([r["step_peak_bytes"] / 2**30 for r in warm if "step_peak_bytes" in r], ".2f"),
                     " ".join(f"{p['host_probe_ms']:.1f}" for p in procs)])
    print(f"\n{args.processes} fresh processes per tree, trees interleaved\n")
    print(table(["tree", "processes", "warm runs", "all first tokens s: min / median / max",
                 "prompt tok/s: min / median / max", "generated tok/s: min / median / max",
                 "first run / its process's warm median", "peak above held GiB: min / median / max",
                 "host probe ms per process"], rows))
    digests: dict[tuple, set] = {}
    for procs in results.values():
        for p in procs:
            for r in p["runs"]:
                digests.setdefault((r["budget"], r["cap"], r["run"]), set()).add(r["digest"])
    differ = [f"budget {b} cap {c or '-'} run {n}: {len(d)} different" for (b, c, n), d in digests.items() if len(d) > 1]
    print("\ntokens, run by run, every process of every tree: " + ("; ".join(differ) if differ else "the same"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="qwen3-4b", choices=sorted(SHAPES))
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--prompt-tokens", type=int, default=1200)
    p.add_argument("--gen", type=int, default=256, help="new tokens per request (1: prefill only)")
    p.add_argument("--runs", type=int, default=3, help="runs per budget in this process (the first is cold)")
    p.add_argument("--bits", type=int, default=4)
    p.add_argument("--max-batch-tokens", type=int, nargs="*", default=[None],
                   help="engine budgets to run (default: the worker's default)")
    p.add_argument("--prefill-while-decoding", type=int, nargs="*", default=[None], dest="prefill_while_decoding",
                   help="caps on a step's prompt tokens while sequences decode to run, one engine each "
                        "(the worker's --prefill-while-decoding; default: no cap); 0 is no cap")
    p.add_argument("--warm-up", action="store_true", dest="warm_up",
                   help="run the worker's warm-up (engine.warmup) before the first run, and time it")
    p.add_argument("--ceiling", action="store_true", help="also time the bare model over the same prompts")
    p.add_argument("--trace", action="store_true", help="trace the last run's device ops (CUDA, PyTorch)")
    p.add_argument("--same-prompts", action="store_true", dest="same_prompts",
                   help="every run gets the first run's prompts, so later runs meet no new shape")
    p.add_argument("--host-profile", action="store_true", dest="host_profile",
                   help="profile the last run's host functions (cProfile): where a burst's host time goes")
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--shapes", action="store_true",
                   help="per run: time in steps that met a new shape (compiles) against known ones, "
                        "and the --top slowest new-shape steps of the first run")
    p.add_argument("--processes", type=int, default=1,
                   help="run the whole command in N fresh processes per --tree, interleaved, and summarize")
    p.add_argument("--tree", action="append", dest="trees", metavar="NAME=TREE",
                   help="with --processes: a code tree, repeatable: NAME=. (the working tree), NAME=DIR or "
                        "NAME=<git revision> (extracted with git archive); default this=.")
    p.add_argument("--summary-json", dest="summary_json", help=argparse.SUPPRESS)  # a child of --processes
    args = p.parse_args()
    if args.processes < 1:
        raise SystemExit("--processes must be at least 1")
    if args.processes > 1 or args.trees:
        return across_processes(args)

    print(f"# {command()}\n# {machine()}\n")
    model = random_model(args.shape, getattr(mx, args.dtype), None)
    vocab = SHAPES[args.shape]["vocab_size"]
    rows, events, seen, profiles, summary = [], [], set(), [], []
    arms = [(budget, cap or None) for budget in args.max_batch_tokens for cap in args.prefill_while_decoding]
    for arm, (budget, cap) in enumerate(arms):
        options = {} if budget is None else {"max_batch_tokens": budget}
        engine = build_engine(model, IdTokenizer(), kv_bits=args.bits, max_sequences=args.requests,
                              prefill_while_decoding=cap, **options)
        budget = engine.scheduler.max_batch_tokens
        shapes = ShapeLog(engine, seen) if args.shapes else None
        if args.warm_up and not arm:  # what it compiles serves the later engines too
            from kiviq.engine.warmup import warm_up

            print(f"warm-up took {warm_up(engine, vocab):.1f} s", flush=True)
        for run in range(args.runs):
            prompts = make_prompts(0 if args.same_prompts else run, args.requests, args.prompt_tokens, vocab)
            last = run == args.runs - 1
            profile = cProfile.Profile() if args.host_profile and last else None
            mx.synchronize()
            held = mx.get_active_memory()  # weights, the KV store, the sampler's buffers
            mx.reset_peak_memory()
            with device_trace() if args.trace and last else contextlib.nullcontext([]) as ev:
                if profile is not None:
                    profile.enable()
                r = run_engine(engine, prompts, args.gen, shapes)
                if profile is not None:
                    profile.disable()
                    profiles.append(profile)
            events = ev or events
            step_peak = mx.get_peak_memory() - held  # what the run's steps needed on top
            # Compiled shapes stay with the process: only its first run is cold.
            state = "warm" if run or arm else "after warm-up" if args.warm_up else "cold"
            measured = dict(budget=budget, cap=cap, run=run, state=state, first_all=r["first_all"],
                            prompt_tok_s=r["prompt"] / r["first_all"], generated_tok_s=r["generated"] / r["total"],
                            digest=r["digest"], step_peak_bytes=step_peak)
            summary.append(measured)
            rows.append([budget, cap or "-", run, state, f"{r['first_all']:.2f}",
                         f"{measured['prompt_tok_s']:,.0f}", f"{r['total']:.2f}", f"{measured['generated_tok_s']:,.1f}",
                         f"{pct(r['itl_burst'], 50)} / {pct(r['itl_burst'], 99)}",
                         f"{pct(r['itl'], 50)} / {pct(r['itl'], 99)}", f"{step_peak / 2**30:.2f}",
                         f"{step_peak / budget / 1024:,.0f}", r["digest"]])
            print(table(COLUMNS, rows[-1:]), flush=True)
            if shapes:
                print(f"shapes, run {run}: {shapes.summary()}")
                for keys, seconds in sorted(shapes.first_seen, key=lambda x: -x[1])[:args.top if not run else 0]:
                    print(f"  {seconds * 1e3:8.1f} ms  {' '.join(f'{k}{r}x{w}' for k, r, w in keys)}")
                print(flush=True)
        del engine
    print(f"\n{args.requests} requests x ~{args.prompt_tokens} prompt tokens x {args.gen} new, "
          f"{args.shape} {args.dtype}, KIVI {args.bits}-bit\n")
    print(table(COLUMNS, rows))
    probe = host_probe()
    print(f"\nhost probe (a fixed pure-Python loop, best of 7; compare processes by it): "
          f"{probe['host_probe_ms']:.2f} ms on CPU {probe['host_cpu']}")
    if args.summary_json:
        with open(args.summary_json, "w") as f:
            json.dump(dict(runs=summary, **probe), f)
    if args.ceiling:
        prompts = make_prompts(0, args.requests, args.prompt_tokens, vocab)
        budget = rows[-1][0]
        times = [bare_model(model, prompts, budget) for _ in range(3)]
        n = sum(map(len, prompts))
        print(f"\nbare model, forwards of <= {budget} tokens: {n / statistics.median(times):,.0f} prompt tok/s "
              f"(median of {len(times)}; min {min(times):.2f} s, max {max(times):.2f} s)")
    for profile in profiles:
        from benchmarks.trace_summary import print_host_profile

        print("\nlast run's host time (the whole run as one 'step'):")
        print_host_profile(profile, 1, args.top)
    if args.trace:
        from benchmarks.trace_summary import summarize

        head, krows = summarize(events, 1, args.top)
        print(f"\ntraced run (whole run as one 'step'): {head}\n")
        print(table(["kernel", "us", "calls"], krows))


if __name__ == "__main__":
    main()
