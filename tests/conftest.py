"""Shared fixtures: a real Redis database, the real SmolLM2 model, and a
worker subprocess."""

from __future__ import annotations

import subprocess

import pytest
from redis import Redis
from worker_procs import launch_worker, stop_worker


@pytest.fixture(scope="session")
def redis_server() -> str:
    """A Redis server of the suite's own (redis-server on a free port in a
    temporary directory; the embedded server where no binary exists), stopped
    at the end. The suite never writes to a server it did not start."""
    from kiviq.client.local_redis import start_redis

    url, stop, _kind = start_redis()
    yield url
    stop()


@pytest.fixture
def redis_url(redis_server) -> str:
    """The suite's server, flushed around each test so tests never see each other's jobs."""
    conn = Redis.from_url(redis_server)
    conn.flushdb()
    yield redis_server
    conn.flushdb()


@pytest.fixture
def redis_conn(redis_url) -> Redis:
    return Redis.from_url(redis_url)


@pytest.fixture(scope="session")
def smollm2():
    """(model, tokenizer) of the default model, loaded once per session."""
    from kiviq.engine import load

    return load(None)


@pytest.fixture
def start_worker(redis_url):
    """Start `kiviq worker` (extra CLI args allowed) against the test
    database; every worker started is stopped afterwards."""
    procs = []

    def start(*args: str) -> subprocess.Popen:
        alive = sum(p.poll() is None for p in procs)
        proc = launch_worker(redis_url, *args, workers=alive + 1)
        procs.append(proc)
        return proc

    yield start
    for proc in procs:
        stop_worker(proc)


@pytest.fixture
def worker_process(start_worker):
    """A worker on its defaults (KIVI 4-bit KV cache)."""
    return start_worker()
