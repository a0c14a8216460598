"""benchmarks/events_host.py (the engine's scheduling and events per decode step) runs
each arm in its own process, times every step it was asked for, and two arms of the
same code stream the same text."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

BENCH = str(Path(__file__).resolve().parents[1] / "benchmarks" / "events_host.py")


def test_events_benchmark_times_each_arm_and_hashes_the_same_text_for_the_same_code():
    out = subprocess.run([sys.executable, BENCH, "--batch", "3", "--steps", "6", "--warmup", "2", "--processes", "1",
                          "--arm", "a=.", "--arm", "b=."], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [line for line in out.stdout.splitlines() if line.startswith("| 3 |")]
    assert [r.split("|")[2].strip() for r in rows] == ["a (.)", "b (.)"]
    digests = {r.split("|")[6].strip() for r in rows}
    assert len(digests) == 1 and re.fullmatch(r"[0-9a-f]{12}", digests.pop())
    assert "6 timed steps per process" in out.stdout
