"""Priority queues are drained high -> default -> low, and the worker and
queues show up in `rq info`."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from kiviq.client import Client

ROOT = Path(__file__).resolve().parents[1]


def test_high_priority_jobs_run_first_and_rq_info_lists_worker(start_worker, redis_url):
    client = Client(redis_url)
    low = [client.submit(prompt=f"low {i}", max_tokens=1, priority="low") for i in range(3)]
    default = [client.submit(prompt=f"default {i}", max_tokens=1) for i in range(3)]
    high = [client.submit(prompt=f"high {i}", max_tokens=1, priority="high") for i in range(3)]
    start_worker("--max-active", "1")  # one at a time: admission order is visible
    started = {}
    for name, handles in (("low", low), ("default", default), ("high", high)):
        for h in handles:
            h.result(timeout=120)
            started[h.job_id] = (name, h._job().started_at)
    order = [name for name, _ in sorted(started.values(), key=lambda v: v[1])]
    assert order == ["high"] * 3 + ["default"] * 3 + ["low"] * 3
    rq = Path(sys.executable).with_name("rq")
    info = subprocess.run([str(rq) if rq.exists() else "rq", "info", "--url", redis_url],
                          capture_output=True, text=True, timeout=60, cwd=ROOT, env=dict(os.environ))
    assert info.returncode == 0, info.stderr
    for name in ("kiviq-high", "kiviq-default", "kiviq-low"):
        assert name in info.stdout
    assert "1 workers" in info.stdout


def _wait_for(cond, timeout: float, what: str):
    import time

    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_rq_sees_all_queues_from_start_and_worker_idle_or_busy(start_worker, redis_url, redis_conn):
    from rq import Queue, Worker

    # nothing was ever enqueued: the worker itself registers its queues
    start_worker()
    assert {q.name for q in Queue.all(connection=redis_conn)} >= {"kiviq-high", "kiviq-default", "kiviq-low"}

    def state() -> str:
        (worker,) = Worker.all(connection=redis_conn)
        return str(getattr(worker.get_state(), "value", worker.get_state()))

    _wait_for(lambda: state() == "idle", 30, "idle worker")
    client = Client(redis_url)
    job = client.submit(prompt="Count from one to one thousand: one, two,", max_tokens=60)  # seconds on a CPU
    next(job.stream(timeout=120))  # its sequence is running
    assert state() == "busy"
    job.result(timeout=300)
    _wait_for(lambda: state() == "idle", 30, "idle worker after the job")
