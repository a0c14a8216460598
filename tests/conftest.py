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
# A database of its own, flushed around each test, so tests never see each
# other's jobs (or a developer's).
TEST_REDIS_URL = os.environ.get("KIVIQ_TEST_REDIS_URL", "redis://127.0.0.1:6379/15")


@pytest.fixture
def redis_url() -> str:
    conn = Redis.from_url(TEST_REDIS_URL)
    try:
        conn.ping()
    except Exception as e:  # the suite's contract: a real server runs
        pytest.fail(f"no Redis server at {TEST_REDIS_URL} ({e}); .ci/run starts one")
    conn.flushdb()
    yield TEST_REDIS_URL
    conn.flushdb()


@pytest.fixture
def redis_conn(redis_url) -> Redis:
    return Redis.from_url(redis_url)


@pytest.fixture(scope="session")
def smollm2():
    """(model, tokenizer) of the default model, loaded once per session."""
    from engine import load

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
            [sys.executable, "-m", "client.cli", "worker", "--redis-url", redis_url, *args],
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
