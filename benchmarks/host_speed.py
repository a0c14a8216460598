"""How steady is this machine's host speed? A fixed pure-Python loop
(``common.probe_work``), timed again and again in a few concurrent processes,
each pinned to a CPU of its own.

Why: kiviq's decode steps are host-bound, so every step time is partly a
reading of the host's speed. On the H200 leases the same build's step time
differed 1.5-2x between fresh processes; this tells whether that speed belongs
to a process (then comparing processes compares builds) or to the moment
(then it moves within a process and only interleaved, repeated measurements
compare builds). Per sample it records wall time and the thread's CPU time: CPU
time that keeps up with the wall clock while both grow means the CPU itself ran
slower, not that the thread was waiting for one.

    python benchmarks/host_speed.py --seconds 20 --processes 4
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import command, current_cpu, probe_work, table  # noqa: E402

SLOW = 1.5  # a sample this many times the fastest of its process counts as slow


def sample(seconds: float, interval: float, cpu: int | None) -> list[tuple[float, float, float, int | None]]:
    """(time, wall ms, thread CPU ms, CPU) of one probe every ``interval`` s."""
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})
    out, end = [], time.monotonic() + seconds
    while time.monotonic() < end:
        t0, c0 = time.perf_counter(), time.thread_time()
        probe_work()
        t1, c1 = time.perf_counter(), time.thread_time()
        out.append((time.time(), (t1 - t0) * 1e3, (c1 - c0) * 1e3, current_cpu()))
        time.sleep(interval)
    return out


def steal_share(before: list[int], after: list[int]) -> float:
    """The share of the machine's CPU time the hypervisor took (/proc/stat)."""
    delta = [b - a for a, b in zip(before, after)]
    return delta[7] / max(1, sum(delta[:8])) if len(delta) > 7 else float("nan")


def cpu_times() -> list[int]:
    try:
        return [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    except (OSError, ValueError):
        return []


def streaks(flags: list[bool]) -> list[int]:
    """Lengths of the runs of equal consecutive flags."""
    runs, n = [], 0
    for i, f in enumerate(flags):
        n += 1
        if i + 1 == len(flags) or flags[i + 1] != f:
            runs.append(n)
            n = 0
    return runs


def summarize(per_process: list[list], interval: float) -> tuple[list[list], str]:
    rows = []
    for i, samples in enumerate(per_process):
        wall = [s[1] for s in samples]
        fastest = min(wall)
        slow = [w > SLOW * fastest for w in wall]
        ratio = [s[2] / s[1] for s in samples]
        period = statistics.median([b[0] - a[0] for a, b in zip(samples, samples[1:])] or [interval])
        rows.append([i, samples[0][3], len(wall), f"{fastest:.1f}", f"{statistics.median(wall):.1f}",
                     f"{max(wall):.1f}", f"{100 * sum(slow) / len(slow):.0f}%",
                     f"{statistics.median(streaks(slow)) * period:.2f}",
                     f"{min(ratio):.2f}-{max(ratio):.2f}"])
    # Same moment, different processes: do they go slow together?
    n = min(len(p) for p in per_process)
    agree = 0
    for k in range(n):
        flags = {p[k][1] > SLOW * min(s[1] for s in p) for p in per_process}
        agree += len(flags) == 1
    return rows, f"{100 * agree / max(1, n):.0f}% of sample moments found every process in the same mode"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=20.0)
    p.add_argument("--processes", type=int, default=4, help="concurrent processes, one CPU each")
    p.add_argument("--interval", type=float, default=0.1, help="seconds between probes")
    p.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child is not None:
        print(json.dumps(sample(args.seconds, args.interval, args.child if args.child >= 0 else None)))
        return 0
    cpus = sorted(os.sched_getaffinity(0))
    if args.processes > len(cpus):
        p.error(f"--processes {args.processes}: only {len(cpus)} CPUs are available; ask for at most that many")
    # Spread the processes over the CPUs (the last ones: the first often take interrupts).
    chosen = cpus[::-1][:args.processes] if args.processes > 1 else [-1]
    before = cpu_times()
    procs = [subprocess.Popen([sys.executable, __file__, "--child", str(c), "--seconds", str(args.seconds),
                               "--interval", str(args.interval)], stdout=subprocess.PIPE, text=True)
             for c in chosen]
    per_process = [json.loads(proc.communicate()[0]) for proc in procs]
    steal = steal_share(before, cpu_times())
    rows, agreement = summarize(per_process, args.interval)
    print(f"# {command()}\n")
    print(table(["process", "CPU", "samples", "fastest ms", "median ms", "slowest ms", "slow samples",
                 "median streak s", "CPU time / wall"], rows))
    print(f"\nSlow: above {SLOW}x the process's fastest. {agreement}; hypervisor steal "
          f"{100 * steal:.1f}% of all CPU time meanwhile (/proc/stat).")
    return 0


if __name__ == "__main__":
    sys.exit(main())
