"""benchmarks/service_compare.py: builds' warm runs summarized from service.py's
--json files (each process's first run apart), and a one-line error for a bad argument."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import service_compare  # noqa: E402


def process_json(path: Path, service_tok_s: list[float], raw_tok_s: list[float],
                 load_busy: tuple[float, float] | None = None) -> Path:
    """What service.py --json writes, reduced to the fields the comparison reads."""
    runs = len(service_tok_s)
    data = {
        "service": [{"generated_tok_s": s, "wall_s": 16384 / s, "first_all_s": 1.0 + (i == 0) * 0.5,
                     "ttft_p50_s": 1.2} for i, s in enumerate(service_tok_s)],
        "raw": [{"generated_tok_s": r, "wall_s": 16384 / r, "first_all_s": 0.9} for r in raw_tok_s],
        "service_steps": [{"steps": 100, "step_s": 16384 / s - 0.05, "publish": 0.01, "cancel_check": 0.0,
                           "admit_housekeeping": 0.01} for s in service_tok_s],
        "raw_steps": [{"steps": 100, "step_s": 16384 / r} for r in raw_tok_s][:runs],
    }
    if load_busy:
        data["cpu_busy"] = {"service": [{"worker": 1.0, "load": load_busy[0]}] * runs,
                            "raw": [{"worker": 1.0, "load": load_busy[1]}] * runs}
    path.write_text(json.dumps(data))
    return path


def test_builds_are_summarized_over_warm_runs_and_compared(tmp_path, capsys):
    a = process_json(tmp_path / "a.json", [1000.0, 3000.0, 3300.0], [3400.0, 3500.0, 3500.0])
    b = process_json(tmp_path / "b.json", [1500.0, 3400.0, 3500.0], [3500.0, 3500.0, 3500.0], load_busy=(0.8, 0.1))
    service_compare.main([f"this={a}", f"old={b}"])
    out = capsys.readouterr().out
    this = next(line for line in out.splitlines() if line.startswith("| this |"))
    cells = [c.strip() for c in this.strip("|").split("|")]
    assert cells[1:4] == ["1", "2", "3,000 / 3,150 / 3,300"]  # the first run (1000 tok/s) is not a warm run
    assert cells[5] == "0.857 / 0.900 / 0.943"
    assert cells[7] == "+2.34 / +4.82 / +7.30"  # engine.step against the raw engine's, ms per step
    assert cells[10] == "3.14x / 1.50x"  # the first run against the median warm run
    decode = (16384 / 3000 + 16384 / 3300) / 2 - 1.0  # the warm runs' median, after all first tokens at 1.0 s
    assert cells[11] == f"{decode:.2f} / {16384 / 3500 - 0.9:.2f}"  # decode phases, s
    assert cells[12] == "-"  # a file from before the load was measured
    old = next(line for line in out.splitlines() if line.startswith("| old |"))
    assert [c.strip() for c in old.strip("|").split("|")][12] == "0.80 / 0.10"
    assert "permutation p (two-sided)" in out and "processes' means as the samples 1.000" in out  # one process each


def test_a_bad_argument_is_one_line(tmp_path):
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "service_compare.py"), f"x={tmp_path}/none.json"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "no such file" in out.stderr and "Traceback" not in out.stderr


def test_permutation_p_separates_distinct_samples_from_equal_ones():
    assert service_compare.permutation_p([1.0] * 8, [2.0] * 8) < 0.01
    assert service_compare.permutation_p([1.0, 2.0] * 4, [2.0, 1.0] * 4) == pytest.approx(1.0)
