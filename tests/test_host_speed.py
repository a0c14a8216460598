"""benchmarks/host_speed.py: its statistics (slow samples, streaks, whether the
processes go slow together) and a tiny real run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # benchmarks/ is not installed

from benchmarks.host_speed import streaks, summarize  # noqa: E402


def test_streaks_are_runs_of_equal_flags():
    assert streaks([True, True, False, True, False, False, False]) == [2, 1, 1, 3]
    assert streaks([False]) == [1]


def test_summary_counts_slow_samples_and_shared_moments():
    # (time, wall ms, CPU ms, CPU): process 0 slows at its 3rd and 4th samples,
    # process 1 at its 4th only; 3 of the 4 moments find both in the same mode.
    fast_slow_0 = [20.0, 21.0, 40.0, 41.0]
    fast_slow_1 = [20.0, 20.0, 20.0, 44.0]
    procs = [[(t * 0.1, w, w, 3) for t, w in enumerate(walls)] for walls in (fast_slow_0, fast_slow_1)]
    rows, agreement = summarize(procs, 0.1)
    assert [r[6] for r in rows] == ["50%", "25%"]
    assert rows[0][3:6] == ["20.0", "30.5", "41.0"]
    assert agreement.startswith("75% of sample moments")


def test_a_tiny_run_prints_its_table():
    out = subprocess.run([sys.executable, "benchmarks/host_speed.py", "--seconds", "0.3", "--processes", "2"],
                         cwd=ROOT, capture_output=True, text=True, timeout=60, check=True).stdout
    assert out.count("\n| 0 |") + out.count("\n| 1 |") == 2
    assert "hypervisor steal" in out


def test_asking_for_more_processes_than_cpus_says_what_to_do():
    n = len(os.sched_getaffinity(0)) + 1
    run = subprocess.run([sys.executable, "benchmarks/host_speed.py", "--processes", str(n)],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "ask for at most" in run.stderr and "Traceback" not in run.stderr
