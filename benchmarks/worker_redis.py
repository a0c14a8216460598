"""The worker's Redis work per engine step, apart from the engine: publishing one
token event per running sequence (``jobs.publisher.EventPublisher``) and the
cancel check (``worker.service.BatchWorker._check_cancels``).

A decode step is host-bound, and the worker runs these on the same thread
between steps, so every millisecond here is a millisecond per token for every
running sequence. Runs against a Redis server it starts itself (and stops),
with one pub/sub client subscribed to every channel, as streaming clients are:

    python benchmarks/worker_redis.py --batch 64 --steps 400

The publisher is timed as the worker runs it; the cancel check through the
worker's own method on a stand-in that holds ``--batch`` active jobs.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from redis import Redis  # noqa: E402

from benchmarks.common import command, table  # noqa: E402
from kiviq.client.local_redis import start_redis  # noqa: E402
from kiviq.jobs.models import EventType, StreamEvent  # noqa: E402
from kiviq.jobs.publisher import EventPublisher  # noqa: E402
from kiviq.worker.service import BatchWorker  # noqa: E402


def timed(fn, steps: int, warmup: int = 50) -> list[float]:
    """Milliseconds per call, sorted, after ``warmup`` calls."""
    out = []
    for i in range(warmup + steps):
        t = time.perf_counter()
        fn(i)
        if i >= warmup:
            out.append((time.perf_counter() - t) * 1e3)
    return sorted(out)


class CancelCheck:
    """Just enough of a BatchWorker for its ``_check_cancels``: the active jobs
    (none cancelled, the usual case) and the connection."""

    def __init__(self, connection: Redis, job_ids: list[str]):
        self.connection, self.active = connection, dict.fromkeys(job_ids)

    check = BatchWorker._check_cancels


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=64, help="running sequences (one event each per step)")
    p.add_argument("--steps", type=int, default=400)
    args = p.parse_args()
    url, stop, kind = start_redis()
    try:
        redis = Redis.from_url(url)
        listener = Redis.from_url(url).pubsub()
        listener.psubscribe("*")
        jobs = [f"{i:08x}-5c1e-4c6b-9a8e-{i:012x}" for i in range(args.batch)]
        publisher = EventPublisher(redis)

        def publish(step: int) -> None:
            publisher.publish([StreamEvent(job_id=j, seq=step, type=EventType.token, text=" the",
                                           token_ids=[279]) for j in jobs])
            if step % 50 == 0:  # keep the subscriber's socket drained, as a client would
                while listener.get_message(timeout=0):
                    pass

        check = CancelCheck(redis, jobs).check
        rows = []
        for name, fn in (("publish the step's events", publish), ("cancel check", lambda _: check())):
            ms = timed(fn, args.steps)
            rows.append([name, f"{ms[0]:.2f} / {statistics.median(ms):.2f} / {ms[-1]:.2f}"])
        listener.close()
    finally:
        stop()
    print(f"# {command()}\n# redis: {kind}; B={args.batch}, {args.steps} steps\n")
    print(table(["per engine step", "ms min / median / max"], rows))


if __name__ == "__main__":
    main()
