"""Read a job's event stream: replay log first, then live pub/sub.

The worker appends every event to the job's replay log and publishes it on the
job's channel in one pipeline. A reader subscribes *before* reading the log, so
an event is always in the log, on the channel, or both; it keeps the next
``seq`` it expects and drops anything it has already yielded, which makes late
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
    async readers): the next ``seq`` it expects and whether it saw the end."""

    def __init__(self) -> None:
        self.next_seq = 0
        self.finished = False

    def accept(self, raws: list) -> list[StreamEvent]:
        """The new events among raw log entries, up to and including a terminal one."""
        out = []
        for raw in raws:
            event = StreamEvent.model_validate_json(raw)
            if event.seq < self.next_seq:
                continue
            self.next_seq = event.seq + 1
            out.append(event)
            if event.type in TERMINAL:
                self.finished = True
                break
        return out


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
    next_seq = 0
    pubsub = None
    try:
        while True:
            try:
                if pubsub is None:
                    pubsub = redis.pubsub(ignore_subscribe_messages=True)
                    pubsub.subscribe(event_channel(job_id))
                # The log is the source of truth; pub/sub only wakes us up early.
                for raw in redis.lrange(replay_log(job_id), next_seq, -1):
                    event = StreamEvent.model_validate_json(raw)
                    if event.seq < next_seq:
                        continue
                    next_seq = event.seq + 1
                    yield event
                    if event.type in TERMINAL:
                        return
                wait = POLL_S
                if deadline is not None:
                    wait = min(wait, deadline - time.monotonic())
                    if wait <= 0:
                        raise TimeoutError(f"job {job_id}: no final event within {timeout} s")
                message = pubsub.get_message(timeout=wait)
                # Drain whatever else arrived, then go back to the log for ordering.
                while message is not None:
                    message = pubsub.get_message(timeout=0)
            except (RedisConnectionError, RedisTimeoutError):
                # Redis restarted or the link dropped: resubscribe and re-read
                # the log from where we are; nothing is lost or repeated.
                if pubsub is not None:
                    pubsub.close()
                    pubsub = None
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError(f"job {job_id}: no final event within {timeout} s") from None
                time.sleep(POLL_S)
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
