"""Host time of the engine's scheduler per decode step: ``Scheduler.schedule()`` with B
sequences decoding and nothing waiting, the steady state of a bulk run.

A decode step on a GPU is host-bound (docs/performance.md, "Open targets"), so every
pass over the running sequences counts. The sequences hold real block counts (the
block allocator's arithmetic, G = 32, R = 128); nothing else of the engine runs.
With ``--rev REV`` the scheduler of that git revision (engine/scheduler.py, loaded
beside this tree's) is timed too, the two interleaved in one process (A/B/B/A...),
each on its own copy of the same sequences.

    python benchmarks/scheduler_host.py --batch 32 128 --rev HEAD~1
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import revision_arms, table  # noqa: E402
from kiviq.engine import scheduler as this_scheduler  # noqa: E402
from kiviq.engine.request import Request  # noqa: E402
from kiviq.engine.sequence import Sequence, Status  # noqa: E402


class _Blocks:
    """The engine's block allocator as the scheduler sees it (its arithmetic, room for all)."""

    group_size, residual, flush_blocks = 32, 128, 1
    free_blocks = 10**9
    free_slots = 10**6

    def blocks_needed(self, num_tokens: int) -> int:
        g, r, kg = self.group_size, self.residual, self.flush_blocks * self.group_size
        return 0 if num_tokens < r + kg else (num_tokens - r) // kg * (kg // g)

    def blocks_held(self, seq) -> int:
        return len(seq.kv.block_ids) if seq.kv is not None else 0


class _KV:
    def __init__(self, blocks: int):
        self.block_ids = list(range(blocks))


def scheduler_of(module, batch: int, context: int):
    """`module`'s Scheduler with `batch` sequences of ~`context` tokens decoding."""
    s = module.Scheduler(_Blocks(), max_batch_tokens=8192)
    for i in range(batch):
        seq = Sequence(Request(f"r{i}", list(range(context + i)), 256), arrival=i)
        seq.kv = _KV(_Blocks().blocks_needed(seq.num_tokens))
        seq.status = Status.RUNNING
        s.running.append(seq)
    return s


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, nargs="+", default=[32, 128])
    p.add_argument("--context", type=int, default=1200, help="tokens of the first sequence")
    p.add_argument("--rev", default=None, help="also time this git revision's scheduler")
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--calls", type=int, default=200, help="schedule() calls per arm per round")
    a = p.parse_args()
    modules = revision_arms(this_scheduler, a.rev, "engine/scheduler.py")
    rows = []
    for batch in a.batch:
        arms = {name: scheduler_of(m, batch, a.context) for name, m in modules.items()}
        times = {name: [] for name in arms}
        for r in range(a.rounds):
            order = list(arms.items())
            for name, s in (order if r % 2 == 0 else order[::-1]):
                for _ in range(a.calls):
                    t = time.perf_counter()
                    s.schedule()
                    times[name].append(time.perf_counter() - t)
        for name, v in times.items():
            v.sort()
            rows.append([batch, name, f"{v[0] * 1e6:.1f} / {statistics.median(v) * 1e6:.1f} / {v[-1] * 1e6:.1f}"])
    print(f"# {' '.join(sys.argv)}; Python {sys.version.split()[0]}")
    print(table(["B", "scheduler", "schedule() us min / median / max"], rows))


if __name__ == "__main__":
    main()
