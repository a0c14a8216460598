import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(shutil.which("docker-compose") is None,
                    reason="docker-compose binary not installed (Debian package docker-compose validates offline)")
@pytest.mark.parametrize("profile", [[], ["--profile", "gpu"]])
def test_compose_file_is_valid(profile):
    out = subprocess.run(["docker-compose", "-f", str(ROOT / "compose.yaml"), *profile, "config"],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "redis" in out.stdout and "healthcheck" in out.stdout
