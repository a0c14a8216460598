"""The worker's own cost per engine step: ``BatchWorker.serve`` around an engine
that costs nothing.

Through the service the steps come further apart than in the raw engine (on the
H200, 0.8-1.3 ms more per ~20 ms step: docs/performance.md, "The whole service on
the bulk workload"). The difference is what the worker does on the engine's thread
between steps: events, Redis (publishing, cancel flags, claims, heartbeats),
metrics, rq bookkeeping. This
runs the real worker, with a real Redis server it starts itself, on jobs
submitted through the real client, but with a stand-in engine whose step
returns one token for every active request at once: the wall time per step is
then the worker's own. ``--engine-ms`` makes each step wait that long with the
GIL released (as MLX's evaluation does), to see what the worker's other threads
do meanwhile; ``--engine-gil-ms`` makes it first hold the GIL that long (the
engine's Python and MLX's graph building do), and the table then says how much
longer the steps took than that: what the worker's other threads cost the engine.
``--switch-interval`` sets Python's (``sys.setswitchinterval``) for the run.

    python benchmarks/worker_loop.py --jobs 64 --gen 256
    python benchmarks/worker_loop.py --jobs 64 --gen 256 --profile    # where the time goes
    python benchmarks/worker_loop.py --jobs 64 --runs 0 --parts --steps 400

``--parts`` times the Redis call the worker makes every step, as it makes it
(``jobs.publisher.EventPublisher.publish_and_check``: one token event per running
job published, then the cancel flags of ``--jobs`` running jobs read), and each of
its two halves alone. It runs on the worker's outbox thread.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from types import SimpleNamespace
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from redis import Redis  # noqa: E402

from benchmarks.common import command, spread, table  # noqa: E402
from kiviq import Client  # noqa: E402
from kiviq.client.local_redis import start_redis  # noqa: E402
from kiviq.engine.request import StepEvent  # noqa: E402
from kiviq.jobs.models import TokenEvent  # noqa: E402
from kiviq.jobs.publisher import EventPublisher  # noqa: E402
from kiviq.worker.metrics import WorkerMetrics  # noqa: E402
from kiviq.worker.service import BatchWorker  # noqa: E402


class ByteTokenizer:
    """Prompts as bytes; every token is one character of text."""

    eos_token_ids: set = set()
    bos_token = None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode())

    def decode(self, ids: list[int]) -> str:
        return bytes(i % 128 for i in ids).decode()


class FreeEngine:
    """An engine whose step costs nothing (or ``engine_ms`` of GIL-free
    waiting): one token, " a", for every active request, until its max_tokens."""

    def __init__(self, capacity: int, engine_ms: float, gil_ms: float = 0.0):
        self.tokenizer = ByteTokenizer()
        self.model = SimpleNamespace(args=SimpleNamespace(max_position_embeddings=8192))
        self.capacity = capacity
        self.engine_ms, self.gil_ms = engine_ms, gil_ms
        self.stretch: list[float] = []  # ms each step took past gil_ms + engine_ms
        self._left: dict[str, int] = {}
        self.steps = 0
        self.started: list[float] = []  # perf_counter() as each step began
        self.stats = {"decode_tokens": 0, "prefill_tokens": 0, "preemptions": 0}

    @property
    def num_active(self) -> int:
        return len(self._left)

    def add(self, request) -> None:
        self._left[request.request_id] = request.max_tokens

    def abort(self, request_id: str) -> bool:
        return self._left.pop(request_id, None) is not None

    def step(self) -> list[StepEvent]:
        t0 = time.perf_counter()
        self.started.append(t0)
        busy_until = t0 + self.gil_ms / 1e3
        while time.perf_counter() < busy_until:  # Python holding the GIL
            pass
        if self.engine_ms:
            time.sleep(self.engine_ms / 1e3)
        self.stretch.append((time.perf_counter() - t0) * 1e3 - self.gil_ms - self.engine_ms)
        self.steps += 1
        events = []
        for rid in list(self._left):
            self._left[rid] -= 1
            done = self._left[rid] == 0
            if done:
                del self._left[rid]
            events.append(StepEvent(rid, [97], " a", finish_reason="length" if done else None))
        self.stats["decode_tokens"] += len(events)
        return events


def drain(listener) -> None:
    """Read what the subscriber was sent, as a streaming client would."""
    while listener.get_message(timeout=0):
        pass


def job_tokens(i: int, args) -> int:
    """Job i's max_tokens: ``--gen``, or with ``--end-groups G`` G groups that end in
    turn over the run's second half (as a bulk run's prefill groups do)."""
    return args.gen - (i * args.end_groups // args.jobs) * (args.gen // (2 * args.end_groups))


def loop_runs(args, url: str, listener) -> tuple[list[list], Any]:
    """``--runs`` whole serves of ``--jobs`` jobs: a table row each, and the last
    run's profile (with ``--profile``)."""
    client, rows, profile = Client(url), [], None
    for run in range(args.runs):
        for i in range(args.jobs):
            client.submit("Tell me about the sea.", max_tokens=job_tokens(i, args))
        slots = args.max_active or args.jobs
        engine = FreeEngine(slots, args.engine_ms, args.engine_gil_ms)
        worker = BatchWorker(engine, Redis.from_url(url), max_active=slots, metrics=WorkerMetrics())
        if args.profile and run == args.runs - 1:
            import cProfile

            profile = cProfile.Profile()
            profile.enable()
        t0 = time.perf_counter()
        ended = worker.serve(burst=True, logging_level="WARNING")
        wall = time.perf_counter() - t0
        if profile is not None:
            profile.disable()
        drain(listener)
        if ended != args.jobs or not engine.steps:
            raise SystemExit(f"run {run}: {ended} jobs ended in {engine.steps} steps, not {args.jobs}")
        # Steady state: every job running, none admitted or ending (a tenth cut off each end).
        nominal = args.engine_ms + args.engine_gil_ms
        gaps = [(b - a) * 1e3 - nominal for a, b in zip(engine.started, engine.started[1:])]
        cut = max(1, len(gaps) // 10)
        gaps = sorted(gaps[cut:-cut])
        stretch = sorted(engine.stretch[cut:-cut])
        rows.append([run + 1, engine.steps, f"{wall:.2f}", f"{(engine.started[0] - t0) * 1e3:.0f}",
                     f"{gaps[0]:.2f} / {statistics.median(gaps):.2f} / {gaps[-1]:.2f}",
                     f"{statistics.median(stretch):.2f} / {stretch[len(stretch) * 9 // 10]:.2f}"])
    return rows, profile


def part_costs(args, url: str, listener, warmup: int = 50) -> list[list]:
    """``--parts``: per call of the step's publish and cancel check, together and
    apart: its wall time, and its thread's CPU time (what it holds the GIL for,
    the redis-server's work and the round trip left out), in ms."""
    redis = Redis.from_url(url)
    jobs = [f"{i:08x}-5c1e-4c6b-9a8e-{i:012x}" for i in range(args.jobs)]
    publisher = EventPublisher(redis)

    def step_events(step: int) -> list[TokenEvent]:
        # The engine's thread makes a step's token events (as tuples) before it hands them over.
        return [TokenEvent(j, step, " the", [279]) for j in jobs]

    rows = []
    for name, fn in (("the step's call: publish and cancel check", lambda ev: publisher.publish_and_check(ev, jobs)),
                     ("publish the step's events", lambda ev: publisher.publish_and_check(ev)),
                     ("cancel check", lambda _: publisher.publish_and_check([], jobs))):
        wall, cpu = [], []
        for i in range(warmup + args.steps):
            events = step_events(i)
            t, c = time.perf_counter(), time.thread_time()
            fn(events)
            if i >= warmup:
                wall.append((time.perf_counter() - t) * 1e3)
                cpu.append((time.thread_time() - c) * 1e3)
            if i % 50 == 0:
                drain(listener)
        rows.append([name, spread(wall, ".2f"), spread(cpu, ".3f")])
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--jobs", type=int, default=64, help="jobs, all running at once")
    p.add_argument("--gen", type=int, default=256, help="tokens per job (engine steps)")
    p.add_argument("--engine-ms", type=float, default=0.0, dest="engine_ms",
                   help="GIL-free wait per engine step (MLX's evaluation releases the GIL)")
    p.add_argument("--engine-gil-ms", type=float, default=0.0, dest="engine_gil_ms",
                   help="GIL-holding Python per engine step, before the GIL-free wait")
    p.add_argument("--switch-interval", type=float, default=None, dest="switch_interval",
                   help="sys.setswitchinterval for the run, seconds (Python's default: 0.005)")
    p.add_argument("--max-active", type=int, default=None, dest="max_active",
                   help="the worker's --max-active (default: --jobs; more leaves free slots, which it fills from "
                        "the queues as jobs arrive)")
    p.add_argument("--end-groups", type=int, default=1, dest="end_groups",
                   help="the jobs end in this many groups, in turn over the run's second half "
                        "(1: all at the last step)")
    p.add_argument("--runs", type=int, default=3, help="whole serves (0: none)")
    p.add_argument("--profile", action="store_true", help="cProfile the last run: the worker's functions")
    p.add_argument("--parts", action="store_true", help="also time the step's publish and cancel check alone")
    p.add_argument("--steps", type=int, default=400, help="calls timed per part (with --parts)")
    args = p.parse_args()
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)
    url, stop, kind = start_redis()
    try:
        listener = Redis.from_url(url).pubsub()
        listener.psubscribe("*")  # a subscriber on every channel, as streaming clients are
        rows, profile = loop_runs(args, url, listener)
        parts = part_costs(args, url, listener) if args.parts else []
        listener.close()
    finally:
        stop()
    print(f"# {command()}\n# redis: {kind}; {args.jobs} jobs\n")
    if rows:
        tokens = f"{args.gen} tokens each" if args.end_groups == 1 else \
            f"{job_tokens(args.jobs - 1, args)}-{args.gen} tokens, the jobs ending in {args.end_groups} groups"
        print(f"{tokens}, engine step {args.engine_gil_ms} ms holding the GIL, then "
              f"{args.engine_ms} ms GIL free; switch interval {sys.getswitchinterval() * 1e3:g} ms\n")
        print(table(["run", "engine steps", "wall s (whole serve: admission and endings too)",
                     "ms until the first step (admitting every job)",
                     "worker ms between steps, steady state: min / median / max",
                     "ms a step took past its own, median / p90"], rows))
    if parts:
        print(f"\none call per engine step, {args.steps} steps\n")
        print(table(["per engine step", "wall ms: min / median / max", "its thread's CPU ms: min / median / max"],
                    parts))
    if profile is not None:
        import pstats

        steps = rows[-1][1]
        stats = pstats.Stats(profile)
        print("\nlast run, cumulative ms per step (profiled: slower than unprofiled)\n")
        entries = sorted(stats.stats.items(), key=lambda kv: -kv[1][3])[:30]
        print(table(["function", "cum ms / step", "calls / step"],
                    [[f"{os.path.basename(f)}:{line} {fn}"[:80], f"{ct / steps * 1e3:.3f}", f"{nc / steps:.1f}"]
                     for (f, line, fn), (cc, nc, tt, ct, _) in entries]))


if __name__ == "__main__":
    main()
