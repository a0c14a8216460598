"""The worker's per-step Redis traffic, on a thread of its own.

Every engine step the worker publishes one event per running job, asks Redis
which of its jobs a client wants cancelled and, with free slots, whether jobs
wait in its queues, all in one script call
(``EventPublisher.publish_and_check``); a job that ended needs rq's bookkeeping
(its result, its registries, its claim's release). Done on the engine's thread,
those round trips add to every decode step, and a decode step is host-bound:
the device waits for them. MLX releases the GIL while it launches and runs a step
(``mx.eval`` / ``mx.async_eval``), so on this thread the previous step's
traffic overlaps the next step instead (docs/performance.md, "The whole
service on the bulk workload").

Guarantees, the same as doing it in line:
- events reach Redis in the order they were put;
- a put's endings run after its events are published (a job's rq ending
  after its final event), in order, each once it succeeds;
- ``published`` tells the worker which puts are done, and
  ``pending_endings`` which jobs' endings are not yet recorded;
- if Redis goes away this thread retries with backoff, and ``put`` blocks once
  ``max_pending`` steps wait: the engine never runs far ahead of what Redis
  holds, and nothing generated is dropped while the process lives.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import redis

from kiviq.jobs.publisher import EventPublisher
from kiviq.jobs.models import StreamEvent, TokenEvent

log = logging.getLogger("kiviq.worker")

REDIS_DOWN = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError)
MAX_BACKOFF_S = 10.0


@dataclass
class _Put:
    number: int  # puts so far, this one included
    events: list[StreamEvent | TokenEvent]
    active_ids: tuple[str, ...]
    endings: list[tuple[str, Callable[[], None]]]  # (job id, its rq bookkeeping)
    ask_queues: bool


class Outbox:
    """Publishes each step's events, records endings in rq and reads cancel flags
    and queue lengths off the engine's thread.

    Args:
        connection: Redis connection (redis-py clients are thread-safe).
        queue_keys: the queues asked about for a put with ``ask_queues``.
        max_pending: steps that may wait to be published before ``put`` blocks.
        on_publish: called on this thread with the seconds each publish took
            (metrics).
    """

    def __init__(self, connection: redis.Redis, *, queue_keys: Sequence[str] = (), max_pending: int = 2,
                 on_publish: Any = None):
        self.connection = connection
        self.publisher = EventPublisher(connection)
        self.queue_keys = tuple(queue_keys)
        self.max_pending = max_pending
        self.on_publish = on_publish
        self._pending: deque[_Put] = deque()
        self._put = 0  # puts so far; a put's number is the count after it
        self._published = 0
        self._cancels: set[str] = set()
        self._queued = False
        self._error: BaseException | None = None
        self._last_redis_error: BaseException | None = None
        self._closing = False
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="kiviq-outbox", daemon=True)
        self._thread.start()

    # ---- the worker's side -------------------------------------------------

    def put(self, events: list[StreamEvent | TokenEvent], active_ids: Iterable[str],
            endings: Iterable[tuple[str, Callable[[], None]]] = (), *, ask_queues: bool = False) -> int:
        """Hand over one step's events (possibly none), the endings to record once
        they are published ((job id, rq bookkeeping) pairs, run in order), and the
        jobs now running (whose cancel flags are read after); ``ask_queues``: also
        ask whether jobs wait (``take_queued``). Blocks while ``max_pending`` steps
        wait. Returns this put's number."""
        with self._cond:
            while len(self._pending) >= self.max_pending and self._error is None:
                self._cond.wait()
            self._raise_error()
            self._put += 1
            self._pending.append(_Put(self._put, events, tuple(active_ids), list(endings), ask_queues))
            self._cond.notify_all()
            return self._put

    @property
    def last_put(self) -> int:
        return self._put

    @property
    def published(self) -> int:
        """The number of the last put that is done: its events in Redis, its endings recorded."""
        with self._cond:
            self._raise_error()
            return self._published

    def pending_endings(self) -> set[str]:
        """Jobs whose ending was put but is not recorded yet."""
        with self._cond:
            return {job_id for put in self._pending for job_id, _ in put.endings}

    def take_cancels(self) -> set[str]:
        """Jobs whose cancel flag was seen since the last call."""
        with self._cond:
            self._raise_error()
            found, self._cancels = self._cancels, set()
            return found

    def take_queued(self) -> bool:
        """Whether a put's queue check found a job waiting since the last call."""
        with self._cond:
            self._raise_error()
            found, self._queued = self._queued, False
            return found

    def wait_published(self, timeout: float | None = None) -> bool:
        """Wait until every put so far is done (published, endings recorded); False on timeout."""
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
        """Publish and record what is pending (for up to ``timeout`` s) and stop the thread.
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
                    put = self._pending[0]
                checked = self._deliver(put)
                with self._cond:
                    if checked is None:  # closing while Redis is down
                        return
                    self._pending.popleft()
                    self._published = put.number
                    self._cancels |= checked[0]
                    self._queued = self._queued or checked[1]
                    self._cond.notify_all()
        except BaseException as e:  # a bug, not Redis: the worker's thread re-raises it
            log.exception("outbox thread failed")
            with self._cond:
                self._error = e
                self._cond.notify_all()

    def _deliver(self, put: _Put) -> tuple[set[str], bool] | None:
        """Publish and read the cancel flags (and queue lengths) in one call, then
        record the endings; retry with backoff while Redis is away, never repeating
        a publish or an ending that completed."""
        backoff, checked, recorded = 0.5, None, 0
        while True:
            try:
                if checked is None:
                    started = time.perf_counter()
                    checked = self.publisher.publish_and_check(
                        put.events, put.active_ids, self.queue_keys if put.ask_queues else ())
                    if self.on_publish is not None and put.events:
                        self.on_publish(time.perf_counter() - started)
                while recorded < len(put.endings):
                    put.endings[recorded][1]()
                    recorded += 1
                return checked
            except REDIS_DOWN as e:
                self._last_redis_error = e
                log.error("Redis unreachable while publishing (%s); retrying in %.1f s", type(e).__name__, backoff)
                with self._cond:
                    if self._closing:
                        return None
                    self._cond.wait(backoff)
                backoff = min(backoff * 2, MAX_BACKOFF_S)
