"""Host overhead of one batched decode step of the engine.

A random-weight model with the Qwen3-4B attention shape (36 layers, 32 query
heads, 8 kv heads, head_dim 128) but a tiny hidden size and vocabulary, so the
matmuls cost little and what is left of a step is mostly the Python and
graph-building work of the engine, the store and the kernel dispatch. B
sequences are prefilled (prompt lengths ``context + i``, so their flushes
fall on different steps), then every decode step with all B running is timed:

- build: wall time from the start of ``Engine.step()`` until the runner's
  final eval call (``ModelRunner.settle``, or ``launch`` where the engine
  pipelines steps and leaves one in flight): scheduling, the model's graph, the
  KV store's per-layer work, sampling, and any ``mx.eval`` made on the way
  (a host sync: on a GPU the host waits for the device there);
- host: build minus the time spent inside those earlier ``mx.eval`` calls,
  i.e. the Python and graph-building work alone;
- step: the whole ``Engine.step()`` (build + evaluation + emitting events);
- evals: ``mx.eval`` calls per step, the final one included (a pipelined
  step's ``mx.async_eval`` is not one).

With ``--attention stub`` the decode attention returns its query (the KV
writes and flushes still run): what is left is the engine's own per-step work,
without the CPU reference attention's graph (on a GPU the kernel's launch
costs far less host time than that graph).

Arms are code trees: ``.`` (the working tree), a directory, or a git revision extracted
with ``git archive`` into a temporary directory. Each (repeat, B, arm) runs in
its own process, arms interleaved, and the steps of all repeats are pooled
into min / median / mean / max. Each arm's generated tokens are hashed: equal
digests across arms mean token-identical outputs.

    python benchmarks/engine_host.py --arm before=HEAD --arm after=. --batch 1 8 32
    python benchmarks/engine_host.py --arm k1=. --arm k4=.,flush_blocks=4 --batch 32 --attention stub
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]


def model_args(hidden: int, vocab: int) -> dict:
    return dict(model_type="qwen3", hidden_size=hidden, num_hidden_layers=36, intermediate_size=2 * hidden,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6,
                vocab_size=vocab, rope_theta=1000000.0, max_position_embeddings=40960,
                tie_word_embeddings=True)


# Random weights have no text: a tokenizer with no EOS whose (shared, stateless)
# detokenizer emits nothing. The child may run an old code tree, so it relies only on
# the engine's duck typing (benchmarks/engine.py has the same stub as classes).
_ID_TOKENIZER = SimpleNamespace(
    eos_token_ids=set(),
    detokenizer=SimpleNamespace(last_segment="", add_token=lambda token: None, finalize=lambda: None),
)


def child(args) -> dict:
    """One arm, one batch size: time every all-decode step; runs inside ``args.code``."""
    sys.path.insert(0, args.code)
    import mlx.core as mx
    from mlx_lm.utils import _get_classes

    import kiviq.engine.kv_store
    from kiviq.engine import Request, build_engine

    if args.attention == "stub":  # the store calls the dispatcher through these module names
        kiviq.engine.kv_store.decode_attend = lambda q, *_, **__: q  # trees before the per-step plan
        kiviq.engine.kv_store.attend_plan = lambda *_, **__: (lambda q, pool: q)
        # A decode step's prologue-in-the-kernel (CUDA) then takes the stock ops' path to it.
        kiviq.engine.kv_store.prologue_plan = lambda *_, **__: None

    cfg = model_args(args.hidden, args.vocab)
    model_cls, args_cls = _get_classes(cfg)
    mx.random.seed(0)
    model = model_cls(args_cls.from_dict(cfg))
    model.set_dtype(getattr(mx, args.dtype))
    mx.eval(model.parameters())
    b = args.batch
    gen = args.warmup + args.steps + 1
    kv = {"kv_flush_blocks": args.flush_blocks} if args.flush_blocks != 1 else {}  # old trees lack it
    # Room for every sequence's tails (float32: 45 MiB each at the Qwen3-4B attention
    # shape) and for their blocks.
    engine = build_engine(model, _ID_TOKENIZER, kv_bits=args.bits, max_sequences=b,
                          kv_memory=(4 << 30) + b * (64 << 20), max_batch_tokens=8192, **kv)
    prompts = [mx.random.randint(0, args.vocab, (args.context + i,), key=mx.random.key(i)).tolist()
               for i in range(b)]
    marks: list[float] = []  # when the step's final eval (settle or launch) was called
    evals: list[tuple[float, float]] = []  # (seconds inside, start) of each mx.eval of the step
    mx_eval = mx.eval

    def marked(fn):
        def call(*arrays):
            marks.append(time.perf_counter())
            return fn(*arrays)
        return call

    def timed_eval(*arrays):
        t = time.perf_counter()
        try:
            return mx_eval(*arrays)
        finally:
            evals.append((time.perf_counter() - t, t))

    engine.runner.settle = marked(engine.runner.settle)
    if hasattr(engine.runner, "launch"):  # a pipelined engine's non-blocking eval
        engine.runner.launch = marked(engine.runner.launch)
    mx.eval = timed_eval  # kernels and the store call mx.eval through the module
    for i, p in enumerate(prompts):
        engine.add(Request(str(i), p, gen))
    out = {str(i): [] for i in range(b)}
    build, host, step, syncs = [], [], [], []
    while engine.has_work():
        marks.clear()
        evals.clear()
        before = dict(engine.stats)
        t0 = time.perf_counter()
        events = engine.step()
        t1 = time.perf_counter()
        for ev in events:
            assert ev.finish_reason != "error", ev.error
            out[ev.request_id] += ev.token_ids
        all_decode = (engine.stats["decode_tokens"] - before["decode_tokens"] == b
                      and engine.stats["prefill_tokens"] == before["prefill_tokens"] and len(marks) == 1)
        if all_decode:
            build.append(marks[0] - t0)
            host.append(marks[0] - t0 - sum(e for e, t in evals if t < marks[0]))
            step.append(t1 - t0)
            syncs.append(len(evals))
    digest = hashlib.sha256(json.dumps([out[str(i)] for i in range(b)]).encode()).hexdigest()[:12]
    w = args.warmup
    return dict(build=build[w:], host=host[w:], step=step[w:], evals=syncs[w:], digest=digest,
                device=str(mx.default_device()))


def stats_ms(xs: list[float]) -> str:
    ms = [x * 1e3 for x in xs]
    return f"{min(ms):.2f} / {statistics.median(ms):.2f} / {statistics.fmean(ms):.2f} / {max(ms):.2f}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arm", action="append", metavar="NAME=TREE[,flush_blocks=K]",
                   help="NAME=. (working tree), NAME=DIR or NAME=<git revision>, optionally with the KV "
                        "store's flush_blocks; repeatable (default: now=.)")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--context", type=int, default=256, help="prompt tokens of the first sequence")
    p.add_argument("--steps", type=int, default=48, help="timed decode steps per run")
    p.add_argument("--warmup", type=int, default=4, help="decode steps not timed")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--bits", type=int, default=4)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--attention", default="dispatch", choices=["dispatch", "stub"],
                   help="dispatch: kernel or reference as the engine picks; stub: attention returns q")
    p.add_argument("--dtype", default="float32", choices=["bfloat16", "float16", "float32"],
                   help="float32 on CPU (fast BLAS path); bfloat16 as served on a GPU")
    p.add_argument("--flush-blocks", type=int, default=1, dest="flush_blocks", help=argparse.SUPPRESS)  # child
    p.add_argument("--code", help=argparse.SUPPRESS)  # child: the code tree to import
    p.add_argument("--child-batch", type=int, dest="child_batch", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.code:
        args.batch = args.child_batch
        print(json.dumps(child(args)))
        return

    sys.path.insert(0, str(ROOT))
    from benchmarks.common import arm_tree, command, machine, named_trees, table

    arms = named_trees(args.arm, "now=.")
    flush_blocks = {}  # per arm
    for i, (name, spec) in enumerate(arms):
        spec, _, option = spec.partition(",flush_blocks=")
        arms[i] = [name, spec]
        flush_blocks[name] = int(option or 1)
    results: dict[tuple[int, str], dict] = {}
    passthrough = ["--context", str(args.context), "--steps", str(args.steps), "--warmup", str(args.warmup),
                   "--bits", str(args.bits), "--hidden", str(args.hidden), "--vocab", str(args.vocab),
                   "--dtype", args.dtype, "--attention", args.attention]
    with tempfile.TemporaryDirectory() as tmp:
        trees = {name: arm_tree(spec, tmp) for name, spec in arms}
        harness = shutil.copy(__file__, Path(tmp) / "engine_host.py")  # edits during a run change nothing
        for rep in range(args.repeats):
            for b in args.batch:
                for name, _ in (arms if rep % 2 == 0 else arms[::-1]):  # alternate which arm goes first
                    cmd = [sys.executable, harness, "--code", trees[name], "--child-batch", str(b), *passthrough,
                           "--flush-blocks", str(flush_blocks[name])]
                    proc = subprocess.run(cmd, check=True, capture_output=True, text=True, env=os.environ)
                    r = json.loads(proc.stdout.strip().splitlines()[-1])
                    acc = results.setdefault((b, name), dict(build=[], host=[], step=[], evals=[], digests=set()))
                    for key in ("build", "host", "step", "evals"):
                        acc[key] += r[key]
                    acc["digests"].add(r["digest"])
                    acc["device"] = r["device"]
                    print(f"# rep {rep} B={b} {name}: median build {statistics.median(r['build']) * 1e3:.2f} ms, "
                          f"host {statistics.median(r['host']) * 1e3:.2f} ms, "
                          f"step {statistics.median(r['step']) * 1e3:.2f} ms", file=sys.stderr, flush=True)

    print(f"# {command()}")
    print(f"# {machine()}; device {next(iter(results.values()))['device']}")
    print(f"# qwen3 attention shape (36 layers, H_q 32, H_kv 8, D 128), hidden {args.hidden}, vocab {args.vocab}, "
          f"{args.dtype}; KIVI {args.bits}-bit G=32 R=128; attention: {args.attention}; prompts {args.context} + i tokens; "
          f"{args.steps} timed steps x {args.repeats} repeats per arm (ms, min / median / mean / max)\n")
    rows = []
    for b in args.batch:
        for name, spec in arms:
            r = results[(b, name)]
            rows.append([b, f"{name} ({spec}" + (f", flush_blocks={flush_blocks[name]})" if flush_blocks[name] > 1 else ")"), stats_ms(r["build"]), stats_ms(r["host"]), stats_ms(r["step"]),
                         f"{statistics.fmean(r['evals']):.1f}", ", ".join(sorted(r["digests"]))])
    print(table(["B", "arm", "build ms", "host ms", "step ms", "evals/step", "tokens sha256"], rows))


if __name__ == "__main__":
    main()
