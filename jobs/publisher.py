"""Write stream events to Redis: one script call per engine step for all jobs."""

from __future__ import annotations

from collections.abc import Sequence

from redis import Redis
from redis.commands.core import Script

from kiviq.jobs.keys import event_channel, replay_log
from kiviq.jobs.models import StreamEvent, TokenEvent
from kiviq.jobs.streams import REPLAY_MAX_EVENTS, REPLAY_TTL_S

# KEYS: each event's replay log. ARGV: the log's cap and TTL, then every event's
# channel and every event's JSON, each list joined by newlines (a channel name
# holds none, and JSON escapes them in strings): four arguments whatever the
# batch, where redis-py would encode two per event on the publishing thread.
# Each event goes into its log before it is published (and the script runs
# atomically besides), so a reader that wakes on the message finds the event in
# the log; then every log named is capped and its TTL renewed.
_PUBLISH_SCRIPT = """
local cap, ttl = tonumber(ARGV[1]), tonumber(ARGV[2])
local channels, events = {}, {}
for c in string.gmatch(ARGV[3], "[^\\n]+") do channels[#channels + 1] = c end
for e in string.gmatch(ARGV[4], "[^\\n]+") do events[#events + 1] = e end
for i = 1, #KEYS do
  redis.call('RPUSH', KEYS[i], events[i])
  redis.call('PUBLISH', channels[i], events[i])
end
for i = 1, #KEYS do
  if i == 1 or KEYS[i] ~= KEYS[i - 1] then
    redis.call('LTRIM', KEYS[i], -cap, -1)
    redis.call('EXPIRE', KEYS[i], ttl)
  end
end
return #KEYS
"""

# Sent by SHA once loaded (redis-py's Script falls back to EVAL when a server lacks it).
_PUBLISH = Script(None, _PUBLISH_SCRIPT.encode())


class EventPublisher:
    """Appends events to each job's replay log and publishes them live.

    One round trip and one command per step, whatever the batch: redis-py's
    work grows with the commands it packs, and the worker does it between two
    host-bound decode steps (docs/performance.md, "The worker's Redis work").
    """

    def __init__(self, redis: Redis):
        self.redis = redis

    def next_seq(self, job_id: str) -> int:
        """Sequence number the job's next event gets (non-zero after a restart)."""
        return int(self.redis.llen(replay_log(job_id)))

    def publish(self, events: Sequence[StreamEvent | TokenEvent]) -> None:
        if not events:
            return
        keys, channels, payloads = encode_events(events)
        _PUBLISH(keys=keys, args=[REPLAY_MAX_EVENTS, REPLAY_TTL_S, channels, payloads], client=self.redis)


def encode_events(events: Sequence[StreamEvent | TokenEvent]) -> tuple[list[str], str, str]:
    """A step's events as the publish script takes them: each event's replay log,
    then the channels and the JSON events, each joined by newlines."""
    channels = "\n".join(event_channel(e.job_id) for e in events)
    payloads = "\n".join(_stream_event(e).model_dump_json(exclude_none=True) for e in events)
    return [replay_log(e.job_id) for e in events], channels, payloads


def _stream_event(event: StreamEvent | TokenEvent) -> StreamEvent:
    return event.stream_event() if isinstance(event, TokenEvent) else event
