"""WorkerMetrics, its prometheus_client registry and exposition, the
/metrics endpoint and the per-worker stats publisher. Output is read with
prometheus_client's own parser."""

from __future__ import annotations

import json
import math
import socket
import time
import urllib.request
from types import SimpleNamespace

import fakeredis
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kiviq.jobs.keys import worker_stats_key
from kiviq.worker.device_metrics import add_device_memory
from kiviq.worker.metrics import PhaseClock, WorkerMetrics, quantile
from kiviq.worker.metrics_http import serve_metrics
from kiviq.worker.stats import StatsPublisher

MODEL = "test-model"


class FakeClock:
    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def parse(text: str) -> dict:
    """{family name: family} by prometheus_client's parser; histograms
    checked well formed (cumulative buckets ending in +Inf == _count)."""
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for fam in families.values():
        if fam.type != "histogram":
            continue
        groups: dict[tuple, list] = {}
        counts = {}
        for s in fam.samples:
            key = tuple(sorted((k, v) for k, v in s.labels.items() if k != "le"))
            if s.name.endswith("_bucket"):
                groups.setdefault(key, []).append((float(s.labels["le"]), s.value))
            elif s.name.endswith("_count"):
                counts[key] = s.value
        for key, buckets in groups.items():
            assert [b for b, _ in buckets] == sorted(b for b, _ in buckets) and math.isinf(buckets[-1][0])
            assert [v for _, v in buckets] == sorted(v for _, v in buckets), f"{fam.name} not cumulative"
            assert buckets[-1][1] == counts[key], f"{fam.name}: +Inf bucket != _count"
    return families


def value_of(families: dict, sample: str, **labels) -> float:
    """Sum of the samples called ``sample`` whose labels include ``labels``."""
    found = [s.value for f in families.values() for s in f.samples
             if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items())]
    assert found, f"no sample {sample} {labels}"
    return sum(found)


# ---- unit tests -------------------------------------------------------------------

def test_quantile_from_buckets():
    buckets = [(1.0, 2), (2.0, 5), (5.0, 5), (math.inf, 6)]
    assert quantile(buckets, 0.5) == pytest.approx(1.0 + (3 - 2) / 3)  # rank 3 inside (1, 2]
    assert quantile(buckets, 1.0) == 5.0  # +Inf bucket: the largest finite bound
    assert quantile([(1.0, 0), (math.inf, 0)], 0.5) is None


def test_worker_loop_phases_are_counted_apart_from_the_step():
    """PhaseClock charges each lap to its phase; worker_loop counts the worker's own
    phases (the step has its histogram, idle waiting counts nowhere)."""
    m = WorkerMetrics(MODEL, clock=FakeClock())
    for _ in range(2):
        clock = PhaseClock()
        time.sleep(0.002)
        clock.lap("publish")
        clock.lap("cancel_check")
        time.sleep(0.003)
        clock.lap("step")
        clock.lap("publish")
        m.worker_loop(clock.spent)
        assert clock.spent["step"] >= 0.003 and clock.spent["publish"] >= 0.002
    fam = parse(m.render())
    name = "kiviq:worker_loop_seconds_total"
    assert 0.004 <= value_of(fam, name, phase="publish") < 0.006 + 0.2
    assert value_of(fam, name, phase="cancel_check") < 0.002
    assert value_of(fam, name, phase="admit_housekeeping") == 0  # seeded, never charged here
    assert not [s for f in fam.values() for s in f.samples if s.labels.get("phase") in ("step", "idle")]


def test_counters_gauges_and_no_double_counting():
    clock = FakeClock()
    m = WorkerMetrics(MODEL, clock=clock)
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

    fam = parse(m.render())
    assert value_of(fam, "kiviq:generation_tokens_total") == 4
    assert value_of(fam, "kiviq:prompt_tokens_total") == 19
    assert value_of(fam, "kiviq:prefill_tokens_total") == 12
    assert value_of(fam, "kiviq:request_success_total") == 1
    assert value_of(fam, "kiviq:request_success_total", finished_reason="length") == 1
    assert value_of(fam, "kiviq:request_ended_total", outcome="failed") == 1
    assert value_of(fam, "kiviq:request_admitted_total", queue="kiviq-high") == 1
    assert value_of(fam, "kiviq:request_admitted_total", queue="kiviq-low") == 0  # every queue from the start
    assert value_of(fam, "kiviq:request_queue_time_seconds_count", queue="kiviq-default") == 1
    assert value_of(fam, "kiviq:time_to_first_token_seconds_count") == 1
    assert value_of(fam, "kiviq:e2e_request_latency_seconds_sum") == pytest.approx(0.6)
    assert value_of(fam, "kiviq:num_preemptions_total") == 0
    # no job left: running/waiting/KV settle to 0 although no step ran since
    assert value_of(fam, "kiviq:num_requests_running") == 0
    assert value_of(fam, "kiviq:kv_cache_usage_perc") == 0
    assert fam["kiviq:request_success"].type == "counter"
    assert fam["kiviq:num_requests_waiting"].type == "gauge"
    assert fam["kiviq:step_duration_seconds"].type == "histogram"

    snap = m.snapshot()
    json.dumps(snap)  # JSON-able
    assert snap["jobs"] == {"admitted": 2, "requeued": 0, "finished": 1, "failed": 1, "cancelled": 0, "timeout": 0}
    assert snap["jobs_recent"]["finished"] == 1 and snap["model"] == MODEL
    with pytest.raises(ValueError):
        m.job_finished("c", "exploded", 1.0, 1, 1)


def test_model_name_label_process_metrics_and_one_registry_each():
    a, b = WorkerMetrics("model-a"), WorkerMetrics("model-b")  # two registries: no duplicate-series error
    a.job_admitted("x", 0.0, "kiviq-default")
    fam_a, fam_b = parse(a.render()), parse(b.render())
    kiviq = [s for f in fam_a.values() if f.name.startswith("kiviq:") for s in f.samples]
    assert len(kiviq) > 100 and all(s.labels.get("model_name") == "model-a" for s in kiviq)
    assert value_of(fam_a, "kiviq:request_admitted_total") == 1
    assert value_of(fam_b, "kiviq:request_admitted_total") == 0
    assert value_of(fam_a, "process_resident_memory_bytes") > 0
    assert value_of(fam_a, "process_cpu_seconds_total") >= 0
    assert "python_info" in fam_a
    for name in ("time_per_output_token_seconds", "inter_token_latency_seconds", "num_preemptions",
                 "kv_cache_usage_perc", "request_admitted", "request_ended", "decode_tokens_per_second"):
        assert "kiviq:" + name in fam_a, name
    assert not any(n.endswith("_created") for n in fam_a)  # no *_created series


def itl_histogram(fam, *bounds: str) -> tuple:
    """The ITL histogram's (count, sum, [cumulative count at each bound])."""
    name = "kiviq:inter_token_latency_seconds"
    return (value_of(fam, f"{name}_count"), value_of(fam, f"{name}_sum"),
            [value_of(fam, f"{name}_bucket", le=le) for le in bounds])


def test_one_step_of_many_jobs_counts_each_jobs_own_gap():
    """A step's tokens are counted per distinct gap: jobs that got tokens in the step
    before share one, a job that waited longer has its own, a first token has none."""
    m = WorkerMetrics(MODEL, clock=FakeClock())
    jobs = [f"j{i}" for i in range(6)]
    for j in jobs:
        m.job_admitted(j, 0.0, "kiviq-default")
    m.step_tokens([(j, 1) for j in jobs[:4]], now=1.0)
    m.step_tokens([("j4", 1)], now=1.5)
    m.step_tokens([(j, 1) for j in jobs[:5]] + [("j5", 1)], now=2.0)  # gaps 1.0 x4 and 0.5; j5's first
    fam = parse(m.render())
    assert itl_histogram(fam, "0.5", "1.0") == (5, pytest.approx(4.5), [1, 5])
    assert value_of(fam, "kiviq:generation_tokens_total") == 11


def test_inter_token_latency_time_per_output_token_and_kv_gauges():
    m = WorkerMetrics(MODEL, clock=FakeClock())
    m.job_admitted("a", 0.0, "kiviq-default")
    m.tokens("a", 1, now=8.0)  # first token: no ITL
    m.tokens("a", 1, now=8.0625)
    m.tokens("a", 3, now=8.25)  # 3 tokens in 0.1875 s: three observations of 0.0625
    m.job_finished("a", "finished", 1.0, 5, 5, finish_reason="stop")  # TPOT: 0.25 s over 4 tokens
    m.job_admitted("b", 0.0, "kiviq-default")
    m.step(0.01, decode_tokens=1, prefill_tokens=0, running=1, waiting=3, kv_used_bytes=512, kv_budget_bytes=2048)
    fam = parse(m.render())
    assert itl_histogram(fam, "0.05", "0.075") == (4, pytest.approx(0.25), [0, 4])
    assert value_of(fam, "kiviq:time_per_output_token_seconds_count") == 1
    assert value_of(fam, "kiviq:time_per_output_token_seconds_sum") == pytest.approx(0.0625)
    assert value_of(fam, "kiviq:kv_cache_usage_perc") == 0.25
    assert value_of(fam, "kiviq:kv_cache_used_bytes") == 512
    assert value_of(fam, "kiviq:num_requests_waiting") == 3
    assert m.snapshot()["itl_avg_s"] == pytest.approx(0.0625)


def test_rolling_token_rates():
    clock = FakeClock(100.0)
    m = WorkerMetrics(MODEL, clock=clock, rate_window_s=10.0)
    for _ in range(10):  # 10 steps of 0.1 s back to back: 1 s of work
        clock.t += 0.1
        m.step(0.1, decode_tokens=8, prefill_tokens=20, running=8, waiting=0, kv_used_bytes=0, kv_budget_bytes=0)
    s = m.snapshot()
    assert s["decode_tokens_per_s"] == pytest.approx(80.0)
    assert s["prefill_tokens_per_s"] == pytest.approx(200.0)
    assert s["step_time_s"] == pytest.approx(0.1)
    assert value_of(parse(m.render()), "kiviq:decode_tokens_per_second") == pytest.approx(80.0)
    clock.t += 1.0  # idle for a second: the window now spans 2 s
    assert m.snapshot()["decode_tokens_per_s"] == pytest.approx(40.0)
    clock.t += 20.0  # idle past the window
    assert value_of(parse(m.render()), "kiviq:decode_tokens_per_second") == 0


def test_observe_engine_step_reads_the_engine():
    store = SimpleNamespace(used_bytes=lambda: 300, budget_bytes=lambda: 10 * 50 + 4 * 125)
    sched = SimpleNamespace(running=[1, 2], prefilling=[3], waiting=[4, 5, 6, 7])
    engine = SimpleNamespace(stats={"decode_tokens": 5, "prefill_tokens": 40, "preemptions": 1}, kv_store=store,
                             scheduler=sched)
    m = WorkerMetrics(MODEL, clock=FakeClock())
    m.observe_engine_step(engine, 0.02)
    engine.stats = {"decode_tokens": 8, "prefill_tokens": 40, "preemptions": 3}
    m.observe_engine_step(engine, 0.02)
    fam = parse(m.render())
    assert value_of(fam, "kiviq:decode_tokens_total") == 8 and value_of(fam, "kiviq:prefill_tokens_total") == 40
    assert value_of(fam, "kiviq:num_preemptions_total") == 3
    assert (value_of(fam, "kiviq:num_requests_running"), value_of(fam, "kiviq:num_requests_waiting")) == (3, 4)
    assert value_of(fam, "kiviq:kv_cache_used_bytes") == 300 and value_of(fam, "kiviq:kv_cache_budget_bytes") == 1000
    assert value_of(fam, "kiviq:kv_cache_usage_perc") == pytest.approx(0.3)
    assert value_of(fam, "kiviq:step_duration_seconds_count") == 2
    # an engine without stats/scheduler/store (the serial engine)
    m2 = WorkerMetrics(MODEL, clock=FakeClock())
    m2.tokens("x", 2)
    m2.observe_engine_step(SimpleNamespace(num_active=3, capacity=1, kv_store=None), 0.01)
    fam2 = parse(m2.render())
    assert (value_of(fam2, "kiviq:num_requests_running"), value_of(fam2, "kiviq:num_requests_waiting"),
            value_of(fam2, "kiviq:decode_tokens_total")) == (1, 2, 2)


def test_label_values_are_escaped():
    m = WorkerMetrics('we"ird\\model')
    queue = 'we"ird\\queue\nname'
    m.job_admitted("a", 0.1, queue)
    fam = parse(m.render())
    assert value_of(fam, "kiviq:request_admitted_total", queue=queue, model_name='we"ird\\model') == 1


def test_serve_metrics_http():
    m = WorkerMetrics(MODEL)
    m.job_admitted("a", 0.1, "kiviq-default")
    m.job_finished("a", "finished", 0.2, 3, 4, finish_reason="stop")
    server = serve_metrics(m, 0)  # 0: a free port, read back from the server
    try:
        port = server.server_address[1]
        assert port > 0
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            assert r.status == 200 and r.headers["Content-Type"].startswith("text/plain; version=")
            fam = parse(r.read().decode())
        assert value_of(fam, "kiviq:request_success_total", finished_reason="stop", model_name=MODEL) == 1
        assert value_of(fam, "kiviq:generation_tokens_total") == 4
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/snapshot", timeout=5) as r:
            assert r.headers["Content-Type"] == "application/json"
            assert json.loads(r.read())["jobs"]["finished"] == 1
        req = urllib.request.Request(f"http://127.0.0.1:{port}/metrics",
                                     headers={"Accept": "application/openmetrics-text"})
        with urllib.request.urlopen(req, timeout=5) as r:  # the library negotiates OpenMetrics too
            assert r.headers["Content-Type"].startswith("application/openmetrics-text")
            assert r.read().decode().rstrip().endswith("# EOF")
    finally:
        server.shutdown()
        server.server_close()


def test_stats_publisher_rate_limit_and_ttl():
    r = fakeredis.FakeRedis()
    m = WorkerMetrics(MODEL)
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
    m = WorkerMetrics(MODEL)
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

    StatsPublisher(Broken(), "w", WorkerMetrics(MODEL)).maybe_publish()


# ---- end to end (a real worker) ---------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_worker_metrics_end_to_end(redis_url, redis_conn, start_worker):
    from rq import Queue
    from rq.serializers import JSONSerializer

    from kiviq.client import Client
    from kiviq.client.top import collect
    from kiviq.jobs.keys import TASK_PATH, queue_name

    port = _free_port()
    start_worker("--metrics-port", str(port))
    client = Client(redis_url)
    handles = [client.submit(prompt=p, max_tokens=4) for p in ("The sky is", "One two three")]
    # a job that fails on the worker before it reaches the engine (invalid request)
    queue = Queue(queue_name("default"), connection=redis_conn, serializer=JSONSerializer)
    bad = queue.enqueue_call(TASK_PATH, args=({"prompt": "x", "max_tokens": -5},), timeout=-1)
    for h in handles:
        h.result(timeout=120)
    deadline = time.monotonic() + 30
    while bad.get_status(refresh=True).value != "failed":
        assert time.monotonic() < deadline, bad.get_status(refresh=True)
        time.sleep(0.2)

    def scrape() -> dict:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            return parse(r.read().decode())

    while True:
        fam = scrape()
        if value_of(fam, "kiviq:request_ended_total") >= 3 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert value_of(fam, "kiviq:request_success_total") == 2
    assert value_of(fam, "kiviq:request_ended_total", outcome="failed") == 1
    # every job that ended was admitted first (also the one that failed validation)
    assert value_of(fam, "kiviq:request_admitted_total") == value_of(fam, "kiviq:request_ended_total") == 3
    assert value_of(fam, "kiviq:request_admitted_total", model_name="SmolLM2-135M-Instruct") == 3
    assert value_of(fam, "kiviq:generation_tokens_total") > 0
    assert value_of(fam, "kiviq:time_to_first_token_seconds_count") == 2
    assert value_of(fam, "kiviq:time_per_output_token_seconds_count") == 2
    assert value_of(fam, "kiviq:step_duration_seconds_count") > 0
    assert value_of(fam, "kiviq:num_preemptions_total") == 0
    assert value_of(fam, "process_resident_memory_bytes") > 0
    active = value_of(fam, "kiviq:device_memory_bytes", kind="active")  # the model and KV store at least
    assert 0 < active <= value_of(fam, "kiviq:device_memory_bytes", kind="peak")
    # kiviq top's numbers, from the worker's published snapshot
    while True:
        data = collect(redis_conn)
        if data["jobs"]["total"]["finished"] >= 2 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert data["jobs"]["total"]["finished"] == 2 and data["jobs"]["total"]["failed"] == 1
    assert data["jobs"]["per_min"]["finished"] == 2
    assert len(data["workers"]) == 1 and data["workers"][0]["stats"] is not None


# ---- the Grafana dashboard ------------------------------------------------------------

def test_device_memory_gauges_read_mlx_at_each_scrape():
    held = {"get_active_memory": 9 << 30, "get_cache_memory": 1 << 30, "get_peak_memory": 12 << 30,
            "get_memory_limit": 40 << 30}
    stand_in = SimpleNamespace(**{name: (lambda name=name: held[name]) for name in held})
    m = WorkerMetrics(MODEL, process_metrics=False)
    add_device_memory(m, stand_in)
    fam = parse(m.render())
    assert {kind: value_of(fam, "kiviq:device_memory_bytes", kind=kind, model_name=MODEL)
            for kind in ("active", "cache", "peak", "limit")} == {
        "active": 9 << 30, "cache": 1 << 30, "peak": 12 << 30, "limit": 40 << 30}
    held["get_active_memory"] = 20 << 30  # read again at the next scrape, not kept
    assert value_of(parse(m.render()), "kiviq:device_memory_bytes", kind="active") == 20 << 30


def test_device_memory_gauges_are_mlxs_own():
    import mlx.core as mx

    m = WorkerMetrics(MODEL, process_metrics=False)
    add_device_memory(m)
    assert value_of(parse(m.render()), "kiviq:device_memory_bytes", kind="limit") == mx.get_memory_limit()


def test_grafana_dashboard_uses_only_exported_metrics():
    import re
    from pathlib import Path

    dash = json.loads((Path(__file__).resolve().parents[1] / "docs" / "grafana" / "kiviq.json").read_text())
    m = WorkerMetrics(MODEL)
    add_device_memory(m)  # as run_worker does
    exported = {s.name for f in parse(m.render()).values() for s in f.samples}
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    exprs += [v["query"]["query"] for v in dash["templating"]["list"] if isinstance(v.get("query"), dict)]
    assert len(exprs) > 20
    used = set()
    for expr in exprs:
        names = set(re.findall(r"\b((?:kiviq:|process_)[a-zA-Z0-9_:]+)", expr))
        assert names, f"no metric in {expr!r}"
        unknown = names - exported
        assert not unknown, f"{expr!r} uses {unknown}, which the worker does not export"
        used |= names
    for needed in ("kiviq:generation_tokens_total", "kiviq:num_requests_queued", "kiviq:num_requests_waiting",
                   "kiviq:time_to_first_token_seconds_bucket", "kiviq:inter_token_latency_seconds_bucket",
                   "kiviq:kv_cache_usage_perc", "kiviq:num_preemptions_total"):
        assert needed in used, needed  # throughput, queue depth, TTFT/ITL, KV usage
    for panel in dash["panels"]:
        if panel["type"] != "row":
            assert panel["targets"] and panel["datasource"]["uid"] == "${datasource}"
    assert len({p["id"] for p in dash["panels"]}) == len(dash["panels"])


def test_queue_lengths_published_as_gauge():
    from kiviq.client import Client

    r = fakeredis.FakeRedis()
    client = Client(connection=r)
    for priority in ("low", "low", "high"):
        client.submit(prompt="x", max_tokens=1, priority=priority)
    m = WorkerMetrics(MODEL)
    StatsPublisher(r, "w", m).publish()
    fam = parse(m.render())
    assert value_of(fam, "kiviq:num_requests_queued", queue="kiviq-low") == 2
    assert value_of(fam, "kiviq:num_requests_queued", queue="kiviq-high") == 1
    assert value_of(fam, "kiviq:num_requests_queued", queue="kiviq-default") == 0
