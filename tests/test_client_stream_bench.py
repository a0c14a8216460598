"""benchmarks/client_stream.py (what reading streams costs a client) runs each arm in
a reader process of its own against a redis-server it starts, checks every stream
arrived in order and exactly once, and reports the reader's connections."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

BENCH = str(Path(__file__).resolve().parents[1] / "benchmarks" / "client_stream.py")


def test_stream_benchmark_reads_every_stream_once_and_counts_the_connections():
    out = subprocess.run([sys.executable, BENCH, "--jobs", "6", "--steps", "5", "--step-ms", "5",
                          "--processes", "1", "--arm", "a=."], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "6 streams x 6 events" in out.stdout
    rows = [line for line in out.stdout.splitlines() if line.startswith("| a (.) |")]
    assert len(rows) == 1
    cells = [c.strip() for c in rows[0].split("|")[1:-1]]
    assert all(float(x) > 0 for x in cells[1].split(" / "))  # reader CPU per event
    # one pub/sub connection for the six streams, plus the pool's for their first log
    # reads (at most one each); a pub/sub connection per stream made it twelve
    assert int(cells[5]) <= 7
