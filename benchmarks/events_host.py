"""Host time of a decode step's bookkeeping in the engine: ``Scheduler.schedule()`` and
turning the step's draws into events (``Engine._emit_sampled``: each token through its
request's detokenizer and stop matcher into a ``StepEvent``), B sequences decoding.

On a GPU a decode step is host-bound (docs/performance.md, "Open targets"), and this
Python runs on the engine's thread every step; issue 20 asks for both under ~0.5 ms at
B = 128. The engine runs the default model's tokenizer on a tiny random-weight model
(CPU, not pipelined), and every draw is replaced by the next token of real text
(this repository's README, each sequence from its own offset), so the detokenizers
meet the byte pieces of real words, not random ids.

Arms are code trees (``NAME=.``, ``NAME=DIR`` or ``NAME=<git revision>``), each in
fresh processes, interleaved; the events' text of each arm is hashed (equal digests:
the same text).

    python benchmarks/events_host.py --batch 32 128 --arm before=HEAD~1 --arm after=. --processes 2
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def child(args) -> dict:
    """One arm, one batch size, inside ``args.code``."""
    sys.path.insert(0, args.code)
    import mlx.core as mx
    from mlx_lm.utils import _get_classes

    from kiviq.engine import Request, build_engine, load

    _, tokenizer = load(None)
    text = tokenizer.encode((Path(args.code) / "README.md").read_text(), add_special_tokens=False)
    cfg = dict(model_type="qwen3", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
               num_attention_heads=4, num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6,
               vocab_size=len(tokenizer), rope_theta=1e6, max_position_embeddings=40960,
               tie_word_embeddings=True)
    model_cls, args_cls = _get_classes(cfg)
    mx.random.seed(0)
    model = model_cls(args_cls.from_dict(cfg))
    mx.eval(model.parameters())
    b = args.batch
    engine = build_engine(model, tokenizer, kv_bits=4, max_sequences=b, kv_memory=1 << 30,
                          max_batch_tokens=8192, pipeline=False)
    for i in range(b):
        engine.add(Request(str(i), text[i * 7:i * 7 + 64], args.warmup + args.steps + 10))
    emit, schedule = engine._emit_sampled, engine.scheduler.schedule
    times = {"schedule": [], "events": []}
    texts = {str(i): [] for i in range(b)}

    def timed_emit(seqs, sampled):
        n = len(times["events"])  # this decode step's index
        sampled.tokens = mx.array([text[(n + 97 * i) % len(text)] for i in range(len(seqs))], dtype=mx.uint32)
        mx.eval(sampled.tokens)
        t = time.perf_counter()
        events = emit(seqs, sampled)
        times["events"].append(time.perf_counter() - t)
        return events

    def timed_schedule():
        t = time.perf_counter()
        plan = schedule()
        times["schedule"].append(time.perf_counter() - t)
        return plan

    engine.scheduler.schedule = timed_schedule
    engine._emit_sampled = timed_emit
    while len(times["events"]) < args.warmup + args.steps:
        for ev in engine.step():
            texts[ev.request_id].append(ev.text)
    for seq in engine._seqs.values():  # what a detokenizer still holds (a build may hold text longer)
        seq.runtime.detokenizer.finalize()
        texts[seq.request_id].append(seq.runtime.detokenizer.last_segment)
    digest = hashlib.sha256(json.dumps(["".join(texts[str(i)]) for i in range(b)]).encode()).hexdigest()[:12]
    return {"schedule": times["schedule"][-args.steps:], "events": times["events"][-args.steps:], "digest": digest}


def summary(xs: list[float]) -> str:
    ms = sorted(x * 1e3 for x in xs)
    return f"{ms[0]:.3f} / {statistics.median(ms):.3f} / {ms[-1]:.3f}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arm", action="append", metavar="NAME=TREE", help="repeatable (default: this=.)")
    p.add_argument("--batch", type=int, nargs="+", default=[32, 128])
    p.add_argument("--steps", type=int, default=200, help="timed decode steps per process")
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--processes", type=int, default=2, help="fresh processes per arm and batch size")
    p.add_argument("--code", help=argparse.SUPPRESS)  # child: the code tree to import
    p.add_argument("--child-batch", type=int, dest="child_batch", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.code:
        args.batch = args.child_batch
        print(json.dumps(child(args)))
        return

    sys.path.insert(0, str(ROOT))
    from benchmarks.common import arm_tree, command, machine, named_trees, table

    arms = named_trees(args.arm)
    results: dict[tuple[int, str], dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        trees = {name: arm_tree(spec, tmp) for name, spec in arms}
        harness = shutil.copy(__file__, Path(tmp) / "events_host.py")  # edits during a run change nothing
        for rep in range(args.processes):
            for b in args.batch:
                for name, _ in (arms if rep % 2 == 0 else arms[::-1]):
                    cmd = [sys.executable, harness, "--code", trees[name], "--child-batch", str(b),
                           "--steps", str(args.steps), "--warmup", str(args.warmup)]
                    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
                    r = json.loads(out.strip().splitlines()[-1])
                    acc = results.setdefault((b, name), {"schedule": [], "events": [], "medians": [], "digests": set()})
                    acc["schedule"] += r["schedule"]
                    acc["events"] += r["events"]
                    acc["medians"].append(statistics.median(r["events"]) * 1e3)
                    acc["digests"].add(r["digest"])
                    print(f"# process {rep} B={b} {name}: events median {acc['medians'][-1]:.3f} ms", file=sys.stderr)
    print(f"# {command()}")
    print(f"# {machine()}; {args.steps} timed steps per process, {args.processes} processes per arm "
          f"(ms, min / median / max over all of them)\n")
    rows = []
    for b in args.batch:
        for name, spec in arms:
            r = results[(b, name)]
            rows.append([b, f"{name} ({spec})", summary(r["schedule"]), summary(r["events"]),
                         ", ".join(f"{m:.3f}" for m in r["medians"]), ", ".join(sorted(r["digests"]))])
    print(table(["B", "arm", "schedule() ms", "events ms", "events median per process", "text sha256"], rows))


if __name__ == "__main__":
    main()
