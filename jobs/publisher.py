"""Write stream events to Redis: one pipeline per engine step for all jobs."""

from __future__ import annotations

from redis import Redis

from kiviq.jobs.keys import event_channel, replay_log
from kiviq.jobs.models import StreamEvent
from kiviq.jobs.streams import REPLAY_MAX_EVENTS, REPLAY_TTL_S


class EventPublisher:
    """Appends events to each job's replay log and publishes them live.

    Log first, then publish, in one round trip: a reader that wakes on the
    message always finds the event in the log.
    """

    def __init__(self, redis: Redis):
        self.redis = redis

    def next_seq(self, job_id: str) -> int:
        """Sequence number the job's next event gets (non-zero after a restart)."""
        return int(self.redis.llen(replay_log(job_id)))

    def publish(self, events: list[StreamEvent]) -> None:
        if not events:
            return
        with self.redis.pipeline(transaction=False) as pipe:
            for event in events:
                data = event.model_dump_json(exclude_none=True)
                pipe.rpush(replay_log(event.job_id), data)
                pipe.publish(event_channel(event.job_id), data)
            for job_id in {e.job_id for e in events}:
                pipe.ltrim(replay_log(job_id), -REPLAY_MAX_EVENTS, -1)
                pipe.expire(replay_log(job_id), REPLAY_TTL_S)
            pipe.execute()
