"""Find a Redis for the demo, or start one: the quick start must work on a
machine that has none."""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable

from redis import Redis
from redis.exceptions import RedisError


def answers(url: str) -> bool:
    try:
        return bool(Redis.from_url(url, socket_connect_timeout=1).ping())
    except (RedisError, OSError):
        return False


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ensure_redis(url: str) -> tuple[str, Callable[[], None], str]:
    """Return a URL of a Redis that answers, a function that stops whatever was
    started (a no-op if nothing was), and a word saying which one it is.

    Order: the given URL; else one started by ``start_redis``.
    """
    if answers(url):
        return url, lambda: None, "existing"
    return start_redis()


def start_redis() -> tuple[str, Callable[[], None], str]:
    """Start a Redis of our own on a free port (a ``redis-server`` binary in a
    temporary directory, else an embedded server) and return its URL, the
    function that stops it, and which kind it is. Never reuses a running server."""
    port = free_port()
    binary = shutil.which("redis-server")
    if binary:
        workdir = tempfile.mkdtemp(prefix="kiviq-redis-")
        proc = subprocess.Popen(
            [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", workdir],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        started = f"redis://127.0.0.1:{port}/0"
        _wait_until_up(started)

        def stop() -> None:
            proc.terminate()
            proc.wait(timeout=10)
            shutil.rmtree(workdir, ignore_errors=True)

        return started, stop, "redis-server"
    from fakeredis import TcpFakeServer  # fallback only: no server binary here

    server = TcpFakeServer(("127.0.0.1", port), server_type="redis")
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    started = f"redis://127.0.0.1:{port}/0"
    _wait_until_up(started)

    def stop_embedded() -> None:
        server.shutdown()
        server.server_close()

    return started, stop_embedded, "embedded"


def _wait_until_up(url: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not answers(url):
        if time.monotonic() > deadline:
            raise RuntimeError(f"a Redis server was started but does not answer at {url}")
        time.sleep(0.05)
