"""Settings shared by the client and the worker (neither imports the other)."""

from __future__ import annotations

import os

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"


def redis_url_from_env(redis_url: str | None = None) -> str:
    """The explicit URL, else ``$REDIS_URL``, else the local default."""
    return redis_url or os.environ.get("REDIS_URL") or DEFAULT_REDIS_URL
