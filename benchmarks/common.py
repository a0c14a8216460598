"""Small helpers shared by the benchmarks: the machine line and markdown tables."""

from __future__ import annotations

import os
import platform
import shlex
import sys


def machine() -> str:
    """One line describing where a benchmark ran (CPU count, MLX backend, BLAS)."""
    import mlx.core as mx

    device = mx.default_device()
    blas = "OpenBLAS preloaded" if "openblas" in os.environ.get("LD_PRELOAD", "") else "MLX's bundled BLAS"
    return (f"{platform.machine()} {os.cpu_count()}-core, {platform.system()}, mlx {mx.__version__} "
            f"({device} backend), {blas}, Python {platform.python_version()}")


def command() -> str:
    """The command line that is running, as it could be typed again."""
    return " ".join(shlex.quote(a) for a in [os.path.relpath(sys.argv[0])] + sys.argv[1:])


def table(header: list[str], rows: list[list[object]]) -> str:
    """A markdown table (numbers already formatted by the caller)."""
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def mib(n: int | float) -> str:
    return f"{n / 2**20:.1f} MiB"
