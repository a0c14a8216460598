"""Write stream events to Redis and read what the worker asks after each step:
one script call per engine step for all jobs."""

from __future__ import annotations

from collections.abc import Sequence
from json.encoder import encode_basestring as _json_string

from redis import Redis
from redis.commands.core import Script

from kiviq.jobs.keys import cancel_flag, event_channel, replay_log
from kiviq.jobs.models import StreamEvent, TokenEvent
from kiviq.jobs.streams import REPLAY_MAX_EVENTS, REPLAY_TTL_S

# ARGV: the logs' cap and TTL; the prefixes of a job's replay log, event channel and
# cancel flag (kiviq.jobs.keys); then, each list joined by newlines (a job id holds
# none, and JSON escapes them in strings): the events' job ids, the events' JSON, the
# running jobs' ids and the queues' keys. Nine arguments whatever the batch: redis-py
# encodes each argument in Python (~1.5 us), on the thread that shares the GIL with
# the engine's, and a step's keys by name were ~130 of them at B=64.
# Each event goes into its log before it is published (and the script runs
# atomically besides), so a reader that wakes on the message finds the event in
# the log; then every log named is capped and its TTL renewed. Then the step's
# questions: which running jobs a client wants cancelled, and whether a queue holds
# a job. Returns {events written, the flagged job ids, 1 if a queue holds a job}.
# Redis and Valkey let a script name keys it was not given; the first line, a Lua
# comment, asks the same of Dragonfly (which refuses them by default).
_STEP_SCRIPT = """--!df flags=allow-undeclared-keys
local cap, ttl = tonumber(ARGV[1]), tonumber(ARGV[2])
local log, channel, cancel = ARGV[3], ARGV[4], ARGV[5]
local function lines(s)
  local t = {}
  for x in string.gmatch(s, "[^\\n]+") do t[#t + 1] = x end
  return t
end
local ids, events = lines(ARGV[6]), lines(ARGV[7])
for i = 1, #ids do
  redis.call('RPUSH', log .. ids[i], events[i])
  redis.call('PUBLISH', channel .. ids[i], events[i])
end
for i = 1, #ids do
  if i == 1 or ids[i] ~= ids[i - 1] then
    redis.call('LTRIM', log .. ids[i], -cap, -1)
    redis.call('EXPIRE', log .. ids[i], ttl)
  end
end
local flagged = {}
for _, id in ipairs(lines(ARGV[8])) do
  if redis.call('EXISTS', cancel .. id) == 1 then flagged[#flagged + 1] = id end
end
local queued = 0
for _, key in ipairs(lines(ARGV[9])) do
  if redis.call('LLEN', key) > 0 then
    queued = 1
    break
  end
end
return {#ids, flagged, queued}
"""

# Sent by SHA once loaded (redis-py's Script falls back to EVAL when a server lacks it).
_STEP = Script(None, _STEP_SCRIPT.encode())


class EventPublisher:
    """Appends events to each job's replay log and publishes them live.

    One round trip and one command per step, whatever the batch: redis-py's
    work grows with the arguments it encodes, and the worker does it beside
    host-bound decode steps (docs/performance.md, "The worker's Redis work").
    """

    def __init__(self, redis: Redis):
        self.redis = redis

    def next_seq(self, job_id: str) -> int:
        """Sequence number the job's next event gets (non-zero after a restart)."""
        return int(self.redis.llen(replay_log(job_id)))

    def publish(self, events: Sequence[StreamEvent | TokenEvent]) -> None:
        if events:
            self.publish_and_check(events)

    def publish_and_check(self, events: Sequence[StreamEvent | TokenEvent], running: Sequence[str] = (),
                          queue_keys: Sequence[str] = ()) -> tuple[set[str], bool]:
        """Publish a step's ``events``, then ask which of the ``running`` jobs have
        their cancel flag set and whether any of ``queue_keys`` holds a job; one
        round trip, none when there is nothing to write or ask."""
        if not events and not running and not queue_keys:
            return set(), False
        ids, payloads = encode_events(events)
        _, flagged, queued = _STEP(args=[REPLAY_MAX_EVENTS, REPLAY_TTL_S, replay_log(""), event_channel(""),
                                         cancel_flag(""), ids, payloads, "\n".join(running), "\n".join(queue_keys)],
                                   client=self.redis)
        return {f.decode() if isinstance(f, bytes) else f for f in flagged}, bool(queued)


def encode_events(events: Sequence[StreamEvent | TokenEvent]) -> tuple[str, str]:
    """A step's events as the step script takes them: the events' job ids and
    their JSON, each joined by newlines."""
    return "\n".join(e.job_id for e in events), "\n".join(event_json(e) for e in events)


def event_json(event: StreamEvent | TokenEvent) -> str:
    """An event as ``StreamEvent.model_dump_json(exclude_none=True)`` spells it.

    A plain token event (no logprobs: nearly every event of a decode step) is
    formatted directly: building and dumping a validated StreamEvent per event
    took ~4 us, 0.25 ms a step at B=64, on the outbox thread, which holds the GIL
    for it while the engine's thread waits to build the next step. The stdlib's C
    string encoder escapes as pydantic does (tests/test_publisher.py).
    """
    if isinstance(event, TokenEvent):
        if event.logprobs is None:
            return (f'{{"job_id":{_json_string(event.job_id)},"seq":{event.seq:d},"type":"token",'
                    f'"text":{_json_string(event.text)},"token_ids":[{",".join(map(str, event.token_ids))}]}}')
        event = event.stream_event()
    return event.model_dump_json(exclude_none=True)
