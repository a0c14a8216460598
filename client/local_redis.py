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


def start_redis(attempts: int = 5) -> tuple[str, Callable[[], None], str]:
    """Start a Redis of our own on a free port (a ``redis-server`` binary in a
    temporary directory, else an embedded server) and return its URL, the
    function that stops it, and which kind it is. Never reuses a running server:
    a port is free when we pick it but another process may take it before our
    server binds it (two test processes starting at once), so the server that
    answers must be ours (its process id), else we try another port."""
    binary = shutil.which("redis-server")
    for _ in range(attempts):
        started = _start_binary(binary) if binary else _start_embedded()
        if started is not None:
            return started
    raise RuntimeError(f"could not start a Redis of our own in {attempts} attempts (ports taken meanwhile)")


def _start_binary(binary: str) -> tuple[str, Callable[[], None], str] | None:
    port = free_port()
    workdir = tempfile.mkdtemp(prefix="kiviq-redis-")
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", workdir],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    started = f"redis://127.0.0.1:{port}/0"

    def stop() -> None:
        proc.terminate()
        proc.wait(timeout=10)
        shutil.rmtree(workdir, ignore_errors=True)

    try:
        _wait_until_up(started)
    except RuntimeError:  # nothing answers: our server did not start (no race)
        stop()
        raise
    try:
        pid = Redis.from_url(started).info("server").get("process_id")
    except RedisError:  # e.g. a server that wants a password: not ours either
        pid = None
    if pid != proc.pid:
        stop()  # someone else's server took the port first: never use it
        return None
    return started, stop, "redis-server"


def _start_embedded() -> tuple[str, Callable[[], None], str] | None:
    from fakeredis import TcpFakeServer  # fallback only: no server binary here

    port = free_port()
    try:
        server = TcpFakeServer(("127.0.0.1", port), server_type="redis")
    except OSError:  # the port was taken meanwhile
        return None
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
