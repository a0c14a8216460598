"""Settings shared by the client and the worker (neither imports the other)."""

from __future__ import annotations

import os
from urllib.parse import urlsplit, urlunsplit

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"


def redis_url_from_env(redis_url: str | None = None) -> str:
    """The explicit URL, else ``$REDIS_URL``, else the local default."""
    return redis_url or os.environ.get("REDIS_URL") or DEFAULT_REDIS_URL


def redact_url(url: str) -> str:
    """The URL without its password, for messages and screens."""
    parts = urlsplit(url)
    if not parts.password:
        return url
    netloc = f"{parts.username or ''}:***@{parts.hostname or ''}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))
