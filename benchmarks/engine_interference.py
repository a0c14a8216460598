"""What the worker's surroundings cost the engine: the bulk workload through the
raw engine, alone and beside what the service adds around it, interleaved in
one process.

Through the service a bulk run decodes more slowly than the raw engine on the
same requests ("The whole service on the bulk workload", docs/performance.md).
Two things the service brings besides its own loop can be measured without it:

- ``load:N``: N processes spinning in pure Python on the CPUs this process does
  not use (the upper half; this process takes the lower half, as the worker
  does in benchmarks/service.py). They stand in, at full load, for what the
  service benchmark runs beside the worker: its client processes and Redis.
- ``outbox``: a thread of this process that, after every step, encodes the
  step's token events as the worker's outbox thread does
  (``kiviq.jobs.publisher.encode_events``) and then sleeps as long as its Redis
  round trip (one script call) takes on a local server (``--round-trip-ms``).
  It holds the GIL for the encoding, as the outbox does, while the engine's
  thread builds and launches the next step.

Each round runs every arm once on the same prompts (a new set per round, the
arms' order rotated), and each round's arms must give the same tokens; a decode
step's time is the run's time after every request had its first token over the
decode steps. Report: per arm, the decode ms per step and the time to all first
tokens (min / median / max over the rounds). The host's speed moves within a
process (benchmarks/host_speed.py): read a difference against the spread.

    MLX_ENABLE_TF32=0 python3 benchmarks/engine_interference.py --shape qwen3-4b --rounds 5 --arms none load:4 outbox
"""

from __future__ import annotations

import argparse
import contextlib
import os
import queue
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402

from benchmarks.common import command, machine, spread, table  # noqa: E402
from benchmarks.engine import SHAPES, random_model  # noqa: E402
from benchmarks.prefill import make_prompts, run_engine  # noqa: E402
from benchmarks.service_setup import pin_this_process, split_cpus  # noqa: E402
from kiviq.engine import build_engine  # noqa: E402
from kiviq.jobs.models import TokenEvent  # noqa: E402
from kiviq.jobs.publisher import encode_events  # noqa: E402
from tests.engine_runs import IdTokenizer  # noqa: E402

SPIN = "import os, sys\nos.sched_setaffinity(0, {int(sys.argv[1])})\nwhile True:\n    pass\n"


class Spinners:
    """N busy processes, one per CPU of ``cpus`` (round robin), while in use."""

    def __init__(self, n: int, cpus: list[int]):
        self.n, self.cpus, self.procs = n, cpus, []

    def __enter__(self) -> "Spinners":
        self.procs = [subprocess.Popen([sys.executable, "-c", SPIN, str(self.cpus[i % len(self.cpus)])])
                      for i in range(self.n)]
        time.sleep(0.2)  # running before the run starts
        return self

    def __exit__(self, *exc) -> None:
        for p in self.procs:
            p.kill()
            p.wait()


class OutboxStandIn:
    """A thread encoding each step's token events as the worker's outbox does,
    then waiting ``round_trip_s`` (the step script: publish, cancel flags, queues)."""

    def __init__(self, round_trip_s: float):
        self.round_trip_s = round_trip_s
        self.encode_s: list[float] = []
        self._queue: queue.Queue = queue.Queue()
        self._seq = 0
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "OutboxStandIn":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._queue.put(None)
        self._thread.join()

    def on_step(self, events: list) -> None:
        tokens = []
        for ev in events:  # as worker.service makes them on the engine's thread
            if ev.token_ids:
                self._seq += 1
                tokens.append(TokenEvent(ev.request_id, self._seq, ev.text, list(ev.token_ids)))
        self._queue.put(tokens)

    def _run(self) -> None:
        while (events := self._queue.get()) is not None:
            start = time.perf_counter()
            if events:
                encode_events(events)
            self.encode_s.append(time.perf_counter() - start)
            time.sleep(self.round_trip_s)


def parse_arm(arm: str) -> tuple[str, int]:
    name, _, n = arm.partition(":")
    if name == "load" and n.isdigit() and int(n) > 0:
        return name, int(n)
    if name in ("none", "outbox") and not n:
        return name, 0
    raise argparse.ArgumentTypeError(f"unknown arm {arm!r}: use none, outbox or load:N (N busy processes)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="qwen3-4b", choices=sorted(SHAPES))
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--prompt-tokens", type=int, default=1200)
    p.add_argument("--gen", type=int, default=256)
    p.add_argument("--rounds", type=int, default=5, help="rounds of every arm, after one untimed round")
    p.add_argument("--arms", nargs="+", type=parse_arm, default=[("none", 0), ("load", 4), ("outbox", 0)])
    p.add_argument("--round-trip-ms", type=float, default=0.4, dest="round_trip_ms",
                   help="the outbox stand-in's wait per Redis round trip")
    args = p.parse_args(argv)
    if args.gen < 2:
        p.error("--gen must be at least 2 (decode steps are what this measures)")

    split = split_cpus(os.sched_getaffinity(0))
    if split is None and any(name == "load" for name, _ in args.arms):
        p.error("load:N needs 4 or more CPUs (half for the engine, half for the load)")
    if split is not None:
        pin_this_process(split[0])
    print(f"# {command()}\n# {machine()}\n", flush=True)
    model = random_model(args.shape, getattr(mx, args.dtype), None)
    vocab = SHAPES[args.shape]["vocab_size"]
    engine = build_engine(model, IdTokenizer(), kv_bits=4, max_sequences=args.requests)
    names = [f"{n}:{k}" if k else n for n, k in args.arms]
    decode: dict[str, list[float]] = {n: [] for n in names}
    first: dict[str, list[float]] = {n: [] for n in names}
    encode: list[float] = []
    for rnd in range(args.rounds + 1):  # round 0 compiles what the runs meet, untimed
        prompts = make_prompts(rnd, args.requests, args.prompt_tokens, vocab)
        digests = set()
        for k in range(len(args.arms)):
            i = (k + rnd) % len(args.arms)
            (name, n), label = args.arms[i], names[i]
            stand_in = OutboxStandIn(args.round_trip_ms / 1e3) if name == "outbox" else None
            around = Spinners(n, sorted(split[1])) if name == "load" else stand_in or contextlib.nullcontext()
            with around:
                r = run_engine(engine, prompts, args.gen, on_step=stand_in.on_step if stand_in else None)
            digests.add(r["digest"])
            if rnd:
                decode[label].append((r["total"] - r["first_all"]) / (args.gen - 1) * 1e3)
                first[label].append(r["first_all"])
                if stand_in:
                    encode += stand_in.encode_s
                print(f"round {rnd}, {label}: all first tokens {r['first_all']:.2f} s, "
                      f"decode {decode[label][-1]:.2f} ms/step", flush=True)
        if len(digests) != 1:
            raise SystemExit(f"round {rnd}: the arms gave different tokens ({sorted(digests)})")
    print(f"\n{args.requests} requests x ~{args.prompt_tokens} prompt tokens x {args.gen} new, {args.shape} "
          f"{args.dtype}, KIVI 4-bit; {args.rounds} rounds, every round's arms gave the same tokens\n")
    rows = [[label, len(decode[label]), spread(decode[label], ".2f"), spread(first[label], ".2f")] for label in names]
    print(table(["arm", "runs", "decode ms / step: min / median / max", "all first tokens s: min / median / max"],
                rows))
    if encode:
        print(f"\noutbox stand-in: encoding a step's events took {statistics.median(encode) * 1e3:.3f} ms "
              f"(median over {len(encode)} steps)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
