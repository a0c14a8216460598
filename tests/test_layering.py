"""The package layering, checked from the source: imports run one way,
gateway -> client -> jobs <- worker -> engine -> kernels (nothing imports
the gateway), and the light packages never
pull in the heavy stacks (a client machine needs no mlx, a GPU host needs no
redis to run the engine)."""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("gateway", "client", "jobs", "worker", "engine", "kernels")
# package -> the kiviq packages and third-party roots it must never import
FORBIDDEN = {
    "gateway": {"worker", "engine", "kernels", "mlx", "mlx_lm"},
    "client": {"gateway", "worker", "engine", "kernels", "mlx", "mlx_lm", "starlette", "uvicorn", "fastapi"},
    "jobs": {"gateway", "client", "worker", "engine", "kernels", "mlx", "mlx_lm", "starlette", "uvicorn"},
    "worker": {"gateway", "client", "starlette", "uvicorn"},
    "engine": {"gateway", "client", "jobs", "worker", "redis", "rq", "pydantic"},
    "kernels": {"gateway", "client", "jobs", "worker", "engine", "mlx_lm", "redis", "rq", "pydantic"},
}


def imported_roots(path: Path) -> set[str]:
    """Every module a file imports (module level or inside functions), as the
    kiviq package name ('engine') or the third-party root ('mlx')."""
    roots = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        for name in names:
            parts = name.split(".")
            roots.add(parts[1] if parts[0] == "kiviq" and len(parts) > 1 else parts[0])
    return roots


@pytest.mark.parametrize("package", PACKAGES)
def test_imports_run_one_way(package):
    bad = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        found = imported_roots(path) & FORBIDDEN[package]
        if found:
            bad[str(path.relative_to(ROOT))] = sorted(found)
    assert not bad, f"{package}/ imports what it must not: {bad}"


def test_the_gateway_loads_without_mlx_and_the_client_without_the_gateway(tmp_path):
    pytest.importorskip("starlette")
    out = _run("""
        import sys
        import kiviq.gateway.app, kiviq.gateway.cli
        assert not any(m == "mlx" or m.startswith("mlx.") for m in sys.modules), "the gateway imported mlx"
        import kiviq.client.cli
        """, tmp_path)
    assert out.returncode == 0, out.stderr
    out = _run("""
        import sys
        from kiviq import Client
        import kiviq.client.cli, kiviq.client.bulk, kiviq.client.top
        loaded = sorted(m for m in ("starlette", "uvicorn", "kiviq.gateway") if m in sys.modules)
        assert not loaded, f"the client imported {loaded}"
        """, tmp_path)
    assert out.returncode == 0, out.stderr


def test_the_checker_sees_function_level_imports(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("def f():\n    from kiviq.worker.main import run_worker\n    import mlx.core\n")
    assert imported_roots(f) == {"worker", "mlx"}


def _run(code: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=cwd, capture_output=True,
                          text=True, timeout=120)


def test_user_modules_named_like_ours_do_not_shadow_kiviq(tmp_path):
    """A project with its own client.py and engine/ still gets kiviq's client."""
    (tmp_path / "client.py").write_text("raise RuntimeError('the user client was imported')\n")
    (tmp_path / "engine").mkdir()
    (tmp_path / "engine" / "__init__.py").write_text("raise RuntimeError('the user engine was imported')\n")
    out = _run("""
        import client  # the user's own module, found first on sys.path
        """, tmp_path)
    assert "the user client was imported" in out.stderr  # the trap is real
    out = _run("""
        from kiviq import AsyncClient, Client
        import kiviq.engine.scheduler, kiviq.client.client
        print(Client.__module__, AsyncClient.__module__, kiviq.engine.scheduler.__name__)
        """, tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["kiviq.client.client", "kiviq.client.async_client", "kiviq.engine.scheduler"]


def test_the_client_loads_without_mlx_and_the_engine_without_redis(tmp_path):
    out = _run("""
        import sys
        from kiviq import Client
        import kiviq.jobs
        assert not any(m == "mlx" or m.startswith("mlx.") for m in sys.modules), "client imported mlx"
        """, tmp_path)
    assert out.returncode == 0, out.stderr
    out = _run("""
        import sys
        import kiviq.engine, kiviq.kernels
        heavy = sorted(m for m in ("redis", "rq", "pydantic") if m in sys.modules)
        assert not heavy, f"the engine imported {heavy}"
        """, tmp_path)
    assert out.returncode == 0, out.stderr
