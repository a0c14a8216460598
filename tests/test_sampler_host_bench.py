"""benchmarks/sampler_host.py times each kind of batch for this tree and a git
revision's sampler, and fails when their tokens differ."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCH = str(ROOT / "benchmarks" / "sampler_host.py")


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, BENCH, "--batch", "4", "--vocab", "512", "--calls", "2", *args],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)


def test_this_tree_against_head_gives_the_same_tokens_and_a_row_per_arm():
    out = run("--rev", "HEAD", "--kind", "mixed", "every row seeded")
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [line for line in out.stdout.splitlines() if line.startswith("| 4 |")]
    assert [(r.split("|")[2].strip(), r.split("|")[3].strip()) for r in rows] == [
        ("mixed", "this tree"), ("mixed", "HEAD"), ("every row seeded", "this tree"), ("every row seeded", "HEAD")]
    assert "calls whose tokens differed between the arms: 0" in out.stdout


def test_an_unknown_revision_is_one_line():
    out = run("--rev", "no-such-revision")
    assert out.returncode != 0 and "--rev no-such-revision: git show failed" in out.stderr
    assert "Traceback" not in out.stderr
