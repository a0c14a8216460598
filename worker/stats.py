"""Per-worker stats in Redis for ``kiviq top``: a JSON snapshot of
``WorkerMetrics`` under ``jobs.keys.worker_stats_key(name)``, TTL'd, written
from a thread; the same thread reads the Redis queue lengths into the
``kiviq:num_requests_queued`` gauge."""

from __future__ import annotations

import json
import logging
import threading
import time
from typing import Any

from kiviq.worker.metrics import OUTCOMES, WorkerMetrics

log = logging.getLogger("kiviq.metrics")


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
                if since < self.every_s and self.metrics.ended_count() == self._last_ended:
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
            self.metrics.queue_lengths(self._queue_lengths())
        except Exception as e:  # noqa: BLE001 - never let stats stop the worker
            log.warning("could not publish worker stats: %s", e)

    def _queue_lengths(self) -> dict[str, int]:
        from rq import Queue

        from kiviq.jobs.keys import queue_names

        names = queue_names()
        with self.redis.pipeline(transaction=False) as pipe:
            for name in names:
                pipe.llen(Queue.redis_queue_namespace_prefix + name)
            return dict(zip(names, (int(n) for n in pipe.execute())))

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
