"""`kiviq worker` as a subprocess of the tests: started against a Redis URL and waited
for until rq counts it, stopped with SIGTERM (killed after 30 s). The log goes to a file
(``proc.log_path``) that a failure prints."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from redis import Redis

ROOT = Path(__file__).resolve().parents[1]


def worker_count(conn: Redis) -> int:
    from rq import Worker

    return len(Worker.all(connection=conn))


def launch_worker(redis_url: str, *args: str, workers: int = 1) -> subprocess.Popen:
    """Start `kiviq worker --redis-url redis_url *args` and wait (up to 180 s) until rq
    counts `workers` workers on that server, this one included."""
    log_path = Path(os.environ.get("PYTEST_TMPDIR", "/tmp")) / f"kiviq-worker-{os.getpid()}-{time.time_ns()}.log"
    log_file = open(log_path, "w")
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "kiviq.worker", "--redis-url", redis_url, *args],
        cwd=ROOT, env=env, stdout=log_file, stderr=subprocess.STDOUT,
    )
    proc.log_path, proc.log_file = log_path, log_file
    conn = Redis.from_url(redis_url)
    deadline = time.monotonic() + 180
    while worker_count(conn) < workers:
        if proc.poll() is not None or time.monotonic() > deadline:
            pytest.fail(f"worker did not start:\n{log_path.read_text()[-4000:]}")
        time.sleep(0.2)
    return proc


def stop_worker(proc: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL after 30 s; closes its log."""
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
    proc.log_file.close()
