"""The worker's per-step Redis traffic, on a thread of its own.

Every engine step the worker publishes one event per running job and asks
Redis which of its jobs a client wants cancelled. Done on the engine's thread,
those round trips add to every decode step, and a decode step is host-bound:
the device waits for them. MLX releases the GIL while it launches and runs a
step (``mx.eval`` / ``mx.async_eval``), so on this thread the previous step's
traffic overlaps the next step instead (docs/performance.md, "The whole
service on the bulk workload").

Guarantees, the same as publishing in line:
- events reach Redis in the order they were put;
- ``published`` tells the worker which puts Redis holds, so an rq ending (a
  job's result, its claim's release) runs only after the job's final event;
- if Redis goes away this thread retries with backoff, and ``put`` blocks once
  ``max_pending`` steps wait: the engine never runs far ahead of what Redis
  holds, and nothing generated is dropped while the process lives.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Iterable, Sequence
from typing import Any

import redis

from kiviq.jobs.keys import cancel_flag
from kiviq.jobs.publisher import EventPublisher
from kiviq.jobs.models import StreamEvent

log = logging.getLogger("kiviq.worker")

REDIS_DOWN = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError)
MAX_BACKOFF_S = 10.0


def flagged_for_cancel(connection: redis.Redis, job_ids: Sequence[str]) -> set[str]:
    """The jobs among ``job_ids`` whose cancel flag is set. One EXISTS over every
    flag answers the usual case (none) in one command; only then is each asked."""
    if not job_ids or not connection.exists(*(cancel_flag(job_id) for job_id in job_ids)):
        return set()
    with connection.pipeline(transaction=False) as pipe:
        for job_id in job_ids:
            pipe.exists(cancel_flag(job_id))
        flags = pipe.execute()
    return {job_id for job_id, flagged in zip(job_ids, flags) if flagged}


class Outbox:
    """Publishes each step's events and checks cancel flags off the engine's thread.

    Args:
        connection: Redis connection (redis-py clients are thread-safe).
        max_pending: steps that may wait to be published before ``put`` blocks.
        on_publish: called on this thread with the seconds each publish took
            (metrics).
    """

    def __init__(self, connection: redis.Redis, *, max_pending: int = 2, on_publish: Any = None):
        self.connection = connection
        self.publisher = EventPublisher(connection)
        self.max_pending = max_pending
        self.on_publish = on_publish
        self._pending: deque[tuple[int, list[StreamEvent], tuple[str, ...]]] = deque()
        self._put = 0  # puts so far; a put's number is the count after it
        self._published = 0
        self._cancels: set[str] = set()
        self._error: BaseException | None = None
        self._last_redis_error: BaseException | None = None
        self._closing = False
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="kiviq-outbox", daemon=True)
        self._thread.start()

    # ---- the worker's side -------------------------------------------------

    def put(self, events: list[StreamEvent], active_ids: Iterable[str]) -> int:
        """Hand over one step's events (possibly none) and the jobs now running
        (whose cancel flags are read after the events are published). Blocks
        while ``max_pending`` steps wait. Returns this put's number."""
        with self._cond:
            while len(self._pending) >= self.max_pending and self._error is None:
                self._cond.wait()
            self._raise_error()
            self._put += 1
            self._pending.append((self._put, events, tuple(active_ids)))
            self._cond.notify_all()
            return self._put

    @property
    def last_put(self) -> int:
        return self._put

    @property
    def published(self) -> int:
        """The number of the last put whose events Redis holds."""
        with self._cond:
            self._raise_error()
            return self._published

    def take_cancels(self) -> set[str]:
        """Jobs whose cancel flag was seen since the last call."""
        with self._cond:
            self._raise_error()
            found, self._cancels = self._cancels, set()
            return found

    def wait_published(self, timeout: float | None = None) -> bool:
        """Wait until every put so far is published; False on timeout."""
        upto = self._put
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._published < upto and self._error is None:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left)
            self._raise_error()
            return True

    def close(self, timeout: float = 10.0) -> None:
        """Publish what is pending (for up to ``timeout`` s) and stop the thread.
        Raises the last Redis error when Redis did not take everything."""
        drained = self.wait_published(timeout=timeout)
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._thread.join(timeout=1.0)
        if not drained:
            raise self._last_redis_error or redis.exceptions.TimeoutError("events still unpublished at shutdown")

    def _raise_error(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"the outbox thread failed: {self._error!r}") from self._error

    # ---- the thread --------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    while not self._pending and not self._closing:
                        self._cond.wait()
                    if not self._pending:
                        return
                    number, events, active_ids = self._pending[0]
                cancels = self._deliver(events, active_ids)
                with self._cond:
                    if cancels is None:  # closing while Redis is down
                        return
                    self._pending.popleft()
                    self._published = number
                    self._cancels |= cancels
                    self._cond.notify_all()
        except BaseException as e:  # a bug, not Redis: the worker's thread re-raises it
            log.exception("outbox thread failed")
            with self._cond:
                self._error = e
                self._cond.notify_all()

    def _deliver(self, events: list[StreamEvent], active_ids: tuple[str, ...]) -> set[str] | None:
        """Publish, then read cancel flags; retry with backoff while Redis is away."""
        backoff, published = 0.5, False
        while True:
            try:
                if not published:  # a retry after the cancel check failed must not publish twice
                    started = time.perf_counter()
                    self.publisher.publish(events)
                    published = True
                    if self.on_publish is not None and events:
                        self.on_publish(time.perf_counter() - started)
                return flagged_for_cancel(self.connection, active_ids)
            except REDIS_DOWN as e:
                self._last_redis_error = e
                log.error("Redis unreachable while publishing (%s); retrying in %.1f s", type(e).__name__, backoff)
                with self._cond:
                    if self._closing:
                        return None
                    self._cond.wait(backoff)
                backoff = min(backoff * 2, MAX_BACKOFF_S)
