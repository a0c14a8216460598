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
kernels grouped by name, one layer's ops in launch order, and the host's CUDA
runtime/driver calls per step (MLX adding graph nodes, capturing cuBLAS matmuls,
updating and launching graphs). A step whose KV tails flush is counted too: a
flush adds per-layer quantize and scatter work.

    python3 benchmarks/step_trace.py --shape qwen3-4b --batch 32 --context 4096 --steps 16 --trace
    python3 benchmarks/step_trace.py --arm mlxlm --batch 1 --context 4096 --trace
    python3 benchmarks/step_trace.py --batch 1 --host-profile
    python3 benchmarks/step_trace.py --arm batchgen --batch 32 --context 4096

Several ``--arm``s run in one process on the same model and prompts, their timed
steps interleaved in ``--rounds`` rounds (the first arm rotating), and every arm's
tokens are compared with the first arm's (the A/B form):

    python3 benchmarks/step_trace.py --batch 32 --steps 32 --rounds 4 --warmup 100 \
        --arm kiviq --arm kiviq,flush_blocks=4 --arm batchgen

Against older code, and to judge a change against the spread between processes of
one build (it can be 1.5x), run each code tree in several fresh processes,
interleaved, with ``--processes N --tree NAME=REV`` (an older tree runs its own
copy of this script, so it needs one that writes ``--summary-json``, d3f22a7 on):

    python3 benchmarks/step_trace.py --batch 32 --warmup 60 --steps 32 \
        --arm kiviq,compile=1,pipeline=1,table=32 --processes 4 --tree before=20b8689 --tree after=.

Each process is also listed on its own: its median step, the CPU time of the whole
process per step (every thread: the host's work), its decode steps run plain,
replayed compiled and traced, and with ``--trace`` the device's busy time per step
(under the profiler): whether a slow process waits on the host or on the GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import mlx.core as mx  # noqa: E402

from benchmarks.common import (API_EVENTS, DEVICE_EVENTS, command, device_trace, host_probe, machine,  # noqa: E402
                               prefilled_engine, table)
from benchmarks.trace_summary import print_host_profile, print_trace  # noqa: E402
from benchmarks.engine import SHAPES, random_model  # noqa: E402
from kiviq.engine.config import KV_BITS_NAMES, parse_kv_bits  # noqa: E402
from kiviq.engine.flat_quantized import flat_quantized_matmuls  # noqa: E402
from tests.engine_runs import IdTokenizer  # noqa: E402


def make_model(args):
    model = random_model(args.shape, getattr(mx, args.dtype), args.quantize)
    vocab = SHAPES[args.shape]["vocab_size"]
    prompts = [mx.random.randint(0, vocab, (args.context + i,), key=mx.random.key(i)).tolist()
               for i in range(args.batch)]
    return model, prompts


class Arm:
    """One configuration under test, from ``--arm NAME[,KEY=VALUE...]``: kiviq
    (keys ``flush_blocks``, ``bits``, ``pipeline``,
    ``compile``: decode steps through mx.compile, engine.compiled_decode,
    ``table``: KiviStore.table_width_multiple, ``slots``: the store's tails),
    mlxlm (key ``pipeline``: mlx-lm's own ``generate_step``, which builds step
    n+1 while step n runs, as ``stream_generate`` does) or batchgen. Any arm takes
    ``flatqmm=1|0``: the model's quantized matmuls see all rows at once while this
    arm builds and steps (engine.flat_quantized; with ``--quantize``); the default
    is each system's own: 1 for kiviq (its engine's default), 0 for mlx-lm's. A step runs
    one decode step of every sequence; ``history`` holds every sequence's tokens
    so far (prefill and warm-up included), so arms are compared token by token.

    Unpipelined arms are timed step by step with ``mx.synchronize()`` at each
    step's edges. A pipelined arm overlaps consecutive steps by design, so only
    its blocks of ``--steps`` steps are synchronized at their edges, and each of
    its steps is timed as it returns (in steady state, the time between two
    tokens)."""

    def __init__(self, spec: str, args):
        name, *pairs = spec.split(",")
        self.spec, self.name = spec, name
        self.opts = dict(p.split("=", 1) for p in pairs)
        known = {"kiviq": {"flush_blocks", "bits", "pipeline", "compile", "table", "slots"},
                 "mlxlm": {"pipeline"},
                 "batchgen": set()}
        if name not in known or set(self.opts) - known[name] - {"flatqmm"}:
            raise SystemExit(f"--arm {spec}: expected kiviq[,flush_blocks=K]"
                             "[,bits=B|2r][,pipeline=1][,compile=1][,table=N][,slots=N], "
                             "mlxlm[,pipeline=1] or batchgen, each optionally with ,flatqmm=1|0")
        try:  # (kv_bits, rotate): '2r' is 2-bit with K and V Hadamard-rotated
            self.kv_bits = parse_kv_bits(self.opts.get("bits", args.bits))
        except ValueError as e:
            raise SystemExit(f"--arm {spec}: {e}") from None
        self.pipelined = self.opts.get("pipeline", "0") == "1"
        self.flat_qmm = self.opts.get("flatqmm", "1" if name == "kiviq" else "0") == "1"
        self.model = None
        self.flushes: list[int] = []
        self.times: list[float] = []
        self.flushed: list[bool] = []  # per timed step: did a tail flush in it
        self.growth: list[int] = []  # per timed step: bytes its peak rose above the memory active at its start
        self.cpu: list[float] = []  # per timed step: CPU seconds of the whole process (all its threads)
        self.history: list[list[int]] = []

    def build(self, args, model, prompts) -> None:
        self.model = model
        with self.flat():
            if self.name == "kiviq":
                self._step = engine_steps(args, model, prompts, self.flushes, self.history,
                                          kv_bits=self.kv_bits,
                                          flush_blocks=int(self.opts.get("flush_blocks", args.flush_blocks)),
                                          pipeline=self.pipelined, compile_decode=self.opts.get("compile") == "1",
                                          table_width_multiple=int(self.opts.get("table", 1)),
                                          slots=int(self.opts["slots"]) if "slots" in self.opts else None)
            elif self.name == "mlxlm":
                self._step = mlxlm_steps(args, model, prompts, self.history, pipeline=self.pipelined)
            else:
                self._step = batchgen_steps(args, model, prompts, self.history)

    def flat(self):
        """This arm's flat quantized matmuls (or none) while it builds and steps."""
        return flat_quantized_matmuls(self.model) if self.flat_qmm else contextlib.nullcontext()

    def timed_steps(self, n: int) -> None:
        with self.flat():
            mx.synchronize()
            for _ in range(n):
                flushes = len(self.flushes)
                # Memory a step allocates beyond what was active at its start: a write
                # that could not happen in place copies a whole layer's tails (or pool).
                # Pipelined, the peak may be reached while the next step is built, so a
                # step's growth also holds the overlap of two steps' working memory.
                base = mx.get_active_memory()
                mx.reset_peak_memory()
                c0, t0 = time.process_time(), time.perf_counter()
                self._step()
                if not self.pipelined:
                    mx.synchronize()
                self.times.append(time.perf_counter() - t0)
                self.cpu.append(time.process_time() - c0)
                self.growth.append(mx.get_peak_memory() - base)
                self.flushed.append(len(self.flushes) > flushes)
            mx.synchronize()

    def summary(self) -> dict:
        """What ``--summary-json`` keeps of this arm (one process of ``--processes``)."""
        out = {"median_ms": statistics.median(self.times) * 1e3,
               "cpu_ms": statistics.median(self.cpu) * 1e3, "digest": self.digest, **host_probe()}
        engine = getattr(self._step, "engine", None)  # kiviq arms only
        if engine is not None and engine.runner.compiled is not None:
            out["decode_steps"] = dict(engine.runner.compiled.stats)  # since the engine was built
        return out

    @property
    def digest(self) -> str:
        """Of every sequence's tokens: equal digests, equal tokens."""
        return hashlib.sha1(repr(self.history).encode()).hexdigest()[:10]

    @property
    def label(self) -> str:
        names = {"mlxlm": "mlx-lm KVCache", "batchgen": "mlx-lm BatchGenerator"}
        return self.spec.replace(self.name, names[self.name], 1) if self.name in names else self.spec


def engine_steps(args, model, prompts, flushes: list[int], history: list[list[int]], *,
                 kv_bits: tuple[int, bool], flush_blocks: int, pipeline: bool, compile_decode: bool, table_width_multiple: int,
                 slots: int | None):
    """kiviq's engine, prefilled and warmed up: returns one step. ``flushes``
    gets the number of flushing tails of every timed flush; ``history`` each
    sequence's tokens (a pipelined engine emits a step's tokens one step late).
    ``slots``: the store's tails (default B); a worker holds ``--max-sequences``
    (32) whatever the batch, and a write that cannot happen in place copies a
    layer's tails whole. ``kv_bits``: (bits, rotate) as ``parse_kv_bits`` gives them."""
    bits, rotate = kv_bits
    engine = prefilled_engine(model, IdTokenizer(), prompts, args.warmup + args.rounds * args.steps + 2,
                              bits=bits, rotate=rotate, flush_blocks=flush_blocks, compile_decode=compile_decode,
                              max_sequences=slots)
    engine.pipeline = pipeline
    engine.kv_store.table_width_multiple = table_width_multiple
    history += [list(engine._seqs[str(i)].generated) for i in range(len(prompts))]
    # Count this engine's flushing tails while its own steps are timed: the tails at the
    # brim when a step begins (on CUDA the flush is part of the step's graph, so it is
    # counted from the sequences, not from a flush call).
    state = {"timing": False}
    store = engine.kv_store
    brim = store.config.residual + store.config.flush_tokens - 1
    real = store.begin_decode

    def counted_begin(seqs, *a, **k):
        if state["timing"]:
            n = sum(s.tail_lens[0] == brim for s in seqs)
            if n:
                flushes.append(n)
        return real(seqs, *a, **k)

    store.begin_decode = counted_begin

    def step():
        events = engine.step()
        for e in events:
            if e.finish_reason is not None:
                raise SystemExit(f"sequence {e.request_id} ended during the run ({e.finish_reason})")
            history[int(e.request_id)] += e.token_ids
        if len(events) != len(prompts) and not (pipeline and not events):
            raise SystemExit(f"a step emitted {len(events)} events, not one per sequence (B={len(prompts)})")
    for _ in range(args.warmup):
        step()

    def timed():
        state["timing"] = True
        step()
        state["timing"] = False
    timed.engine = engine  # the arm's summary reads its compiled-step counts
    return timed


def mlxlm_steps(args, model, prompts, history: list[list[int]], *, pipeline: bool):
    """mlx-lm's own KV cache, one request (B=1), greedy: the B=1 reference.
    Pipelined: mlx-lm's ``generate_step`` itself (what ``stream_generate`` runs)."""
    from mlx_lm.models.cache import make_prompt_cache

    if args.batch != 1:
        raise SystemExit("--arm mlxlm decodes one request: use --batch 1")
    history.append([])
    if pipeline:
        from mlx_lm.generate import generate_step

        tokens = generate_step(mx.array(prompts[0]), model, max_tokens=-1)

        def step():
            history[0].append(int(next(tokens)[0]))
        step()  # the prefill and the first token
    else:
        cache = make_prompt_cache(model)
        logits = model(mx.array(prompts[0])[None], cache=cache)
        state = {"tok": mx.argmax(logits[:, -1], axis=-1)}
        history[0].append(state["tok"].item())

        def step():
            logits = model(state["tok"][:, None], cache=cache)
            state["tok"] = mx.argmax(logits[:, -1], axis=-1)
            history[0].append(state["tok"].item())  # the engine's step also ends with the tokens on the host
    for _ in range(args.warmup):
        step()
    return step


def batchgen_steps(args, model, prompts, history: list[list[int]]):
    """mlx-lm's BatchGenerator (its fp16/bf16 cache), every prompt in decode: the
    B > 1 reference. A call of `next_generated` is one decode step of the whole
    batch once nothing is left to prefill; it only returns then with B tokens."""
    from mlx_lm.generate import BatchGenerator

    b = len(prompts)
    gen = args.warmup + args.rounds * args.steps + b + 8  # steps taken while others still prefill, and slack
    bg = BatchGenerator(model, max_tokens=gen, completion_batch_size=b, prefill_batch_size=min(8, b))
    uids = bg.insert(prompts, max_tokens=[gen] * b)
    order = {u: i for i, u in enumerate(uids)}
    history += [[] for _ in prompts]

    def record(out):
        for r in out:
            history[order[r.uid]].append(int(r.token))
        return len(out)
    while record(bg.next_generated()) < b:  # prefill (and the first decode steps) of everyone
        pass

    def step():
        if record(bg.next_generated()) != b:
            raise SystemExit(f"a timed BatchGenerator step did not return one token per sequence (B={b})")
    for _ in range(args.warmup):
        step()
    return step


def report(arms: list[Arm], args) -> None:
    """Per arm: step time min / median / mean / max, throughput from the mean
    (flushing steps included: the steady-state rate), flushes, and how many of
    its tokens equal the first arm's at the same position of the same sequence
    (over the length both produced)."""
    rows = []
    for arm in arms:
        ms = sorted(t * 1e3 for t in arm.times)
        mean = statistics.fmean(ms)
        pairs = [(a, b) for mine, first in zip(arm.history, arms[0].history) for a, b in zip(mine, first)]
        same = sum(a == b for a, b in pairs)
        flushed = (f"{len(arm.flushes)} ({sum(arm.flushes)} tails)" if arm.name == "kiviq" else "-")
        split = _flushing_and_other([t * 1e3 for t in arm.times], arm.flushed, statistics.fmean, "{:.2f}")
        growth = _flushing_and_other([g / 2**20 for g in arm.growth], arm.flushed, max, "{:.0f}")
        rows.append([arm.label, len(ms), f"{ms[0]:.2f} / {statistics.median(ms):.2f} / {mean:.2f} / {ms[-1]:.2f}",
                     f"{args.batch / mean * 1e3:.0f}", flushed, split, growth, f"{same} / {len(pairs)}", arm.digest])
    weights = f"{args.quantize}-bit weights" if args.quantize else "unquantized weights"
    print(f"{args.shape}, {args.dtype}, {weights}, B={args.batch}, context {args.context}, {args.rounds} round(s) of "
          f"{args.steps} steps per arm, arms interleaved (first arm rotating)\n")
    print(table(["arm", "steps", "step ms min / median / mean / max", "tok/s (mean)", "steps that flushed",
                 "mean ms: flushing / other steps", "max MiB over step start: flushing / other",
                 "tokens = first arm's", "digest of all tokens"], rows))


def _flushing_and_other(values: list[float], flushed: list[bool], summary, fmt: str) -> str:
    """'flushing / other': ``summary`` of the values of steps in which a tail
    flushed, then of the rest ('-' where there are none)."""
    parts = [[v for v, f in zip(values, flushed) if f == want] for want in (True, False)]
    return " / ".join(fmt.format(summary(x)) if x else "-" for x in parts)


def across_processes(args) -> None:
    """``--processes N``: this command without ``--processes`` (and ``--tree``), in N
    fresh processes per code tree, the trees interleaved (A B A B ...); per tree and
    arm, the median step of each process, their min / median / max and the
    slowest-to-fastest ratio, and whether every process of every tree produced the
    same tokens."""
    from benchmarks.common import run_in_trees

    print(f"# {command()}\n# {machine()}\n")
    results = run_in_trees("step_trace.py", args.trees, args.processes)
    digests = {label: {r[label]["digest"] for runs in results.values() for r in runs}
               for label in next(iter(results.values()))[0]}
    rows = []
    for name, runs in results.items():
        for label in runs[0]:
            medians = [r[label]["median_ms"] for r in runs]
            lo, hi = min(medians), max(medians)
            rows.append([name, label, " ".join(f"{m:.2f}" for m in medians),
                         f"{lo:.2f} / {statistics.median(medians):.2f} / {hi:.2f}", f"{hi / lo:.2f}x",
                         "same" if len(digests[label]) == 1 else f"{len(digests[label])} different"])
    print(f"\n{args.processes} fresh processes per tree, trees interleaved\n")
    print(table(["tree", "arm", "median step ms per process", "min / median / max", "slowest / fastest",
                 "tokens (every tree)"], rows))
    # Per process: where a slow process's time goes. CPU ms per step counts every
    # thread of the process (the host's work); device busy (with --trace) is the GPU's.
    rows = []
    for name, runs in results.items():
        for i, r in enumerate(runs):
            for label, a in r.items():
                steps = a.get("decode_steps", {})
                rows.append([name, i, label, f"{a['median_ms']:.2f}", f"{a['cpu_ms']:.2f}" if "cpu_ms" in a else "-",
                             f"{a['host_probe_ms']:.2f} (CPU {a.get('host_cpu')})" if "host_probe_ms" in a else "-",
                             f"{a['device_busy_ms']:.2f}" if "device_busy_ms" in a else "-",
                             " ".join(f"{k} {v}" for k, v in steps.items()) or "-"])
    print("\nper process: median step, the process's CPU time per step (all threads), a fixed pure-Python loop "
          "timed after the steps (host_probe: the main thread's speed, and its CPU), device busy per step "
          "(--trace), decode steps plain / compiled / traced since the engine was built\n")
    print(table(["tree", "process", "arm", "median step ms", "CPU ms / step", "host probe ms (CPU)",
                 "device busy ms / step", "decode steps"], rows))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arm", action="append", dest="arms", metavar="SPEC",
                   help="repeatable: kiviq[,flush_blocks=K][,bits=B|2r][,compile=1|0][,pipeline=1|0][,table=N] (kiviq's engine), "
                        "mlxlm (mlx-lm's own cache, one request, B=1) or batchgen (mlx-lm's BatchGenerator); "
                        "default kiviq")
    p.add_argument("--shape", default="qwen3-4b", choices=sorted(SHAPES))
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--steps", type=int, default=16, help="timed steps per arm per round")
    p.add_argument("--rounds", type=int, default=1, help="rounds of interleaved timed blocks")
    p.add_argument("--warmup", type=int, default=8)
    p.add_argument("--bits", default="4", choices=KV_BITS_NAMES, help="the KV cache, as --kv-bits names it")
    p.add_argument("--flush-blocks", type=int, default=1, dest="flush_blocks",
                   help="kiviq: KIVI blocks quantized per flush (KVConfig.flush_blocks)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--quantize", type=int, default=None, help="quantize the weights to this many bits")
    p.add_argument("--trace", action="store_true", help="profile the timed steps with torch.profiler (CUDA)")
    p.add_argument("--host-profile", action="store_true", dest="host_profile",
                   help="profile the timed steps' host work with cProfile (Python functions and the "
                        "MLX calls they make; eval-time work shows under the call that waits)")
    p.add_argument("--top", type=int, default=25, help="kernel rows (and host functions) to print")
    p.add_argument("--processes", type=int, default=1,
                   help="run the whole measurement in N fresh processes, one after another, and report "
                        "each arm's median step per process and their spread (the same build can time "
                        "1.5x apart in two processes: judge a change against this)")
    p.add_argument("--tree", action="append", dest="trees", metavar="NAME=TREE",
                   help="with --processes: a code tree to run, repeatable, interleaved with the others: "
                        "NAME=. (the working tree), NAME=DIR or NAME=<git revision> (extracted with git "
                        "archive); each runs its own benchmarks/step_trace.py")
    p.add_argument("--summary-json", dest="summary_json", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.trees and args.processes < 1:
        raise SystemExit("--tree needs --processes N")
    if args.processes > 1 or args.trees:
        if args.host_profile:
            raise SystemExit("--processes times steps; profile the host in one process")
        return across_processes(args)
    arms = [Arm(spec, args) for spec in (args.arms or ["kiviq"])]
    if (args.trace or args.host_profile) and (len(arms) > 1 or args.rounds > 1):
        raise SystemExit("--trace and --host-profile profile one arm in one round")
    print(f"# {command()}\n# {machine()}\n")
    model, prompts = make_model(args)
    for arm in arms:
        arm.build(args, model, prompts)
    host = None
    if args.host_profile:
        import cProfile

        host = cProfile.Profile()
    with device_trace(DEVICE_EVENTS + API_EVENTS) if args.trace else contextlib.nullcontext([]) as events:
        if host is not None:
            host.enable()
        for r in range(args.rounds):
            for arm in arms[r % len(arms):] + arms[:r % len(arms)]:
                arm.timed_steps(args.steps)
        if host is not None:
            host.disable()
    report(arms, args)
    if args.summary_json:
        summary = {arm.label: arm.summary() for arm in arms}
        if args.trace:
            from benchmarks.trace_summary import busy_time

            device = [e for e in events if e.get("cat") in DEVICE_EVENTS]
            busy = busy_time([(e["ts"], e["ts"] + e["dur"]) for e in device]) / 1e3 / args.steps
            for arm_summary in summary.values():
                arm_summary["device_busy_ms"] = busy
        with open(args.summary_json, "w") as f:
            json.dump(summary, f)
    if host is not None:
        print_host_profile(host, args.steps, args.top)
    if not args.trace:
        return
    print_trace(events, args.steps, args.top)

if __name__ == "__main__":
    main()
