"""The device memory an engine may hold, and the defaults sized from it.

MLX lets one process grow its arrays and its buffer cache up to its memory limit
(on CUDA 80% of the device; MLX frees cached buffers before it would pass the
limit). A worker that shares its GPU with another process (a second worker, the
benchmark's raw engine, a notebook) must not count on that much: its cache would
grow into memory the other process holds, and an allocation fails in the middle
of a run. So, on a GPU, an engine is held to what it holds already plus what the
device has free when the engine is built (``--memory-limit`` overrides), and the
default KV budget counts on the device's memory scaled by the share of MLX's own
limit the engine is held to: on a GPU of its own, the device's memory, as before.
"""

from __future__ import annotations

import os

import mlx.core as mx

KV_SHARE = 4  # the default KV budget: a quarter of device memory,
KV_MOST = 64 << 30  # at most this

_mlx_limit: int | None = None  # MLX's own limit, read before kiviq first sets one


def _info() -> dict:
    return mx.device_info() if hasattr(mx, "device_info") else {}


def total_memory() -> int:
    """The device's memory: the GPU's where MLX reports it (CUDA ``total_memory``,
    Metal ``memory_size``), else the host's RAM."""
    info = _info()
    total = info.get("memory_size") or info.get("total_memory")
    if total:
        return int(total)
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def mlx_default_limit() -> int:
    """MLX's memory limit before kiviq changed it (CUDA: 80% of the device)."""
    global _mlx_limit
    if _mlx_limit is None:
        _mlx_limit = mx.get_memory_limit()
    return _mlx_limit


def held_memory() -> int:
    """Device memory this process's MLX holds: its arrays and its buffer cache."""
    return mx.get_active_memory() + mx.get_cache_memory()


def apply_memory_limit(requested: int | None = None) -> int:
    """Hold this process's MLX allocations to ``requested`` bytes; None: on a GPU
    that reports its free memory, what this process holds plus what is free now,
    at most MLX's own limit; elsewhere MLX's own limit, unchanged. Returns the
    limit in force."""
    default = mlx_default_limit()
    if requested is None:
        free = _info().get("free_memory") if mx.default_device() == mx.gpu else None
        limit = default if free is None else min(default, held_memory() + int(free))
    else:
        limit = requested
    mx.set_memory_limit(limit)
    return limit


def counted_memory() -> int:
    """The device memory the default KV budget is sized from: the device's,
    scaled down by the share of MLX's own limit this process is held to."""
    share = min(1.0, mx.get_memory_limit() / mlx_default_limit())
    return int(total_memory() * share)


def default_kv_memory() -> int:
    """KV budget when none is given: a quarter of the counted device memory (the
    device's, on a device of its own), at most 64 GiB."""
    return min(counted_memory() // KV_SHARE, KV_MOST)
