"""A burst of tiny jobs: all complete, the worker's memory stays bounded, and
`kiviq top` reports the throughput that really happened."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from rq import Queue
from rq.serializers import JSONSerializer

from kiviq.client import Client
from kiviq.jobs.keys import queue_name

ROOT = Path(__file__).resolve().parents[1]
N = int(os.environ.get("KIVIQ_BURST_JOBS", "400"))  # KIVIQ_BURST_JOBS=2000 for the full burst (~2 min more)


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def test_burst_of_tiny_jobs(worker_process, redis_url, redis_conn):
    client = Client(redis_url)
    warm = client.submit(prompt="Hi", max_tokens=1)
    warm.result(timeout=300)
    rss_start = rss_mb(worker_process.pid)
    started = time.monotonic()
    handles = [client.submit(prompt=f"Say {i}", max_tokens=1) for i in range(N)]
    rss_peak = rss_start
    finished = Queue(queue_name("default"), connection=redis_conn, serializer=JSONSerializer).finished_job_registry
    while finished.get_job_count(cleanup=False) < N + 1:
        assert worker_process.poll() is None
        rss_peak = max(rss_peak, rss_mb(worker_process.pid))
        assert time.monotonic() - started < 900, f"{finished.get_job_count(cleanup=False)} of {N} done"
        time.sleep(0.5)
    elapsed = time.monotonic() - started
    for h in handles[:: max(1, N // 50)]:  # spot-check results
        assert h.result(timeout=10).usage.completion_tokens <= 1
    # Bounded memory: the worker keeps no per-job state after a job ends.
    assert rss_peak - rss_start < 400, (rss_start, rss_peak)
    top = subprocess.run([sys.executable, "-m", "kiviq.client.cli", "top", "--once", "--json", "--redis-url", redis_url],
                         capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert top.returncode == 0, top.stderr
    jobs = json.loads(top.stdout)["jobs"]
    assert jobs["total"]["finished"] == N + 1
    print(f"\n{N} tiny jobs in {elapsed:.1f} s ({N / elapsed:.1f} jobs/s); worker RSS {rss_start:.0f} -> "
          f"peak {rss_peak:.0f} MB; top: {jobs['per_min']['finished']:.0f} finished/min")
