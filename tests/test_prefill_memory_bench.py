"""benchmarks/prefill_memory.py: one prefill step's peak memory per step size and
pacer depth, each arm in a fresh process, against the bare model and the estimate."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = str(ROOT / "benchmarks" / "prefill_memory.py")
ENV = dict(os.environ, OPENBLAS_NUM_THREADS="1")


def test_each_pacer_depth_is_measured_in_a_process_of_its_own():
    cmd = [sys.executable, SCRIPT, "--shape", "smollm2-135m", "--dtype", "float32", "--row", "32",
           "--tokens", "64", "128", "--layers-ahead", "1", "2"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT, env=ENV)
    assert out.returncode == 0, out.stderr
    summary = out.stdout.split("KIVI 4-bit; a step is T / 32 prompts of 32 tokens")[1]
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in summary.splitlines()
            if line.startswith("| this |")]
    assert [(r[1], r[2]) for r in rows] == [("1", "64"), ("1", "128"), ("2", "64"), ("2", "128")]
    def per_token(cell: str) -> float:  # "GiB (KiB / token)"
        return float(cell.split("(")[1].rstrip(")").replace(",", ""))

    for r in rows:
        later = r[5].split(" / ")
        assert len(later) == 2 and all(per_token(c) > 0 for c in [r[3], r[4], *later, r[7]])


def test_step_sizes_that_are_not_whole_prompts_are_a_usage_error():
    out = subprocess.run([sys.executable, SCRIPT, "--tokens", "1000"], capture_output=True, text=True,
                         timeout=120, cwd=ROOT, env=ENV)
    assert out.returncode != 0 and out.stderr.strip() == "--tokens: give multiples of --row (1024)"
