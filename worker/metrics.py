"""Worker metrics: Prometheus text exposition (written by hand, no client
library), a tiny HTTP endpoint, and a per-worker JSON snapshot in Redis for
``kiviq top``.

Wiring into ``BatchWorker`` (all calls are cheap, thread-safe and never touch
Redis except ``StatsPublisher.maybe_publish``)::

    # __init__(..., metrics: WorkerMetrics | None = None)
    self.metrics = metrics          # run_worker passes one (None: no metrics)
    # run_worker publishes snapshots for ``kiviq top`` from a thread:
    #   StatsPublisher(connection, worker.name, metrics).start() ... .stop()

    # _start(): once the request is in the engine
    self.metrics.job_admitted(job.id, queue_wait_s, queue.name)

    # _step():
    t0 = time.perf_counter()
    events = self.engine.step()
    self.metrics.observe_engine_step(self.engine, time.perf_counter() - t0)   # -> step(...)
    for ev in events:                       # with tokens
        if first token: self.metrics.first_token(job.id, ttft_s)
        self.metrics.tokens(job.id, len(ev.token_ids))

    # _finish_ok / _finish_failed (outcome: finished | failed | cancelled | timeout)
    self.metrics.job_finished(job.id, outcome, e2e_s, prompt_tokens, completion_tokens,
                              finish_reason=reason.value)
    # _requeue_all: self.metrics.job_requeued(job.id)

Times are seconds. ``tokens`` and ``job_finished`` never double count
generation tokens: ``job_finished`` adds only the completion tokens that
``tokens`` did not already report for that job.
"""

from __future__ import annotations

import bisect
import http.server
import json
import logging
import math
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Iterable

log = logging.getLogger("kiviq.metrics")

PREFIX = "kiviq:"
OUTCOMES = ("finished", "failed", "cancelled", "timeout")
RATE_WINDOW_S = 10.0  # rolling window of the tokens/s and step-time gauges
JOBS_WINDOW_S = 60.0  # "last minute" job counts (kiviq top's jobs/min)

# Buckets in the spirit of vLLM's.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
               5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                           60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
TOKEN_COUNT_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


# ---- exposition primitives ---------------------------------------------------

def format_value(v: float) -> str:
    """A sample value as the text format writes it (ints without '.0')."""
    if isinstance(v, bool):
        v = int(v)
    if isinstance(v, int):
        return str(v)
    if math.isnan(v):
        return "NaN"
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    if v.is_integer() and abs(v) < 1e15:
        return str(int(v))
    return repr(v)


def _escape_label(v: str) -> str:
    return v.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(names: Iterable[str], values: Iterable[str], extra: tuple[str, str] | None = None) -> str:
    pairs = list(zip(names, values))
    if extra:
        pairs.append(extra)
    if not pairs:
        return ""
    return "{" + ",".join(f'{k}="{_escape_label(str(v))}"' for k, v in pairs) + "}"


class _Family:
    kind = ""

    def __init__(self, name: str, help_: str, labelnames: tuple[str, ...] = ()):
        self.name, self.help, self.labelnames = PREFIX + name, help_, labelnames

    def header(self) -> list[str]:
        help_ = self.help.replace("\\", "\\\\").replace("\n", "\\n")
        return [f"# HELP {self.name} {help_}", f"# TYPE {self.name} {self.kind}"]


class _Scalar(_Family):
    """A counter or gauge: one value per label-value tuple."""

    def __init__(self, kind: str, name: str, help_: str, labelnames: tuple[str, ...] = (),
                 seed: Iterable[tuple[str, ...]] = ()):
        super().__init__(name, help_, labelnames)
        self.kind = kind
        self.values: dict[tuple[str, ...], float] = {}
        if not labelnames:
            self.values[()] = 0
        for labels in seed:
            self.values[labels] = 0

    def inc(self, amount: float = 1, labels: tuple[str, ...] = ()) -> None:
        self.values[labels] = self.values.get(labels, 0) + amount

    def set(self, value: float, labels: tuple[str, ...] = ()) -> None:
        self.values[labels] = value

    def get(self, labels: tuple[str, ...] = ()) -> float:
        return self.values.get(labels, 0)

    def total(self) -> float:
        return sum(self.values.values())

    def lines(self) -> list[str]:
        out = self.header()
        for labels, v in sorted(self.values.items()):
            out.append(f"{self.name}{_labels(self.labelnames, labels)} {format_value(v)}")
        return out


class Histogram:
    """Cumulative-bucket histogram math for one label set.

    ``counts[i]`` holds observations in (bounds[i-1], bounds[i]]; the last
    slot holds those above every bound (+Inf).
    """

    def __init__(self, bounds: Iterable[float]):
        self.bounds = tuple(sorted(float(b) for b in bounds))
        self.counts = [0] * (len(self.bounds) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float, n: int = 1) -> None:
        """Record ``n`` observations of ``value`` (``le`` buckets: value <= bound)."""
        if n <= 0:
            return
        self.counts[bisect.bisect_left(self.bounds, value)] += n
        self.sum += value * n
        self.count += n

    def cumulative(self) -> list[tuple[float, int]]:
        """(upper bound, observations <= bound) for every bucket, +Inf last."""
        out, running = [], 0
        for bound, c in zip(self.bounds + (math.inf,), self.counts):
            running += c
            out.append((bound, running))
        return out

    def quantile(self, q: float) -> float | None:
        """Estimate a quantile by linear interpolation inside its bucket
        (as PromQL's histogram_quantile does); None when empty."""
        if self.count == 0:
            return None
        rank = q * self.count
        lower, prev = 0.0, 0
        for bound, cum in self.cumulative():
            if cum >= rank and cum > 0:
                if math.isinf(bound):
                    return self.bounds[-1] if self.bounds else None
                inside = cum - prev
                return lower + (bound - lower) * ((rank - prev) / inside if inside else 0.0)
            lower, prev = bound, cum
        return None

    def mean(self) -> float | None:
        return self.sum / self.count if self.count else None


class _HistogramFamily(_Family):
    kind = "histogram"

    def __init__(self, name: str, help_: str, bounds: Iterable[float], labelnames: tuple[str, ...] = ()):
        super().__init__(name, help_, labelnames)
        self.bounds = tuple(bounds)
        self.children: dict[tuple[str, ...], Histogram] = {}
        if not labelnames:
            self.children[()] = Histogram(self.bounds)

    def child(self, labels: tuple[str, ...] = ()) -> Histogram:
        h = self.children.get(labels)
        if h is None:
            h = self.children[labels] = Histogram(self.bounds)
        return h

    def observe(self, value: float, labels: tuple[str, ...] = (), n: int = 1) -> None:
        self.child(labels).observe(value, n)

    def merged(self) -> Histogram:
        """All label sets summed (for snapshot averages)."""
        m = Histogram(self.bounds)
        for h in self.children.values():
            m.counts = [a + b for a, b in zip(m.counts, h.counts)]
            m.sum += h.sum
            m.count += h.count
        return m

    def lines(self) -> list[str]:
        out = self.header()
        for labels, h in sorted(self.children.items()):
            for bound, cum in h.cumulative():
                le = "+Inf" if math.isinf(bound) else format_value(bound)
                out.append(f"{self.name}_bucket{_labels(self.labelnames, labels, ('le', le))} {cum}")
            out.append(f"{self.name}_sum{_labels(self.labelnames, labels)} {format_value(h.sum)}")
            out.append(f"{self.name}_count{_labels(self.labelnames, labels)} {h.count}")
        return out


# ---- the worker's metrics ----------------------------------------------------

@dataclass
class _JobState:
    admitted_at: float
    last_token_at: float | None = None
    tokens_seen: int = 0


class WorkerMetrics:
    """Everything one worker measures. Thread-safe: the worker loop writes,
    the HTTP thread and the stats publisher read.

    Args:
        clock: monotonic seconds (tests inject a fake).
        wall_clock: epoch seconds, stamped on snapshots.
        rate_window_s: window of the tokens/s and step-time gauges.
        jobs_window_s: window of the "jobs ended lately" counts.
    """

    def __init__(self, *, clock: Callable[[], float] = time.monotonic, wall_clock: Callable[[], float] = time.time,
                 rate_window_s: float = RATE_WINDOW_S, jobs_window_s: float = JOBS_WINDOW_S):
        self._lock = threading.Lock()
        self._clock, self._wall = clock, wall_clock
        self.rate_window_s, self.jobs_window_s = rate_window_s, jobs_window_s
        self._started = clock()
        self._jobs: dict[str, _JobState] = {}
        self._steps: deque[tuple[float, float, int, int]] = deque()  # (end, duration, decode, prefill)
        self._ended: deque[tuple[float, str]] = deque()  # (time, outcome)
        self._last_step_s: float | None = None
        self._engine_stats: dict[str, int] = {}
        self._tokens_since_step = 0

        S = _Scalar
        self.running = S("gauge", "num_requests_running", "Sequences running in the engine (prefilling or decoding).")
        self.waiting = S("gauge", "num_requests_waiting", "Sequences admitted to the engine, waiting to be scheduled.")
        self.active = S("gauge", "num_requests_active", "Jobs taken from Redis by this worker and not yet ended.")
        self.kv_usage = S("gauge", "kv_cache_usage_perc", "KV-cache usage as a fraction of its budget (0..1).")
        self.kv_used = S("gauge", "kv_cache_used_bytes", "KV-cache bytes in use.")
        self.kv_budget = S("gauge", "kv_cache_budget_bytes", "KV-cache budget in bytes.")
        self.decode_tps = S("gauge", "decode_tokens_per_second",
                            f"Decode tokens per second over the last {rate_window_s:g} s.")
        self.prefill_tps = S("gauge", "prefill_tokens_per_second",
                             f"Prefill tokens per second over the last {rate_window_s:g} s.")
        self.prompt_tokens = S("counter", "prompt_tokens_total", "Prompt tokens of ended requests.")
        self.generation_tokens = S("counter", "generation_tokens_total", "Generated tokens.")
        self.decode_tokens = S("counter", "decode_tokens_total", "Tokens computed in decode phases.")
        self.prefill_tokens = S("counter", "prefill_tokens_total",
                                "Tokens computed in prefill phases (recomputation after preemption included).")
        self.success = S("counter", "request_success_total",
                         "Requests that finished successfully, by finish reason.", ("finished_reason",),
                         seed=[("stop",), ("length",)])
        self.ended = S("counter", "request_ended_total", "Requests that ended, by outcome.", ("outcome",),
                       seed=[(o,) for o in OUTCOMES])
        self.admitted = S("counter", "request_admitted_total", "Requests taken from a queue, by queue.", ("queue",))
        self.requeued = S("counter", "request_requeued_total", "Requests put back into their queue unfinished.")
        H = _HistogramFamily
        self.ttft = H("time_to_first_token_seconds", "Time from admission to the first generated token.",
                      TTFT_BUCKETS)
        self.itl = H("inter_token_latency_seconds", "Time between consecutive generated tokens of a request.",
                     ITL_BUCKETS)
        self.e2e = H("e2e_request_latency_seconds", "Time from admission to the end of a request.",
                     REQUEST_LATENCY_BUCKETS)
        self.queue_time = H("request_queue_time_seconds", "Time a request waited in its Redis queue.",
                            REQUEST_LATENCY_BUCKETS, ("queue",))
        self.step_time = H("step_duration_seconds", "Duration of one engine step.", STEP_BUCKETS)
        self.prompt_len = H("request_prompt_tokens", "Prompt tokens per ended request.", TOKEN_COUNT_BUCKETS)
        self.gen_len = H("request_generation_tokens", "Generated tokens per ended request.", TOKEN_COUNT_BUCKETS)
        self._families: list[_Family] = [
            self.running, self.waiting, self.active, self.kv_usage, self.kv_used, self.kv_budget,
            self.decode_tps, self.prefill_tps, self.prompt_tokens, self.generation_tokens, self.decode_tokens,
            self.prefill_tokens, self.success, self.ended, self.admitted, self.requeued,
            self.ttft, self.itl, self.e2e, self.queue_time, self.step_time, self.prompt_len, self.gen_len,
        ]

    # ---- events from the worker -------------------------------------------

    def job_admitted(self, job_id: str, queue_wait_s: float, queue: str) -> None:
        """A job left its Redis queue (``queue``) after ``queue_wait_s``."""
        with self._lock:
            self._jobs[job_id] = _JobState(self._clock())
            self.admitted.inc(1, (queue,))
            self.queue_time.observe(max(0.0, queue_wait_s), (queue,))
            self.active.set(len(self._jobs))

    def first_token(self, job_id: str, ttft_s: float) -> None:
        """A job's first token came ``ttft_s`` after admission."""
        with self._lock:
            self.ttft.observe(max(0.0, ttft_s))

    def tokens(self, job_id: str, n: int, now: float | None = None) -> None:
        """``n`` tokens of a job came out of one step. The gap since that
        job's previous tokens, split evenly over the ``n``, is its
        inter-token latency (its first tokens have none: that is TTFT)."""
        if n <= 0:
            return
        with self._lock:
            t = self._clock() if now is None else now
            st = self._jobs.get(job_id)
            if st is None:
                st = self._jobs[job_id] = _JobState(t)
                self.active.set(len(self._jobs))
            if st.last_token_at is not None:
                self.itl.observe(max(0.0, t - st.last_token_at) / n, n=n)
            st.last_token_at = t
            st.tokens_seen += n
            self.generation_tokens.inc(n)
            self._tokens_since_step += n

    def step(self, duration_s: float, *, decode_tokens: int, prefill_tokens: int, running: int, waiting: int,
             kv_used_bytes: int, kv_budget_bytes: int) -> None:
        """One engine step ended: its duration, the tokens it computed, and
        the engine's state after it."""
        with self._lock:
            t = self._clock()
            self._last_step_s = duration_s
            self.step_time.observe(max(0.0, duration_s))
            self.decode_tokens.inc(decode_tokens)
            self.prefill_tokens.inc(prefill_tokens)
            self.running.set(running)
            self.waiting.set(waiting)
            self._set_kv(kv_used_bytes, kv_budget_bytes)
            self._steps.append((t, duration_s, decode_tokens, prefill_tokens))
            self._trim(t)

    def kv_memory(self, used_bytes: int, budget_bytes: int) -> None:
        """KV usage changed outside a step (a job was cancelled or ended):
        freed memory shows at once, not at the next step."""
        with self._lock:
            self._set_kv(used_bytes, budget_bytes)

    def _set_kv(self, used: int, budget: int) -> None:
        self.kv_used.set(used)
        self.kv_budget.set(budget)
        self.kv_usage.set(min(1.0, used / budget) if budget > 0 else 0.0)

    def job_finished(self, job_id: str, outcome: str, e2e_s: float, prompt_tokens: int, completion_tokens: int,
                     *, finish_reason: str | None = None) -> None:
        """A job ended. ``outcome`` is one of finished, failed, cancelled,
        timeout; ``finish_reason`` (stop, length, ...) labels
        ``request_success_total`` for finished ones ("unknown" if omitted)."""
        if outcome not in OUTCOMES:
            raise ValueError(f"outcome must be one of {OUTCOMES}, got {outcome!r}")
        with self._lock:
            st = self._jobs.pop(job_id, None)
            seen = st.tokens_seen if st else 0
            self.generation_tokens.inc(max(0, completion_tokens - seen))
            self.prompt_tokens.inc(prompt_tokens)
            self.prompt_len.observe(prompt_tokens)
            self.gen_len.observe(completion_tokens)
            self.e2e.observe(max(0.0, e2e_s))
            self.ended.inc(1, (outcome,))
            if outcome == "finished":
                self.success.inc(1, (finish_reason or "unknown",))
            t = self._clock()
            self._ended.append((t, outcome))
            self._trim(t)
            self._settle_after_end()

    def job_requeued(self, job_id: str) -> None:
        """A job went back to its queue unfinished (shutdown): forget it."""
        with self._lock:
            self._jobs.pop(job_id, None)
            self.requeued.inc()
            self._settle_after_end()

    def observe_engine_step(self, engine: Any, duration_s: float) -> None:
        """``step(...)`` with the numbers read off ``engine``: token deltas of
        ``engine.stats``, scheduler queue lengths, KV store bytes. Engines
        without these (the serial engine) report what they can."""
        stats = getattr(engine, "stats", None)
        if isinstance(stats, dict) and "decode_tokens" in stats:
            decode = self._stats_delta(stats, "decode_tokens")
            prefill = self._stats_delta(stats, "prefill_tokens")
        else:
            with self._lock:
                decode, self._tokens_since_step = self._tokens_since_step, 0
            prefill = 0
        sched = getattr(engine, "scheduler", None)
        if sched is not None and hasattr(sched, "running"):
            running = len(sched.running) + len(getattr(sched, "prefilling", ()))
            waiting = len(getattr(sched, "waiting", ()))
        else:
            active = int(getattr(engine, "num_active", 0) or 0)
            running = min(active, int(getattr(engine, "capacity", 1) or 1))
            waiting = active - running
        used = budget = 0
        store = getattr(engine, "kv_store", None)
        if store is not None and hasattr(store, "used_bytes"):
            used = int(store.used_bytes())
            budget = int(store.budget_bytes())
        self.step(duration_s, decode_tokens=decode, prefill_tokens=prefill, running=running, waiting=waiting,
                  kv_used_bytes=used, kv_budget_bytes=budget)

    def _stats_delta(self, stats: dict, key: str) -> int:
        cur = int(stats.get(key, 0))
        with self._lock:
            prev = self._engine_stats.get(key, 0)
            self._engine_stats[key] = cur
        return cur - prev if cur >= prev else cur  # a new engine: counts restarted

    def _settle_after_end(self) -> None:
        """Keep the running/waiting gauges within the jobs still held (no
        step runs while the worker idles, so nothing else would lower them)."""
        n = len(self._jobs)
        self.active.set(n)
        running = min(self.running.get(), n)
        self.running.set(running)
        self.waiting.set(min(self.waiting.get(), n - running))
        if n == 0:
            self.kv_used.set(0)
            self.kv_usage.set(0.0)

    def _trim(self, t: float) -> None:
        while self._steps and self._steps[0][0] < t - self.rate_window_s:
            self._steps.popleft()
        while self._ended and self._ended[0][0] < t - self.jobs_window_s:
            self._ended.popleft()

    def _rates(self, t: float) -> tuple[float, float, float | None]:
        """(decode tokens/s, prefill tokens/s, mean step seconds) over the window."""
        self._trim(t)
        if not self._steps:
            return 0.0, 0.0, None
        first_end, first_dur = self._steps[0][0], self._steps[0][1]
        start = max(t - self.rate_window_s, first_end - first_dur)
        span = t - start
        decode = sum(s[2] for s in self._steps)
        prefill = sum(s[3] for s in self._steps)
        mean_step = sum(s[1] for s in self._steps) / len(self._steps)
        if span <= 0:
            return 0.0, 0.0, mean_step
        return decode / span, prefill / span, mean_step

    # ---- readers -----------------------------------------------------------

    def render(self) -> str:
        """Every metric in the Prometheus text exposition format (0.0.4)."""
        with self._lock:
            d, p, _ = self._rates(self._clock())
            self.decode_tps.set(d)
            self.prefill_tps.set(p)
            lines: list[str] = []
            for fam in self._families:
                lines += fam.lines()
        return "\n".join(lines) + "\n"

    def snapshot(self) -> dict:
        """A JSON-able summary (what ``kiviq top`` shows)."""
        with self._lock:
            t = self._clock()
            d, p, mean_step = self._rates(t)
            recent = {o: 0 for o in OUTCOMES}
            for _, o in self._ended:
                recent[o] += 1
            used, budget = int(self.kv_used.get()), int(self.kv_budget.get())

            def avg(h: _HistogramFamily) -> float | None:
                return h.merged().mean()

            ttft = self.ttft.merged()
            return {
                "version": 1,
                "time": self._wall(),
                "uptime_s": t - self._started,
                "running": int(self.running.get()),
                "waiting": int(self.waiting.get()),
                "active": len(self._jobs),
                "kv_used_bytes": used,
                "kv_budget_bytes": budget,
                "kv_usage": self.kv_usage.get(),
                "rate_window_s": self.rate_window_s,
                "decode_tokens_per_s": d,
                "prefill_tokens_per_s": p,
                "step_time_s": mean_step,
                "last_step_s": self._last_step_s,
                "steps": self.step_time.merged().count,
                "prompt_tokens": int(self.prompt_tokens.get()),
                "generation_tokens": int(self.generation_tokens.get()),
                "jobs": {"admitted": int(self.admitted.total()), "requeued": int(self.requeued.get()),
                         **{o: int(self.ended.get((o,))) for o in OUTCOMES}},
                "jobs_window_s": self.jobs_window_s,
                "jobs_recent": recent,
                "ttft_avg_s": ttft.mean(),
                "ttft_p50_s": ttft.quantile(0.5),
                "itl_avg_s": avg(self.itl),
                "e2e_avg_s": avg(self.e2e),
                "queue_time_avg_s": avg(self.queue_time),
            }


# ---- HTTP endpoint -------------------------------------------------------------

class _Handler(http.server.BaseHTTPRequestHandler):
    metrics: WorkerMetrics  # set on the per-server subclass

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        path = self.path.split("?", 1)[0]
        if path in ("/metrics", "/metrics/"):
            body, ctype, code = self.metrics.render().encode(), CONTENT_TYPE, 200
        elif path in ("/snapshot", "/snapshot.json"):
            body, ctype, code = json.dumps(self.metrics.snapshot()).encode(), "application/json", 200
        elif path == "/":
            body, ctype, code = b"kiviq worker metrics: /metrics (Prometheus), /snapshot (JSON)\n", "text/plain", 200
        else:
            body, ctype, code = b"not found\n", "text/plain", 404
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
        log.debug("metrics http: " + format, *args)


def serve_metrics(metrics: WorkerMetrics, port: int, host: str = "127.0.0.1") -> http.server.ThreadingHTTPServer:
    """Serve ``GET /metrics`` (and ``/snapshot``) from a daemon thread.

    ``port`` 0 picks a free one: read it back from ``server.server_address[1]``.
    Stop with ``server.shutdown(); server.server_close()``.
    """
    handler = type("KiviqMetricsHandler", (_Handler,), {"metrics": metrics})
    server = http.server.ThreadingHTTPServer((host, port), handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, name="kiviq-metrics-http", daemon=True)
    thread.start()
    log.info("metrics on http://%s:%d/metrics", host, server.server_address[1])
    return server


# ---- per-worker stats in Redis ------------------------------------------------------

class StatsPublisher:
    """Writes ``metrics.snapshot()`` (plus ``"worker"``) as JSON to
    ``jobs.keys.worker_stats_key(worker_name)`` with a TTL, so ``kiviq top``
    sees live workers and a dead one's entry expires.

    ``start()`` runs it from a daemon thread (what ``run_worker`` does);
    alternatively call ``maybe_publish`` every loop iteration. It writes at
    most every ``every_s``, except that a change in ended-job counts is
    written after only ``min_interval_s`` (top's job counts stay current).
    Redis errors are logged, never raised: stats are best-effort.
    """

    def __init__(self, redis: Any, worker_name: str, metrics: WorkerMetrics, every_s: float = 1.0, *,
                 ttl_s: float | None = None, min_interval_s: float = 0.05):
        from kiviq.jobs.keys import worker_stats_key

        self.redis, self.worker_name, self.metrics = redis, worker_name, metrics
        self.every_s, self.min_interval_s = every_s, min(min_interval_s, every_s)
        self.ttl_s = ttl_s if ttl_s is not None else max(10.0, 5 * every_s)
        self.key = worker_stats_key(worker_name)
        self._last: float | None = None
        self._last_ended: int | None = None
        self._publish_lock = threading.Lock()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    def maybe_publish(self, now: float | None = None) -> None:
        t = time.monotonic() if now is None else now
        with self._publish_lock:
            if self._last is not None:
                since = t - self._last
                if since < self.min_interval_s:
                    return
                if since < self.every_s and self._ended_count() == self._last_ended:
                    return
            self._publish(t)

    def publish(self, now: float | None = None) -> None:
        """Write the snapshot now."""
        with self._publish_lock:
            self._publish(time.monotonic() if now is None else now)

    def _publish(self, t: float) -> None:
        self._last = t
        snap = self.metrics.snapshot()
        snap["worker"] = self.worker_name
        self._last_ended = sum(snap["jobs"][o] for o in OUTCOMES)
        try:
            self.redis.set(self.key, json.dumps(snap), px=max(1, int(self.ttl_s * 1000)))
        except Exception as e:  # noqa: BLE001 - never let stats stop the worker
            log.warning("could not publish worker stats: %s", e)

    def start(self, poll_s: float = 0.1) -> "StatsPublisher":
        """Call ``maybe_publish`` every ``poll_s`` from a daemon thread (so
        the worker loop need not, and stats stay fresh during long steps or
        idle waits). Returns self; ``stop()`` ends it."""
        if self._thread is None:
            self._stopping.clear()
            self._thread = threading.Thread(target=self._run, args=(poll_s,), name="kiviq-stats", daemon=True)
            self._thread.start()
        return self

    def stop(self, clear: bool = True) -> None:
        """End the thread started by ``start``; ``clear`` removes the entry."""
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        if clear:
            self.clear()

    def _run(self, poll_s: float) -> None:
        while not self._stopping.is_set():
            self.maybe_publish()
            self._stopping.wait(poll_s)

    def clear(self) -> None:
        """Remove this worker's entry (on clean shutdown)."""
        try:
            self.redis.delete(self.key)
        except Exception as e:  # noqa: BLE001
            log.warning("could not clear worker stats: %s", e)

    def _ended_count(self) -> int:
        with self.metrics._lock:
            return int(self.metrics.ended.total())
