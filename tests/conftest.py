"""Shared fixtures: a real Redis database, the real SmolLM2 model, and a
worker subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from redis import Redis

ROOT = Path(__file__).resolve().parents[1]


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


def _worker_count(conn: Redis) -> int:
    from rq import Worker

    return len(Worker.all(connection=conn))


@pytest.fixture
def start_worker(redis_url, redis_conn):
    """Start `kiviq worker` (extra CLI args allowed) against the test
    database; every worker started is stopped afterwards."""
    procs = []

    def start(*args: str) -> subprocess.Popen:
        log_path = Path(os.environ.get("PYTEST_TMPDIR", "/tmp")) / f"kiviq-worker-{os.getpid()}-{time.time_ns()}.log"
        log_file = open(log_path, "w")
        env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
        proc = subprocess.Popen(
            [sys.executable, "-m", "kiviq.worker", "--redis-url", redis_url, *args],
            cwd=ROOT, env=env, stdout=log_file, stderr=subprocess.STDOUT,
        )
        proc.log_path, proc.log_file = log_path, log_file
        procs.append(proc)
        deadline = time.monotonic() + 180
        while _worker_count(redis_conn) < sum(p.poll() is None for p in procs):
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"worker did not start:\n{log_path.read_text()[-4000:]}")
            time.sleep(0.2)
        return proc

    yield start
    for proc in procs:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        proc.log_file.close()


@pytest.fixture
def worker_process(start_worker):
    """A worker on its defaults (KIVI 4-bit KV cache)."""
    return start_worker()
