"""Worker metrics through ``prometheus_client``: one CollectorRegistry per
``WorkerMetrics`` (its families, plus the library's process and platform
collectors), served by the library's WSGI app and server, and ``snapshot()``, the
JSON summary that ``worker.stats.StatsPublisher`` writes to Redis for
``kiviq top``.

``BatchWorker`` feeds it (see worker/service.py): ``job_admitted`` as soon as
a job is taken from its queue (before it is validated, so every job that
ends was admitted first), ``first_token`` / ``tokens`` per step event,
``observe_engine_step`` after each step, ``job_finished`` (outcome finished,
failed, cancelled or timeout) and ``job_requeued``. ``run_worker`` serves
the registry (``worker.metrics_http.serve_metrics``) and publishes snapshots for ``kiviq top``
(``worker.stats.StatsPublisher``). All calls are cheap and thread-safe.

Times are seconds. ``tokens`` and ``job_finished`` never double count
generation tokens: ``job_finished`` adds only the completion tokens that
``tokens`` did not already report for that job. Counting is consistent:
``request_admitted_total == request_ended_total + request_requeued_total +
num_requests_active``.

Every ``kiviq:`` series carries ``model_name``; the names follow vLLM's.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable

from prometheus_client import (CollectorRegistry, Counter, Gauge, Histogram, PlatformCollector, ProcessCollector,
                               disable_created_metrics, generate_latest)
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4

from kiviq.worker.counted_histogram import CountedHistogram

# No ``*_created`` series (a process-wide switch of the library): in the text
# format each would be one more gauge family per counter and histogram.
disable_created_metrics()

log = logging.getLogger("kiviq.metrics")

PREFIX = "kiviq:"
OUTCOMES = ("finished", "failed", "cancelled", "timeout")
# The worker's own work between engine steps while jobs run (BatchWorker.serve), on
# the engine's thread: handing the step's events to the outbox and running rq
# endings, applying cancellations, admission and heartbeats. Counted per phase so a
# slow service shows where its time goes; the outbox thread's publishing is apart.
LOOP_PHASES = ("publish", "cancel_check", "admit_housekeeping")
RATE_WINDOW_S = 10.0  # rolling window of the tokens/s and step-time gauges
JOBS_WINDOW_S = 60.0  # "last minute" job counts (kiviq top's jobs/min)
CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4

# Buckets in the spirit of vLLM's.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
               5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                           60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
TOKEN_COUNT_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000)


def histogram_stats(metric: Histogram) -> tuple[list[tuple[float, float]], float, float]:
    """(cumulative buckets [(le, count)], sum, count) of a histogram, all
    its label sets added up (read through the library's ``collect``)."""
    buckets: dict[float, float] = {}
    total = count = 0.0
    for family in metric.collect():
        for s in family.samples:
            if s.name.endswith("_bucket"):
                le = float(s.labels["le"])
                buckets[le] = buckets.get(le, 0.0) + s.value
            elif s.name.endswith("_sum"):
                total += s.value
            elif s.name.endswith("_count"):
                count += s.value
    return sorted(buckets.items()), total, count


def quantile(buckets: list[tuple[float, float]], q: float) -> float | None:
    """Estimate a quantile from cumulative buckets by linear interpolation
    inside its bucket, as PromQL's histogram_quantile does; None when empty."""
    if not buckets or buckets[-1][1] == 0:
        return None
    rank = q * buckets[-1][1]
    lower, prev = 0.0, 0.0
    for bound, cum in buckets:
        if cum >= rank and cum > 0:
            if math.isinf(bound):
                return lower if len(buckets) > 1 else None
            inside = cum - prev
            return lower + (bound - lower) * ((rank - prev) / inside if inside else 0.0)
        lower, prev = bound, cum
    return None


class PhaseClock:
    """Seconds per named phase of one loop iteration: ``lap(phase)`` charges the
    time since the previous lap (or since the clock was made) to ``phase``."""

    def __init__(self) -> None:
        self.spent: dict[str, float] = {}
        self._t = time.perf_counter()

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        self.spent[phase] = self.spent.get(phase, 0.0) + now - self._t
        self._t = now


@dataclass
class _JobState:
    admitted_at: float
    first_token_at: float | None = None
    last_token_at: float | None = None
    tokens_seen: int = 0


class WorkerMetrics:
    """Everything one worker measures, in its own ``self.registry``.
    Thread-safe: the worker loop writes, the HTTP thread and the stats
    publisher read.

    Args:
        model_name: the ``model_name`` label of every series.
        clock: monotonic seconds (tests inject a fake).
        wall_clock: epoch seconds, stamped on snapshots.
        rate_window_s: window of the tokens/s and step-time gauges.
        jobs_window_s: window of the "jobs ended lately" counts.
        process_metrics: add the library's process_* and python_info collectors.
    """

    def __init__(self, model_name: str = "unknown", *, clock: Callable[[], float] = time.monotonic,
                 wall_clock: Callable[[], float] = time.time, rate_window_s: float = RATE_WINDOW_S,
                 jobs_window_s: float = JOBS_WINDOW_S, process_metrics: bool = True):
        from kiviq.jobs.keys import queue_names

        self._lock = threading.Lock()
        self._clock, self._wall = clock, wall_clock
        self.model_name = model_name
        self.rate_window_s, self.jobs_window_s = rate_window_s, jobs_window_s
        self._started = clock()
        self._jobs: dict[str, _JobState] = {}
        self._steps: deque[tuple[float, float, int, int]] = deque()  # (end, duration, decode, prefill)
        self._ended: deque[tuple[float, str]] = deque()  # (time, outcome)
        self._last_step_s: float | None = None
        self._engine_stats: dict[str, int] = {}
        self._tokens_since_step = 0
        # plain copies of what the snapshot shows (the library keeps its values private)
        self._n = {"running": 0, "waiting": 0, "kv_used": 0, "kv_budget": 0, "prompt_tokens": 0,
                   "generation_tokens": 0, "admitted": 0, "requeued": 0, "steps": 0,
                   **{o: 0 for o in OUTCOMES}}

        self.registry = reg = CollectorRegistry(auto_describe=True)
        if process_metrics:
            ProcessCollector(registry=reg)
            PlatformCollector(registry=reg)
        m = ("model_name",)

        def gauge(name: str, doc: str) -> Any:
            return Gauge(PREFIX + name, doc, m, registry=reg).labels(model_name)

        def counter(name: str, doc: str, labels: tuple[str, ...] = (), seed: tuple[str, ...] = ()) -> Any:
            c = Counter(PREFIX + name, doc, m + labels, registry=reg)
            if not labels:
                return c.labels(model_name)
            for v in seed:
                c.labels(model_name, v)
            return c

        def histogram(name: str, doc: str, buckets: tuple, labels: tuple[str, ...] = ()) -> Any:
            h = Histogram(PREFIX + name, doc, m + labels, buckets=buckets, registry=reg)
            return h if labels else h.labels(model_name)

        self.running = gauge("num_requests_running", "Sequences running in the engine (prefilling or decoding).")
        self.waiting = gauge("num_requests_waiting", "Sequences admitted to the engine, waiting to be scheduled.")
        self.active = gauge("num_requests_active", "Jobs taken from Redis by this worker and not yet ended.")
        self.queued = Gauge(PREFIX + "num_requests_queued", "Jobs waiting in each Redis queue (read by this worker "
                            "about every second; every worker reports the same queues: use max by queue).",
                            m + ("queue",), registry=reg)
        for q in queue_names():
            self.queued.labels(model_name, q).set(0)
        self.kv_usage = gauge("kv_cache_usage_perc", "KV-cache usage as a fraction of its budget (0..1).")
        self.kv_used = gauge("kv_cache_used_bytes", "KV-cache bytes in use.")
        self.kv_budget = gauge("kv_cache_budget_bytes", "KV-cache budget in bytes.")
        self.decode_tps = gauge("decode_tokens_per_second",
                                f"Decode tokens per second over the last {rate_window_s:g} s.")
        self.prefill_tps = gauge("prefill_tokens_per_second",
                                 f"Prefill tokens per second over the last {rate_window_s:g} s.")
        self.decode_tps.set_function(lambda: self._rates_now()[0])
        self.prefill_tps.set_function(lambda: self._rates_now()[1])
        self.prompt_tokens = counter("prompt_tokens_total", "Prompt tokens of ended requests.")
        self.generation_tokens = counter("generation_tokens_total", "Generated tokens.")
        self.decode_tokens = counter("decode_tokens_total", "Tokens computed in decode phases.")
        self.prefill_tokens = counter("prefill_tokens_total",
                                      "Tokens computed in prefill phases (recomputation after preemption included).")
        self.preemptions = counter("num_preemptions_total",
                                   "Sequences preempted by the engine (KV memory full; recomputed later).")
        self.success = counter("request_success_total", "Requests that finished successfully, by finish reason.",
                               ("finished_reason",), seed=("stop", "length"))
        self.ended = counter("request_ended_total", "Requests that ended, by outcome.", ("outcome",), seed=OUTCOMES)
        self.admitted = counter("request_admitted_total", "Requests taken from a queue, by queue.", ("queue",),
                                seed=tuple(queue_names()))
        self.requeued = counter("request_requeued_total", "Requests put back into their queue unfinished.")
        self.ttft = histogram("time_to_first_token_seconds", "Time from admission to the first generated token.",
                              TTFT_BUCKETS)
        self.itl = CountedHistogram(PREFIX + "inter_token_latency_seconds",
                                    "Time between consecutive generated tokens of a request.", ITL_BUCKETS,
                                    {"model_name": model_name}, reg)
        self.tpot = histogram("time_per_output_token_seconds",
                              "Per request: time from its first to its last token over its tokens after the first.",
                              ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Time from admission to the end of a request.",
                             REQUEST_LATENCY_BUCKETS)
        self.queue_time = histogram("request_queue_time_seconds", "Time a request waited in its Redis queue.",
                                    REQUEST_LATENCY_BUCKETS, ("queue",))
        for q in queue_names():
            self.queue_time.labels(model_name, q)
        self.step_time = histogram("step_duration_seconds", "Duration of one engine step.", STEP_BUCKETS)
        self.loop_time = counter("worker_loop_seconds_total", "Seconds of the worker's own work around engine "
                                 "steps while jobs run, by phase (PhaseClock).", ("phase",), seed=LOOP_PHASES)
        self.outbox_time = histogram("outbox_publish_seconds", "One step's Redis call by the outbox thread (off the "
                                     "engine's thread): its events published, cancel flags and "
                                     "queues read.", STEP_BUCKETS)
        self.prompt_len = histogram("request_prompt_tokens", "Prompt tokens per ended request.", TOKEN_COUNT_BUCKETS)
        self.gen_len = histogram("request_generation_tokens", "Generated tokens per ended request.",
                                 TOKEN_COUNT_BUCKETS)

    # ---- events from the worker -------------------------------------------

    def job_admitted(self, job_id: str, queue_wait_s: float, queue: str) -> None:
        """A job left its Redis queue (``queue``) after ``queue_wait_s``."""
        with self._lock:
            self._jobs[job_id] = _JobState(self._clock())
            self.admitted.labels(self.model_name, queue).inc()
            self._n["admitted"] += 1
            self.queue_time.labels(self.model_name, queue).observe(max(0.0, queue_wait_s))
            self.active.set(len(self._jobs))

    def first_token(self, job_id: str, ttft_s: float) -> None:
        """A job's first token came ``ttft_s`` after admission."""
        self.ttft.observe(max(0.0, ttft_s))

    def tokens(self, job_id: str, n: int, now: float | None = None) -> None:
        """``n`` tokens of a job came out of one step (``step_tokens`` for one job)."""
        self.step_tokens([(job_id, n)], now)

    def step_tokens(self, counts: list[tuple[str, int]], now: float | None = None) -> None:
        """The tokens each job got from one step, as (job id, n) pairs: one
        lock and one clock read for the whole step. The gap since a job's
        previous tokens, split evenly over its ``n``, is its inter-token
        latency (its first tokens have none: that is TTFT)."""
        with self._lock:
            t = self._clock() if now is None else now
            jobs, total = self._jobs, 0
            gaps: dict[float, int] = {}  # gap -> tokens: one entry for the jobs that got tokens last step
            for job_id, n in counts:
                if n <= 0:
                    continue
                st = jobs.get(job_id)
                if st is None:
                    st = jobs[job_id] = _JobState(t)
                    self.active.set(len(jobs))
                if st.last_token_at is not None:
                    gap = max(0.0, t - st.last_token_at) / n
                    gaps[gap] = gaps.get(gap, 0) + n
                else:
                    st.first_token_at = t
                st.last_token_at = t
                st.tokens_seen += n
                total += n
            for gap, n in gaps.items():
                self.itl.observe(gap, n)
            self._add_generated(total)
            self._tokens_since_step += total

    def _add_generated(self, n: int) -> None:
        if n > 0:
            self.generation_tokens.inc(n)
            self._n["generation_tokens"] += n

    def step(self, duration_s: float, *, decode_tokens: int, prefill_tokens: int, running: int, waiting: int,
             kv_used_bytes: int, kv_budget_bytes: int, preemptions: int = 0) -> None:
        """One engine step ended: its duration, the tokens it computed, the
        sequences it preempted, and the engine's state after it."""
        with self._lock:
            t = self._clock()
            self._last_step_s = duration_s
            self._n["steps"] += 1
            self.step_time.observe(max(0.0, duration_s))
            if decode_tokens > 0:
                self.decode_tokens.inc(decode_tokens)
            if prefill_tokens > 0:
                self.prefill_tokens.inc(prefill_tokens)
            if preemptions > 0:
                self.preemptions.inc(preemptions)
            self._set_running(running, waiting)
            self._set_kv(kv_used_bytes, kv_budget_bytes)
            self._steps.append((t, duration_s, decode_tokens, prefill_tokens))
            self._trim(t)

    def kv_memory(self, used_bytes: int, budget_bytes: int) -> None:
        """KV usage changed outside a step (a job was cancelled or ended):
        freed memory shows at once, not at the next step."""
        with self._lock:
            self._set_kv(used_bytes, budget_bytes)

    def queue_lengths(self, lengths: dict[str, int]) -> None:
        """Jobs waiting in each Redis queue, by queue name."""
        for queue, n in lengths.items():
            self.queued.labels(self.model_name, queue).set(n)

    def _set_running(self, running: int, waiting: int) -> None:
        self._n["running"], self._n["waiting"] = running, waiting
        self.running.set(running)
        self.waiting.set(waiting)

    def _set_kv(self, used: int, budget: int) -> None:
        self._n["kv_used"], self._n["kv_budget"] = used, budget
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
            self._add_generated(max(0, completion_tokens - seen))
            self.prompt_tokens.inc(max(0, prompt_tokens))
            self._n["prompt_tokens"] += max(0, prompt_tokens)
            self.prompt_len.observe(prompt_tokens)
            self.gen_len.observe(completion_tokens)
            self.e2e.observe(max(0.0, e2e_s))
            if st and st.first_token_at is not None and st.tokens_seen > 1:
                self.tpot.observe(max(0.0, st.last_token_at - st.first_token_at) / (st.tokens_seen - 1))
            self.ended.labels(self.model_name, outcome).inc()
            self._n[outcome] += 1
            if outcome == "finished":
                self.success.labels(self.model_name, finish_reason or "unknown").inc()
            t = self._clock()
            self._ended.append((t, outcome))
            self._trim(t)
            self._settle_after_end()

    def job_requeued(self, job_id: str) -> None:
        """A job went back to its queue unfinished (shutdown): forget it."""
        with self._lock:
            self._jobs.pop(job_id, None)
            self.requeued.inc()
            self._n["requeued"] += 1
            self._settle_after_end()

    def worker_loop(self, spent: dict[str, float]) -> None:
        """One worker loop iteration that stepped the engine: its own phases
        (``PhaseClock.spent``; the step itself is ``step_duration_seconds``)."""
        for phase in LOOP_PHASES:
            if spent.get(phase):
                self.loop_time.labels(self.model_name, phase).inc(spent[phase])

    def outbox_publish(self, seconds: float) -> None:
        """The outbox thread published one step's events in ``seconds``."""
        self.outbox_time.observe(max(0.0, seconds))

    def observe_engine_step(self, engine: Any, duration_s: float) -> None:
        """``step(...)`` with the numbers read off ``engine``: deltas of
        ``engine.stats`` (tokens, preemptions), scheduler queue lengths, KV
        store bytes. Engines without these (the serial engine) report what
        they can."""
        stats = getattr(engine, "stats", None)
        preempted = 0
        if isinstance(stats, dict) and "decode_tokens" in stats:
            decode = self._stats_delta(stats, "decode_tokens")
            prefill = self._stats_delta(stats, "prefill_tokens")
            preempted = self._stats_delta(stats, "preemptions")
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
                  kv_used_bytes=used, kv_budget_bytes=budget, preemptions=preempted)

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
        running = min(self._n["running"], n)
        self._set_running(running, min(self._n["waiting"], n - running))
        if n == 0:
            self._set_kv(0, self._n["kv_budget"])

    def _trim(self, t: float) -> None:
        while self._steps and self._steps[0][0] < t - self.rate_window_s:
            self._steps.popleft()
        while self._ended and self._ended[0][0] < t - self.jobs_window_s:
            self._ended.popleft()

    def _rates_now(self) -> tuple[float, float, float | None]:
        with self._lock:
            return self._rates(self._clock())

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
        """Every metric of the registry in the Prometheus text format."""
        return generate_latest(self.registry).decode()

    def ended_count(self) -> int:
        with self._lock:
            return sum(self._n[o] for o in OUTCOMES)

    def snapshot(self) -> dict:
        """A JSON-able summary (what ``kiviq top`` shows)."""
        def mean(h: Histogram | CountedHistogram) -> float | None:
            _, total, count = histogram_stats(h)
            return total / count if count else None

        ttft_buckets, ttft_sum, ttft_count = histogram_stats(self.ttft)
        with self._lock:
            t = self._clock()
            d, p, mean_step = self._rates(t)
            recent = {o: 0 for o in OUTCOMES}
            for _, o in self._ended:
                recent[o] += 1
            n = dict(self._n)
            active = len(self._jobs)
        used, budget = n["kv_used"], n["kv_budget"]
        return {
            "version": 1,
            "model": self.model_name,
            "time": self._wall(),
            "uptime_s": t - self._started,
            "running": n["running"],
            "waiting": n["waiting"],
            "active": active,
            "kv_used_bytes": used,
            "kv_budget_bytes": budget,
            "kv_usage": min(1.0, used / budget) if budget > 0 else 0.0,
            "rate_window_s": self.rate_window_s,
            "decode_tokens_per_s": d,
            "prefill_tokens_per_s": p,
            "step_time_s": mean_step,
            "last_step_s": self._last_step_s,
            "steps": n["steps"],
            "prompt_tokens": n["prompt_tokens"],
            "generation_tokens": n["generation_tokens"],
            "jobs": {"admitted": n["admitted"], "requeued": n["requeued"], **{o: n[o] for o in OUTCOMES}},
            "jobs_window_s": self.jobs_window_s,
            "jobs_recent": recent,
            "ttft_avg_s": ttft_sum / ttft_count if ttft_count else None,
            "ttft_p50_s": quantile(ttft_buckets, 0.5),
            "itl_avg_s": mean(self.itl),
            "e2e_avg_s": mean(self.e2e),
            "queue_time_avg_s": mean(self.queue_time),
        }
