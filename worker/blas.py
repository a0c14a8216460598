"""OpenBLAS for the CPU worker.

MLX's Linux CPU wheel links the reference BLAS; preloading Debian/Ubuntu's
OpenBLAS makes CPU float32 matmuls ~20x faster (DESIGN.md). A preload only
takes effect at process start, so the worker re-executes itself once with it.
This module imports nothing heavy: it runs before mlx is loaded.
"""

from __future__ import annotations

import glob
import os
import sys

OPENBLAS_GLOBS = ["/usr/lib/*-linux-gnu/openblas-pthread/libopenblas.so.0"]


def openblas_env() -> dict[str, str]:
    """The environment with OpenBLAS preloaded, where it exists and helps
    (``KIVIQ_OPENBLAS=0`` turns it off)."""
    env = dict(os.environ)
    if not sys.platform.startswith("linux") or env.get("KIVIQ_OPENBLAS") == "0":
        return env
    if "openblas" in env.get("LD_PRELOAD", ""):
        return env
    found = sorted(p for g in OPENBLAS_GLOBS for p in glob.glob(g))
    if found:
        env["LD_PRELOAD"] = ":".join(filter(None, [found[0], env.get("LD_PRELOAD")]))
    return env


def reexec_with_openblas(argv: list[str]) -> None:
    """Replace this process by ``python -m kiviq.worker argv`` with OpenBLAS
    preloaded, unless it already is (or there is none)."""
    env = openblas_env()
    if env.get("LD_PRELOAD") != os.environ.get("LD_PRELOAD"):
        os.execve(sys.executable, [sys.executable, "-m", "kiviq.worker", *argv], env)
