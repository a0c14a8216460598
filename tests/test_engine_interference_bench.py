"""benchmarks/engine_interference.py: arms interleaved on the same prompts, their
tokens compared, the decode step summarized per arm."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.engine_interference import Spinners, parse_arm  # noqa: E402


def test_arms_run_on_the_same_prompts_and_are_summarized():
    cmd = [sys.executable, str(ROOT / "benchmarks" / "engine_interference.py"), "--shape", "smollm2-135m",
           "--dtype", "float32", "--requests", "2", "--prompt-tokens", "24", "--gen", "3", "--rounds", "2",
           "--arms", "none", "outbox"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT,
                          env=dict(os.environ, OPENBLAS_NUM_THREADS="1"))
    assert done.returncode == 0, done.stderr[-2000:]
    out = done.stdout
    assert "every round's arms gave the same tokens" in out
    rows = {line.split("|")[1].strip(): line for line in out.splitlines() if line.startswith(("| none", "| outbox"))}
    assert set(rows) == {"none", "outbox"}
    for row in rows.values():
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells[1] == "2" and len(cells[2].split(" / ")) == 3
    assert "outbox stand-in: encoding a step's events took" in out


def test_arm_names_are_checked():
    assert parse_arm("load:3") == ("load", 3)
    assert parse_arm("none") == ("none", 0)
    for bad in ("load", "load:0", "outbox:2", "spin"):
        with pytest.raises(argparse.ArgumentTypeError, match="use none, outbox or load:N"):
            parse_arm(bad)


def test_spinners_run_only_inside_their_block():
    cpu = min(os.sched_getaffinity(0))
    with Spinners(2, [cpu]) as spinners:
        assert all(p.poll() is None for p in spinners.procs) and len(spinners.procs) == 2
    assert all(p.poll() is not None for p in spinners.procs)
