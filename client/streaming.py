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

from jobs.keys import event_channel, replay_log
from jobs.models import EventType, StreamEvent

TERMINAL = (EventType.done, EventType.error)
POLL_S = 1.0  # how often to re-read the log when the channel is quiet


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
    pubsub = redis.pubsub(ignore_subscribe_messages=True)
    pubsub.subscribe(event_channel(job_id))
    next_seq = 0
    try:
        while True:
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
    finally:
        pubsub.close()


def iter_text(events: Iterator[StreamEvent]) -> Iterator[str]:
    """Text deltas from events; after a ``restarted`` event, text the caller
    already has is not yielded again (a requeued greedy job regenerates it)."""
    emitted = ""  # everything yielded so far
    current = ""  # text of the current attempt
    for event in events:
        if event.type == EventType.restarted:
            current = ""
        elif event.type == EventType.token and event.text:
            current += event.text
            if len(current) > len(emitted) and current.startswith(emitted):
                delta = current[len(emitted):]
                emitted = current
                yield delta
        elif event.type == EventType.error:
            raise JobFailed(event.error or "job failed")


class JobFailed(RuntimeError):
    """The job ended in error; the message is the worker's reason."""
