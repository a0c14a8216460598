"""Read a job's event stream: replay log first, then live pub/sub.

The worker appends every event to the job's replay log and publishes the same
JSON on the job's channel in one script call. A reader subscribes *before*
reading the log, so an event is always in the log, on the channel, or both.
After the log it takes events from the channel's messages themselves, one read
each; it goes back to the log only when a message skips a sequence number (it
missed one) or the channel stays quiet for ``POLL_S``. It keeps the next ``seq``
it expects and drops anything it has already yielded, which makes late
subscription and reconnects lossless and duplicate-free.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

from redis import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from kiviq.jobs.keys import event_channel, replay_log
from kiviq.jobs.models import EventType, StreamEvent

TERMINAL = (EventType.done, EventType.error)
POLL_S = 1.0  # how often to re-read the log when the channel is quiet


class EventCursor:
    """A reader's exactly-once, in-order bookkeeping (shared by the sync and
    async readers): the next ``seq`` it expects, whether it saw the end, and
    whether it must read the log before it waits on the channel again."""

    def __init__(self) -> None:
        self.next_seq = 0
        self.finished = False
        self.read_log = True  # at the start (events published before we subscribed)

    def accept(self, raws: list) -> list[StreamEvent]:
        """The new events among raw log entries, up to and including a terminal one."""
        self.read_log = False
        out = []
        for raw in raws:
            out += self._take(StreamEvent.model_validate_json(raw))
            if self.finished:
                break
        return out

    def accept_message(self, message: dict | None) -> list[StreamEvent]:
        """The event a channel message carries, when it is the next one. A later
        one means messages were missed, and ``None`` (no message within the wait,
        or a subscribe confirmation) may mean the same: either sends the reader
        back to the log, which holds every event."""
        if message is None:
            self.read_log = True
            return []
        event = StreamEvent.model_validate_json(message["data"])
        if event.seq > self.next_seq:
            self.read_log = True
            return []
        return self._take(event)

    def _take(self, event: StreamEvent) -> list[StreamEvent]:
        if event.seq < self.next_seq or self.finished:
            return []
        self.next_seq = event.seq + 1
        self.finished = event.type in TERMINAL
        return [event]


def wait_s(deadline: float | None, job_id: str, timeout: float | None) -> float:
    """How long to wait for the channel before re-reading the log.

    Raises:
        TimeoutError: the deadline has passed.
    """
    wait = POLL_S
    if deadline is not None:
        wait = min(wait, deadline - time.monotonic())
        if wait <= 0:
            raise TimeoutError(f"job {job_id}: no final event within {timeout} s")
    return wait


class TextDeltas:
    """Turns events into text deltas; after a ``restarted`` event, text the
    caller already has is not returned again (a requeued greedy job
    regenerates it). Shared by the sync and async streams."""

    def __init__(self) -> None:
        self.emitted = ""  # everything returned so far
        self.current = ""  # text of the current attempt

    def feed(self, event: StreamEvent) -> str:
        """The new text this event adds ('' if none).

        Raises:
            JobFailed: an ``error`` event.
        """
        if event.type == EventType.restarted:
            self.current = ""
        elif event.type == EventType.token and event.text:
            self.current += event.text
            if len(self.current) > len(self.emitted) and self.current.startswith(self.emitted):
                delta = self.current[len(self.emitted):]
                self.emitted = self.current
                return delta
        elif event.type == EventType.error:
            raise JobFailed(event.error or "job failed")
        return ""


def iter_events(redis: Redis, job_id: str, timeout: float | None = None) -> Iterator[StreamEvent]:
    """Yield every event of a job in order, exactly once, ending at done/error.

    Args:
        redis: connection to the Redis the job lives in.
        job_id: the job's id.
        timeout: seconds to wait for the terminal event overall (None: forever).

    Raises:
        TimeoutError: the job produced no terminal event in time.
    """
    deadline = None if timeout is None else time.monotonic() + timeout
    cursor = EventCursor()
    pubsub = None
    try:
        while not cursor.finished:
            try:
                if pubsub is None:
                    pubsub = redis.pubsub(ignore_subscribe_messages=True)
                    pubsub.subscribe(event_channel(job_id))
                    cursor.read_log = True
                if cursor.read_log:
                    events = cursor.accept(redis.lrange(replay_log(job_id), cursor.next_seq, -1))
                else:
                    events = cursor.accept_message(pubsub.get_message(timeout=wait_s(deadline, job_id, timeout)))
            except (RedisConnectionError, RedisTimeoutError):
                # Redis restarted or the link dropped: resubscribe and re-read
                # the log from where we are; nothing is lost or repeated.
                if pubsub is not None:
                    pubsub.close()
                    pubsub = None
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError(f"job {job_id}: no final event within {timeout} s") from None
                time.sleep(POLL_S)
                continue
            yield from events
    finally:
        if pubsub is not None:
            pubsub.close()


def iter_text(events: Iterator[StreamEvent]) -> Iterator[str]:
    """Text deltas from events; after a ``restarted`` event, text the caller
    already has is not yielded again (a requeued greedy job regenerates it)."""
    deltas = TextDeltas()
    for event in events:
        delta = deltas.feed(event)
        if delta:
            yield delta


class JobFailed(RuntimeError):
    """The job ended in error; the message is the worker's reason."""
