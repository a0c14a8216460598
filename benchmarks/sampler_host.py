"""Time of the batch sampler (``engine.sampler.sample``) per decode step, by the
kind of rows in the batch, and with ``--rev REV`` that revision's sampler beside
this tree's, interleaved in one process (A/B/B/A...), the tokens compared.

Rows persist across calls as in the engine (seeded keys advance, histories grow);
each call draws from fresh random logits [B, V] (a rotating set, evaluated before
the clock starts) with the global generator reseeded per call, so the arms meet
the same noise. Reported per call: the graph's build time (the Python that
``sample`` runs) and the whole call with its ``mx.eval``; on a CPU the latter is
mostly the arithmetic, on a GPU the host's launches and the device's work.

    python benchmarks/sampler_host.py --batch 32 128 --vocab 49152 --rev HEAD~1
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import mlx.core as mx  # noqa: E402

from benchmarks.common import command, machine, revision_arms, table  # noqa: E402
from kiviq.engine import sampler as this_sampler  # noqa: E402
from kiviq.engine.request import SamplingParams  # noqa: E402

KINDS = {  # row i of a batch of this kind samples with params(i)
    "greedy": lambda i: SamplingParams(),
    "temperature 0.8": lambda i: SamplingParams(temperature=0.8),
    "every row seeded": lambda i: SamplingParams(temperature=0.8, seed=i),
    "top_p 0.9": lambda i: SamplingParams(temperature=0.8, top_p=0.9),
    "repetition penalty": lambda i: SamplingParams(repetition_penalty=1.2),
    "mixed": lambda i: [SamplingParams(), SamplingParams(temperature=0.7, seed=i),
                        SamplingParams(temperature=0.9, top_k=40), SamplingParams(temperature=1.0, logprobs=3)][i % 4],
}
LOGIT_SETS = 3


def timed_call(module, logits: mx.array, rows: list, seed: int) -> tuple[float, float, list[int]]:
    mx.random.seed(seed)
    mx.synchronize()
    t0 = time.perf_counter()
    out = module.sample(logits, rows)
    t1 = time.perf_counter()
    mx.eval(*out.arrays())
    mx.synchronize()
    t2 = time.perf_counter()
    tokens = out.tokens.tolist()
    for r, t in zip(rows, tokens):
        r.history.append(t)
    return t1 - t0, t2 - t0, tokens


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, nargs="+", default=[32, 128])
    p.add_argument("--vocab", type=int, default=49152, help="the default model's vocabulary")
    p.add_argument("--kind", choices=sorted(KINDS), nargs="+", default=list(KINDS))
    p.add_argument("--rev", default=None, help="also time this git revision's sampler")
    p.add_argument("--calls", type=int, default=6, help="calls per arm per batch and kind")
    a = p.parse_args()
    modules = revision_arms(this_sampler, a.rev, "engine/sampler.py")
    rows_out, mismatches = [], 0
    for batch in a.batch:
        logits = [mx.random.normal((batch, a.vocab), key=mx.random.key(batch + k)) * 3 for k in range(LOGIT_SETS)]
        mx.eval(logits)
        for kind in a.kind:
            states = {name: [m.RowState.create(KINDS[kind](i), list(range(i, i + 24))) for i in range(batch)]
                      for name, m in modules.items()}
            times = {name: ([], []) for name in modules}
            for call in range(a.calls + 1):  # call 0 warms up
                order = list(modules.items())
                tokens = {}
                for name, m in (order if call % 2 == 0 else order[::-1]):
                    build, total, tokens[name] = timed_call(m, logits[call % LOGIT_SETS], states[name], call)
                    if call:
                        times[name][0].append(build)
                        times[name][1].append(total)
                mismatches += len({tuple(t) for t in tokens.values()}) > 1
            for name, (build, total) in times.items():
                rows_out.append([batch, kind, name, f"{statistics.median(build) * 1e3:.2f}",
                                 f"{min(total) * 1e3:.2f} / {statistics.median(total) * 1e3:.2f} / "
                                 f"{max(total) * 1e3:.2f}"])
    print(f"# {command()}\n# {machine()}")
    print(table(["B", "rows", "sampler", "build ms (median)", "call ms min / median / max"], rows_out))
    if len(modules) > 1:
        print(f"calls whose tokens differed between the arms: {mismatches}")
    if mismatches:
        sys.exit(1)


if __name__ == "__main__":
    main()
