"""benchmarks/worker_loop.py (the worker's own cost per engine step) runs: every job
ends, with jobs ending in groups too, and a table row per run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

BENCH = str(Path(__file__).resolve().parents[1] / "benchmarks" / "worker_loop.py")


def test_worker_loop_benchmark_serves_every_job_with_jobs_ending_in_groups():
    out = subprocess.run([sys.executable, BENCH, "--jobs", "8", "--gen", "24", "--end-groups", "4", "--runs", "1",
                          "--max-active", "12"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "15-24 tokens, the jobs ending in 4 groups" in out.stdout
    assert "| 1 | 24 |" in out.stdout  # one run, as many steps as its longest job
