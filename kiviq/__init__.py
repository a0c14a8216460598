"""kiviq: batch LLM generation over Redis, on MLX, with KIVI-quantized KV caches.

The public entry is the client: ``from kiviq import Client, AsyncClient``.
The packages are ``kiviq.client``, ``kiviq.jobs``, ``kiviq.worker``,
``kiviq.engine``, ``kiviq.kernels`` and ``kiviq.gateway`` (the HTTP API); in
the repository they are the six top-level folders, which pyproject.toml maps
to these dotted names.
"""

from __future__ import annotations

import os as _os

__version__ = "0.2.0"

# Running from a checkout without installing (PYTHONPATH=<repo>, as the GPU
# machine does): the six packages sit beside this folder, not inside it.
# An installed kiviq has them inside, and this adds nothing.
_root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if not _os.path.isdir(_os.path.join(__path__[0], "client")) and _os.path.isfile(
        _os.path.join(_root, "client", "__init__.py")):
    __path__.append(_root)

# MLX's CUDA backend keeps cuDNN attention graphs (one per shape) and CUDA graphs (one
# per topology) in caches that raise "Cache thrashing is happening" once a process has
# missed twice their capacity, counted over its whole life: a worker serving prompts
# of many lengths would fail every prefill of a new shape after ~512 of them. For a
# server a miss is a rebuild, not an error. MLX reads this when it makes a cache, one
# of them with the first GPU stream, so it is set here, before any kiviq module
# imports mlx; a value the user set wins (a program importing mlx first sets it itself).
_os.environ.setdefault("MLX_ENABLE_CACHE_THRASHING_CHECK", "0")

_CLIENT_NAMES = ("AsyncClient", "AsyncJobHandle", "BulkSummary", "Client", "InvalidRequest", "JobFailed",
                 "JobHandle", "QueueFull")


def __getattr__(name: str):
    # Lazy, so that importing kiviq.engine on a GPU host does not import redis.
    if name in _CLIENT_NAMES:
        from kiviq import client

        return getattr(client, name)
    raise AttributeError(f"module 'kiviq' has no attribute {name!r}")


__all__ = list(_CLIENT_NAMES)
