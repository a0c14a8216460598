"""benchmarks/prefill.py --processes/--tree: the whole command in fresh processes per
code tree, interleaved, summarized per tree, tokens compared run by run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_two_trees_in_fresh_processes_are_summarized_and_their_tokens_compared():
    cmd = [sys.executable, str(ROOT / "benchmarks" / "prefill.py"), "--shape", "smollm2-135m", "--dtype", "float32",
           "--requests", "2", "--prompt-tokens", "24", "--gen", "2", "--runs", "2",
           "--processes", "1", "--tree", "a=.", "--tree", f"b={ROOT}"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT,
                         env=dict(os.environ, OPENBLAS_NUM_THREADS="1")).stdout
    rows = [line for line in out.splitlines() if line.startswith(("| a |", "| b |"))]
    assert len(rows) == 2, out
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells[1:3] == ["1", "1"]  # one process, one warm run (run 0 is cold)
        assert len(cells[3].split(" / ")) == 3 and cells[6] != "-"  # a spread, and the first run's ratio
        assert len(cells[7].split(" / ")) == 3  # the runs' memory peaks above what the engine held
    assert "tokens, run by run, every process of every tree: the same" in out
