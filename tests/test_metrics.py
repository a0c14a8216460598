"""WorkerMetrics, the Prometheus exposition, the /metrics endpoint and the
per-worker stats publisher."""

from __future__ import annotations

import json
import math
import re
import socket
import time
import urllib.error
import urllib.request
from types import SimpleNamespace

import fakeredis
import pytest

from kiviq.jobs.keys import worker_stats_key
from kiviq.worker.metrics import Histogram, StatsPublisher, WorkerMetrics, format_value, serve_metrics


class FakeClock:
    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


# ---- a tiny exposition-format parser -------------------------------------------

NAME = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
LABEL = r'[a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\\n]|\\[\\"n])*"'
SAMPLE = re.compile(rf"^({NAME})(\{{{LABEL}(?:,{LABEL})*\}})? (\S+)$")
VALUE = re.compile(r"^(?:[+-]?Inf|NaN|[+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)$")


def parse_exposition(text: str) -> dict[str, dict]:
    """Check the text format and return {family: {"type": t, "samples": [(name, labels, value)]}}.

    Every sample line is ``name{labels} value``; every sample belongs to a
    family declared by a ``# TYPE`` line before it; histogram buckets are
    cumulative and end in +Inf == _count.
    """
    assert text.endswith("\n")
    families: dict[str, dict] = {}
    for line in text.splitlines():
        assert line.strip(), "no blank lines"
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ", 3)
            assert re.fullmatch(NAME, name) and kind in ("counter", "gauge", "histogram", "summary", "untyped")
            assert name not in families, f"{name} declared twice"
            families[name] = {"type": kind, "samples": []}
            continue
        if line.startswith("# HELP ") or line.startswith("#"):
            continue
        m = SAMPLE.match(line)
        assert m, f"bad sample line: {line!r}"
        name, raw_labels, value = m.groups()
        assert VALUE.match(value), f"bad value in {line!r}"
        labels = dict(re.findall(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"', raw_labels or ""))
        family = name
        if name not in families:
            for suffix in ("_bucket", "_sum", "_count"):
                if name.endswith(suffix) and families.get(name[: -len(suffix)], {}).get("type") == "histogram":
                    family = name[: -len(suffix)]
        assert family in families, f"sample {name} has no # TYPE before it"
        families[family]["samples"].append((name, labels, float(value)))
    for fam, info in families.items():
        if info["type"] != "histogram":
            continue
        groups: dict[tuple, list] = {}
        counts = {}
        for name, labels, v in info["samples"]:
            key = tuple(sorted((k, x) for k, x in labels.items() if k != "le"))
            if name.endswith("_bucket"):
                groups.setdefault(key, []).append((float(labels["le"]), v))
            elif name.endswith("_count"):
                counts[key] = v
        for key, buckets in groups.items():
            bounds = [b for b, _ in buckets]
            assert bounds == sorted(bounds) and math.isinf(bounds[-1]), fam
            vals = [v for _, v in buckets]
            assert vals == sorted(vals), f"{fam} buckets not cumulative"
            assert vals[-1] == counts[key], f"{fam}: +Inf bucket != _count"
    return families


def value_of(families: dict, name: str, **labels) -> float:
    """Sum of the samples called ``name`` matching ``labels``."""
    family = name if name in families else re.sub(r"_(bucket|sum|count)$", "", name)
    return sum(v for n, lab, v in families[family]["samples"]
               if n == name and all(lab.get(k) == x for k, x in labels.items()))


# ---- unit tests -------------------------------------------------------------------

def test_histogram_bucket_math():
    h = Histogram([5, 1, 2])  # sorted on construction
    for v in (0.5, 1.0, 1.5, 10.0):  # 1.0 lands in le=1 (bounds are inclusive)
        h.observe(v)
    h.observe(2.0, n=2)
    assert h.bounds == (1.0, 2.0, 5.0)
    assert h.cumulative() == [(1.0, 2), (2.0, 5), (5.0, 5), (math.inf, 6)]
    assert h.count == 6 and h.sum == pytest.approx(17.0)
    assert h.quantile(0.5) == pytest.approx(1.0 + (3 - 2) / 3)  # rank 3 inside (1, 2]
    assert h.quantile(1.0) == 5.0  # +Inf bucket: the largest finite bound
    assert Histogram([1]).quantile(0.5) is None


def test_format_value():
    assert format_value(3) == "3" and format_value(2.0) == "2" and format_value(0.25) == "0.25"
    assert format_value(math.inf) == "+Inf" and format_value(float("nan")) == "NaN"


def test_counters_gauges_and_no_double_counting():
    clock = FakeClock()
    m = WorkerMetrics(clock=clock)
    m.job_admitted("a", 0.3, "kiviq-default")
    m.job_admitted("b", 2.0, "kiviq-high")
    m.first_token("a", 0.05)
    m.tokens("a", 1)
    m.step(0.02, decode_tokens=0, prefill_tokens=12, running=2, waiting=0, kv_used_bytes=250, kv_budget_bytes=1000)
    clock.t += 0.1
    m.tokens("a", 1)
    m.tokens("a", 1)  # 3 tokens reported live ...
    m.job_finished("a", "finished", 0.5, prompt_tokens=12, completion_tokens=4, finish_reason="length")  # ... 4 in all
    m.job_finished("b", "failed", 0.1, prompt_tokens=7, completion_tokens=0)

    fam = parse_exposition(m.render())
    assert value_of(fam, "kiviq:generation_tokens_total") == 4
    assert value_of(fam, "kiviq:prompt_tokens_total") == 19
    assert value_of(fam, "kiviq:prefill_tokens_total") == 12
    assert value_of(fam, "kiviq:request_success_total") == 1
    assert value_of(fam, "kiviq:request_success_total", finished_reason="length") == 1
    assert value_of(fam, "kiviq:request_ended_total", outcome="failed") == 1
    assert value_of(fam, "kiviq:request_admitted_total", queue="kiviq-high") == 1
    assert value_of(fam, "kiviq:request_queue_time_seconds_count", queue="kiviq-default") == 1
    assert value_of(fam, "kiviq:time_to_first_token_seconds_count") == 1
    assert value_of(fam, "kiviq:e2e_request_latency_seconds_sum") == pytest.approx(0.6)
    # no job left: running/waiting/KV settle to 0 although no step ran since
    assert value_of(fam, "kiviq:num_requests_running") == 0
    assert value_of(fam, "kiviq:kv_cache_usage_perc") == 0
    assert fam["kiviq:request_success_total"]["type"] == "counter"
    assert fam["kiviq:num_requests_waiting"]["type"] == "gauge"
    assert fam["kiviq:step_duration_seconds"]["type"] == "histogram"

    snap = m.snapshot()
    json.dumps(snap)  # JSON-able
    assert snap["jobs"] == {"admitted": 2, "requeued": 0, "finished": 1, "failed": 1, "cancelled": 0, "timeout": 0}
    assert snap["jobs_recent"]["finished"] == 1
    with pytest.raises(ValueError):
        m.job_finished("c", "exploded", 1.0, 1, 1)


def test_inter_token_latency_and_kv_gauges():
    m = WorkerMetrics(clock=FakeClock())
    m.tokens("a", 1, now=8.0)  # first token: no ITL
    m.tokens("a", 1, now=8.0625)
    m.tokens("a", 3, now=8.25)  # 3 tokens in 0.1875 s: three observations of 0.0625
    h = m.itl.merged()
    assert h.count == 4 and h.sum == pytest.approx(0.25)
    cum = dict(h.cumulative())
    assert (cum[0.05], cum[0.075]) == (0, 4)
    m.job_admitted("b", 0.0, "q")
    m.step(0.01, decode_tokens=1, prefill_tokens=0, running=1, waiting=3, kv_used_bytes=512, kv_budget_bytes=2048)
    fam = parse_exposition(m.render())
    assert value_of(fam, "kiviq:kv_cache_usage_perc") == 0.25
    assert value_of(fam, "kiviq:kv_cache_used_bytes") == 512
    assert value_of(fam, "kiviq:num_requests_waiting") == 3
    assert value_of(fam, "kiviq:inter_token_latency_seconds_count") == 4


def test_rolling_token_rates():
    clock = FakeClock(100.0)
    m = WorkerMetrics(clock=clock, rate_window_s=10.0)
    for _ in range(10):  # 10 steps of 0.1 s back to back: 1 s of work
        clock.t += 0.1
        m.step(0.1, decode_tokens=8, prefill_tokens=20, running=8, waiting=0, kv_used_bytes=0, kv_budget_bytes=0)
    s = m.snapshot()
    assert s["decode_tokens_per_s"] == pytest.approx(80.0)
    assert s["prefill_tokens_per_s"] == pytest.approx(200.0)
    assert s["step_time_s"] == pytest.approx(0.1)
    clock.t += 1.0  # idle for a second: the window now spans 2 s
    assert m.snapshot()["decode_tokens_per_s"] == pytest.approx(40.0)
    clock.t += 20.0  # idle past the window
    fam = parse_exposition(m.render())
    assert value_of(fam, "kiviq:decode_tokens_per_second") == 0


def test_observe_engine_step_reads_the_engine():
    store = SimpleNamespace(used_bytes=lambda: 300, budget_bytes=lambda: 10 * 50 + 4 * 125)
    sched = SimpleNamespace(running=[1, 2], prefilling=[3], waiting=[4, 5, 6, 7])
    engine = SimpleNamespace(stats={"decode_tokens": 5, "prefill_tokens": 40}, kv_store=store, scheduler=sched)
    m = WorkerMetrics(clock=FakeClock())
    m.observe_engine_step(engine, 0.02)
    engine.stats = {"decode_tokens": 8, "prefill_tokens": 40}
    m.observe_engine_step(engine, 0.02)
    assert m.decode_tokens.get() == 8 and m.prefill_tokens.get() == 40
    assert (m.running.get(), m.waiting.get()) == (3, 4)
    assert (m.kv_used.get(), m.kv_budget.get(), m.kv_usage.get()) == (300, 1000, 0.3)
    # an engine without stats/scheduler/store (the serial engine)
    m2 = WorkerMetrics(clock=FakeClock())
    m2.tokens("x", 2)
    m2.observe_engine_step(SimpleNamespace(num_active=3, capacity=1, kv_store=None), 0.01)
    assert (m2.running.get(), m2.waiting.get(), m2.decode_tokens.get()) == (1, 2, 2)


def test_label_values_are_escaped():
    m = WorkerMetrics()
    m.job_admitted("a", 0.1, 'we"ird\\queue\nname')
    parse_exposition(m.render())


def test_serve_metrics_http():
    m = WorkerMetrics()
    m.job_admitted("a", 0.1, "kiviq-default")
    m.job_finished("a", "finished", 0.2, 3, 4, finish_reason="stop")
    server = serve_metrics(m, 0)
    try:
        port = server.server_address[1]
        assert port > 0
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            assert r.status == 200 and r.headers["Content-Type"].startswith("text/plain; version=0.0.4")
            fam = parse_exposition(r.read().decode())
        assert value_of(fam, "kiviq:request_success_total", finished_reason="stop") == 1
        assert value_of(fam, "kiviq:generation_tokens_total") == 4
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/snapshot", timeout=5) as r:
            assert json.loads(r.read())["jobs"]["finished"] == 1
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/nope", timeout=5)
        assert e.value.code == 404
    finally:
        server.shutdown()
        server.server_close()


def test_stats_publisher_rate_limit_and_ttl():
    r = fakeredis.FakeRedis()
    m = WorkerMetrics()
    pub = StatsPublisher(r, "w1", m, every_s=1.0)
    key = worker_stats_key("w1")
    pub.maybe_publish(now=0.0)
    snap = json.loads(r.get(key))
    assert snap["worker"] == "w1" and snap["jobs"]["finished"] == 0
    assert 0 < r.pttl(key) <= 10_000
    m.job_admitted("a", 0.0, "q")
    pub.maybe_publish(now=0.5)  # within every_s, no job ended: not written
    assert json.loads(r.get(key))["active"] == 0
    pub.maybe_publish(now=1.0)
    assert json.loads(r.get(key))["active"] == 1
    m.job_finished("a", "finished", 1.0, 1, 1)
    pub.maybe_publish(now=1.01)  # too soon even for a change
    assert json.loads(r.get(key))["jobs"]["finished"] == 0
    pub.maybe_publish(now=1.1)  # a job ended: written before every_s
    assert json.loads(r.get(key))["jobs"]["finished"] == 1
    pub.clear()
    assert r.get(key) is None


def test_stats_publisher_thread():
    r = fakeredis.FakeRedis()
    m = WorkerMetrics()
    pub = StatsPublisher(r, "w2", m).start(poll_s=0.01)
    try:
        deadline = time.monotonic() + 5
        while r.get(worker_stats_key("w2")) is None and time.monotonic() < deadline:
            time.sleep(0.01)
        m.job_admitted("a", 0.0, "q")
        m.job_finished("a", "timeout", 1.0, 1, 0)
        while time.monotonic() < deadline:  # a job ended: published well before every_s
            if json.loads(r.get(worker_stats_key("w2")))["jobs"]["timeout"] == 1:
                break
            time.sleep(0.01)
        assert json.loads(r.get(worker_stats_key("w2")))["jobs"]["timeout"] == 1
    finally:
        pub.stop()
    assert r.get(worker_stats_key("w2")) is None


def test_stats_publisher_swallows_redis_errors():
    class Broken:
        def set(self, *a, **k):
            raise ConnectionError("down")

    StatsPublisher(Broken(), "w", WorkerMetrics()).maybe_publish()


# ---- end to end (needs the worker wired) ---------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_worker_metrics_end_to_end(redis_url, redis_conn, start_worker):
    from kiviq.client import Client
    from kiviq.client.top import collect

    port = _free_port()
    start_worker("--metrics-port", str(port))
    client = Client(redis_url)
    handles = [client.submit(prompt=p, max_tokens=4) for p in ("The sky is", "One two three")]
    for h in handles:
        h.result(timeout=120)
    deadline = time.monotonic() + 10
    while True:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            fam = parse_exposition(r.read().decode())
        if value_of(fam, "kiviq:request_success_total") >= 2 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert value_of(fam, "kiviq:request_success_total") == 2
    assert value_of(fam, "kiviq:generation_tokens_total") > 0
    assert value_of(fam, "kiviq:time_to_first_token_seconds_count") == 2
    assert value_of(fam, "kiviq:step_duration_seconds_count") > 0
    # kiviq top's numbers, from the worker's published snapshot
    while True:
        data = collect(redis_conn)
        if data["jobs"]["total"]["finished"] >= 2 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert data["jobs"]["total"]["finished"] == 2
    assert data["jobs"]["per_min"]["finished"] == 2
    assert len(data["workers"]) == 1 and data["workers"][0]["stats"] is not None
