"""What reading a job's stream costs the client: CPU time per event and how late
events arrive, N jobs streamed at once by one ``AsyncClient``-style reader.

A bulk user streams many jobs from one process (the service benchmark's clients
do), and on the GPU host that load shares the machine with the worker
(docs/performance.md, "What slows the service's decode steps"). Here a
redis-server of the benchmark's own, a publisher process that writes one token
event for each of ``--jobs`` jobs every ``--step-ms`` through the worker's
``EventPublisher`` (the engine's pace), then a ``done`` event each, and a reader
process that streams every job through one ``AsyncClient`` of the arm's code tree
(``client.job(id).events()``, as the service benchmark's clients and the HTTP gateway
read their jobs). Measured over the publishing: the reader process's CPU
time and Redis's (``INFO cpu``; it includes the publisher's script calls, the
same in every arm), each per event, each event's arrival after its publishing,
and the connections the reader holds to Redis once every stream has subscribed (the publisher writes its wall-clock time as the event's text). Every
stream is checked: each job's events, in order, exactly once.

Arms are code trees (``NAME=.``, ``NAME=DIR`` or ``NAME=<git revision>``); the
publisher always runs this tree's code. Each (process, arm) is a fresh reader
process and a fresh redis-server, arms interleaved:

    python benchmarks/client_stream.py --arm before=HEAD --arm after=. --jobs 64 --processes 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def job_ids(n: int) -> list[str]:
    return [f"bench-{i}" for i in range(n)]


def publish(args) -> None:
    """The publisher process: the worker's events at the engine's pace."""
    sys.path.insert(0, args.code)
    from redis import Redis

    from kiviq.jobs.models import EventType, FinishReason, GenerationResult, StreamEvent, TokenEvent, Usage
    from kiviq.jobs.publisher import EventPublisher

    publisher = EventPublisher(Redis.from_url(args.publish))
    ids = job_ids(args.jobs)
    tick = time.perf_counter()
    for step in range(args.steps):
        stamp = f"{time.time():.6f}"
        publisher.publish([TokenEvent(j, step, stamp, [step]) for j in ids])
        tick += args.step_ms / 1e3
        time.sleep(max(0.0, tick - time.perf_counter()))
    usage = Usage(prompt_tokens=1, completion_tokens=args.steps)
    publisher.publish([StreamEvent(job_id=j, seq=args.steps, type=EventType.done, text="",
                                   finish_reason=FinishReason.length,
                                   result=GenerationResult(job_id=j, text="", token_ids=list(range(args.steps)),
                                                           finish_reason=FinishReason.length, usage=usage))
                       for j in ids])


def redis_cpu_s(connection) -> float:
    info = connection.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def child(args) -> dict:
    """One reader process of one arm: a redis-server of its own, the publisher beside it."""
    sys.path.insert(0, args.code)
    from redis import Redis

    from kiviq.client.async_client import AsyncClient
    from kiviq.client.local_redis import start_redis
    from kiviq.jobs.keys import event_channel

    url, stop, _ = start_redis()
    ids = job_ids(args.jobs)
    try:
        sync = Redis.from_url(url)

        async def main():
            client = AsyncClient(url)

            async def read(job_id: str) -> list[tuple]:
                return [(e.seq, e.type.value, e.text, time.time())
                        async for e in client.job(job_id).events(timeout=600)]

            tasks = [asyncio.create_task(read(j)) for j in ids]
            channels = [event_channel(j) for j in ids]
            while not all(n >= 1 for _, n in await client.redis.pubsub_numsub(*channels)):
                await asyncio.sleep(0.01)
            connections = int(sync.info("clients")["connected_clients"]) - 1  # less this one
            cpu0, redis0, wall0 = time.process_time(), redis_cpu_s(sync), time.perf_counter()
            publisher = subprocess.Popen([sys.executable, args.harness, "--publish", url, "--code", args.publisher_code,
                                          "--jobs", str(args.jobs), "--steps", str(args.steps),
                                          "--step-ms", str(args.step_ms)])
            streams = await asyncio.gather(*tasks)
            cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
            redis_s = redis_cpu_s(sync) - redis0
            if publisher.wait() != 0:
                raise SystemExit("the publisher failed")
            await client.aclose()
            return streams, cpu, redis_s, wall, connections

        streams, cpu, redis_s, wall, connections = asyncio.run(main())
    finally:
        stop()
    late, problems = [], []
    for job_id, events in zip(ids, streams):
        if [e[0] for e in events] != list(range(args.steps + 1)) or events[-1][1] != "done":
            problems.append(f"{job_id}: seqs {[e[0] for e in events][:5]}... ({len(events)} events)")
        late += [arrived - float(text) for _, kind, text, arrived in events if kind == "token"]
    late.sort()
    n = args.jobs * (args.steps + 1)
    return {"events": n, "connections": connections, "cpu_us": cpu / n * 1e6, "redis_us": redis_s / n * 1e6, "wall_s": wall,
            "late_p50_ms": late[len(late) // 2] * 1e3, "late_p99_ms": late[int(len(late) * 0.99)] * 1e3,
            "problems": problems}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arm", action="append", metavar="NAME=TREE", help="repeatable (default: this=.)")
    p.add_argument("--jobs", type=int, default=64, help="streams read at once")
    p.add_argument("--steps", type=int, default=300, help="token events per job")
    p.add_argument("--step-ms", type=float, default=10.0, dest="step_ms", help="one event per job this often")
    p.add_argument("--processes", type=int, default=3, help="fresh reader processes per arm")
    p.add_argument("--code", help=argparse.SUPPRESS)  # child and publisher: the code tree to import
    p.add_argument("--publish", help=argparse.SUPPRESS)  # publisher: the Redis URL
    p.add_argument("--harness", help=argparse.SUPPRESS)  # child: this script's copy
    p.add_argument("--publisher-code", dest="publisher_code", help=argparse.SUPPRESS)  # child: this tree
    args = p.parse_args()
    if args.publish:
        publish(args)
        return
    if args.code:
        print(json.dumps(child(args)))
        return

    sys.path.insert(0, str(ROOT))
    from benchmarks.common import arm_tree, command, machine, named_trees, spread, table

    arms = named_trees(args.arm)
    results: dict[str, list[dict]] = {name: [] for name, _ in arms}
    with tempfile.TemporaryDirectory() as tmp:
        trees = {name: arm_tree(spec, tmp) for name, spec in arms}
        harness = shutil.copy(__file__, Path(tmp) / "client_stream.py")  # edits during a run change nothing
        for rep in range(args.processes):
            for name, _ in (arms if rep % 2 == 0 else arms[::-1]):
                cmd = [sys.executable, harness, "--code", trees[name], "--harness", harness,
                       "--publisher-code", str(ROOT), "--jobs", str(args.jobs),
                       "--steps", str(args.steps), "--step-ms", str(args.step_ms)]
                r = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.splitlines()[-1])
                if r["problems"]:
                    sys.exit(f"arm {name}: streams differ from what was published: {r['problems'][:3]}")
                results[name].append(r)
                print(f"# process {rep} {name}: reader {r['cpu_us']:.1f} us CPU/event, Redis {r['redis_us']:.1f}, "
                      f"late p50 {r['late_p50_ms']:.2f} ms p99 {r['late_p99_ms']:.2f}", file=sys.stderr)
    print(f"# {command()}")
    print(f"# {machine()}; {args.jobs} streams x {args.steps + 1} events, one event per stream every "
          f"{args.step_ms:g} ms; {args.processes} fresh processes per arm (min / median / max over them); "
          "every stream checked: in order, exactly once\n")
    rows = []
    for name, spec in arms:
        rs = results[name]
        rows.append([f"{name} ({spec})", spread([r["cpu_us"] for r in rs], ".1f"),
                     spread([r["redis_us"] for r in rs], ".1f"), spread([r["late_p50_ms"] for r in rs], ".2f"),
                     spread([r["late_p99_ms"] for r in rs], ".2f"), max(r["connections"] for r in rs)])
    print(table(["arm", "reader CPU us / event", "Redis CPU us / event", "arrival p50 ms", "arrival p99 ms",
                 "reader's connections"], rows))


if __name__ == "__main__":
    main()
