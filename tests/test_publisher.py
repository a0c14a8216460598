"""A step's events as the publish script takes them (jobs/publisher.py): a plain
token event is formatted without pydantic and must come out byte for byte as
pydantic spells its StreamEvent. The step's one script call, on a real Redis server:
events logged and published, cancel flags and queues read."""

from __future__ import annotations

import pytest

from kiviq.jobs.keys import cancel_flag, event_channel, replay_log
from kiviq.jobs.models import EventType, StreamEvent, TokenEvent, TokenLogprob
from kiviq.jobs.publisher import EventPublisher, encode_events, event_json

# Every ASCII character (control characters, quotes, backslash, DEL) and
# non-ASCII text of each UTF-8 length, the replacement character, the line and
# paragraph separators, and an empty text.
TEXTS = ["".join(map(chr, range(128))), " héllo wörld", "日本語", "🙂 ok", "\ufffd", "\u2028\u2029", "", "\\n", "a\"b"]


@pytest.mark.parametrize("text", TEXTS)
def test_a_token_event_is_spelled_as_pydantic_spells_its_stream_event(text):
    event = TokenEvent(f"job-{text[:3]!r}", 12, text, [0, 5, 151_935])
    assert event_json(event) == event.stream_event().model_dump_json(exclude_none=True)
    assert StreamEvent.model_validate_json(event_json(event)) == event.stream_event()


def test_events_with_logprobs_and_stream_events_go_through_pydantic():
    lp = [TokenLogprob(token="a", token_id=7, logprob=-0.5)]
    with_logprobs = TokenEvent("a", 1, "x", [7], lp)
    done = StreamEvent(job_id="a", seq=2, type=EventType.done, finish_reason="stop")
    assert event_json(with_logprobs) == with_logprobs.stream_event().model_dump_json(exclude_none=True)
    assert event_json(done) == done.model_dump_json(exclude_none=True)


def test_a_step_is_one_line_per_event_in_order():
    events = [TokenEvent("a", 0, "line\nbreak", [1]), TokenEvent("b", 3, "", []),
              StreamEvent(job_id="a", seq=1, type=EventType.done, finish_reason="length")]
    ids, payloads = encode_events(events)
    assert ids.split("\n") == ["a", "b", "a"]
    assert [StreamEvent.model_validate_json(p).seq for p in payloads.split("\n")] == [0, 3, 1]


def test_the_step_call_publishes_then_reports_cancel_flags_and_queued_jobs(redis_conn):
    listener = redis_conn.pubsub()
    listener.subscribe(event_channel("a"))
    while listener.get_message(timeout=0.5) is not None:  # the subscribe confirmation
        pass
    pub = EventPublisher(redis_conn)
    assert pub.publish_and_check([], [], []) == (set(), False)  # nothing asked: no round trip needed
    redis_conn.set(cancel_flag("b"), 1)
    redis_conn.set(cancel_flag("gone"), 1)  # not running: not reported
    events = [TokenEvent("a", 0, "x", [1]), TokenEvent("a", 1, "y", [2])]
    assert pub.publish_and_check(events, ["a", "b", "c"], ["rq:queue:empty"]) == ({"b"}, False)
    assert [StreamEvent.model_validate_json(x).text for x in redis_conn.lrange(replay_log("a"), 0, -1)] == ["x", "y"]
    live = [listener.get_message(timeout=1.0) for _ in range(2)]
    assert [StreamEvent.model_validate_json(m["data"]).seq for m in live] == [0, 1]
    redis_conn.rpush("rq:queue:full", "job")
    assert pub.publish_and_check([], ["a"], ["rq:queue:empty", "rq:queue:full"]) == (set(), True)
    assert pub.publish_and_check([], [], ["rq:queue:empty"]) == (set(), False)
    assert redis_conn.llen(replay_log("a")) == 2  # the checks wrote nothing
    listener.close()
