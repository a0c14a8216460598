"""`kiviq top`: numbers and frames from queued jobs and worker snapshots (no
worker process: snapshots are published from a WorkerMetrics fed by hand)."""

from __future__ import annotations

import io
import json

import fakeredis
import pytest

import kiviq.client.top as top
from kiviq.client import Client
from kiviq.client.cli import main
from kiviq.worker.metrics import WorkerMetrics
from kiviq.worker.stats import StatsPublisher


def fake_worker(conn, name: str, finished: int, failed: int = 0) -> WorkerMetrics:
    """A worker's metrics after some jobs, published to Redis."""
    m = WorkerMetrics()
    for i in range(finished + failed):
        m.job_admitted(f"{name}-{i}", 0.1, "kiviq-default")
        m.first_token(f"{name}-{i}", 0.05)
        m.tokens(f"{name}-{i}", 4)
        m.job_finished(f"{name}-{i}", "finished" if i < finished else "failed", 0.3, 5, 4, finish_reason="stop")
    m.job_admitted(f"{name}-live", 0.0, "kiviq-high")
    m.step(0.02, decode_tokens=3, prefill_tokens=10, running=1, waiting=0,
           kv_used_bytes=3 << 20, kv_budget_bytes=64 << 20)
    StatsPublisher(conn, name, m).publish()
    return m


def test_collect_from_fakeredis():
    conn = fakeredis.FakeRedis()
    client = Client(connection=conn)
    for priority in ("high", "default", "default", "low"):
        client.submit(prompt="x", max_tokens=4, priority=priority)
    fake_worker(conn, "w1", finished=3, failed=1)
    fake_worker(conn, "w2", finished=2)
    data = top.collect(conn)
    assert [(q["name"], q["queued"]) for q in data["queues"]] == [
        ("kiviq-high", 1), ("kiviq-default", 2), ("kiviq-low", 1)]
    assert data["jobs"]["total"] == {"finished": 5, "failed": 1, "cancelled": 0, "timeout": 0}
    assert data["jobs"]["per_min"]["finished"] == 5  # all ended within the last minute
    assert [w["name"] for w in data["workers"]] == ["w1", "w2"]
    assert all(w["state"] == "-" and not w["registered"] for w in data["workers"])
    assert data["totals"]["running"] == 2 and data["totals"]["queued"] == 4
    json.dumps(data)
    frame = top.render_frame(data, "redis://:secret@localhost:6379/0")
    assert "secret" not in frame and "\x1b" not in frame
    assert "3.0 MiB / 64.0 MiB 5%" in frame


def test_top_once_cli_real_redis(redis_url, redis_conn, capsys):
    client = Client(redis_url)
    client.submit(prompt="x", max_tokens=4, priority="high")
    client.submit(prompt="y", max_tokens=4)
    client.submit(prompt="z", max_tokens=4)
    fake_worker(redis_conn, "gpu-worker-1", finished=2, failed=1)

    assert main(["top", "--once", "--redis-url", redis_url]) == 0
    frame = capsys.readouterr().out
    rows = {line.split()[0]: line.split() for line in frame.splitlines() if line.strip()}
    assert rows["kiviq-high"][1] == "1" and rows["kiviq-default"][1] == "2" and rows["kiviq-low"][1] == "0"
    assert rows["finished"][1:] == ["2", "2"]  # jobs/min (last 60 s), since worker start
    # two different "finished" counts, labelled so they cannot be confused
    lines = frame.splitlines()
    header = lines.index(next(line for line in lines if line.startswith("QUEUE ")))
    assert "IN RQ REGISTRIES" in lines[header - 1] and "FINISHED" in lines[header]
    assert any("result/failure TTL" in line for line in lines)
    jobs_header = next(line for line in lines if line.startswith("ENDED BY WORKERS"))
    assert "SINCE WORKER START" in jobs_header and "TOTAL" not in frame
    assert rows["failed"][1:] == ["1", "1"]
    assert rows["gpu-worker-1"][1:4] == ["-", "1", "0"]  # state, running, waiting
    assert "\x1b" not in frame

    assert main(["top", "--once", "--json", "--redis-url", redis_url]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["jobs"]["total"]["finished"] == 2 and data["jobs"]["per_min"]["finished"] == 2


def test_top_live_redraws_in_place(monkeypatch):
    conn = fakeredis.FakeRedis()
    fake_worker(conn, "w1", finished=1)
    monkeypatch.setattr(top.Redis, "from_url", staticmethod(lambda url: conn))
    calls = []

    def fake_sleep(s):
        calls.append(s)
        if len(calls) == 2:
            raise KeyboardInterrupt

    monkeypatch.setattr(top.time, "sleep", fake_sleep)
    out = io.StringIO()
    assert top.run_top("redis://x", interval=0.5, out=out) == 0
    text = out.getvalue()
    assert text.startswith("\x1b[?25l\x1b[2J") and text.endswith("\x1b[?25h")
    assert text.count("\x1b[H") == 2 and "\x1b[K" in text and calls == [0.5, 0.5]


@pytest.mark.parametrize("n, expected", [(0, "0 B"), (1536, "1.5 KiB"), (3 << 30, "3.0 GiB")])
def test_human_bytes(n, expected):
    assert top.human_bytes(n) == expected
