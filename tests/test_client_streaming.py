"""Stream reading: replay log + pub/sub, late subscribers, restarts (fakeredis)."""

from __future__ import annotations

import threading
import time

import fakeredis
import pytest

from kiviq.client.streaming import JobFailed, iter_events, iter_text
from kiviq.jobs.models import EventType, StreamEvent
from kiviq.jobs.publisher import EventPublisher


def ev(seq, type_="token", text="", **kw):
    return StreamEvent(job_id="j1", seq=seq, type=EventType(type_), text=text, **kw)


@pytest.fixture
def fake():
    return fakeredis.FakeRedis()


def test_late_subscriber_reads_everything_from_the_log(fake):
    pub = EventPublisher(fake)
    pub.publish([ev(0, text="Hel"), ev(1, text="lo")])
    pub.publish([ev(2, "done", finish_reason="stop")])
    events = list(iter_events(fake, "j1", timeout=5))
    assert [e.seq for e in events] == [0, 1, 2]
    assert "".join(iter_text(iter(events))) == "Hello"


def test_live_events_arrive_in_order_exactly_once(fake):
    pub = EventPublisher(fake)
    pub.publish([ev(0, text="a")])

    def produce():
        for i in range(1, 20):
            time.sleep(0.005)
            pub.publish([ev(i, text=chr(ord("a") + i))])
        pub.publish([ev(20, "done", finish_reason="length")])

    t = threading.Thread(target=produce)
    t.start()
    events = list(iter_events(fake, "j1", timeout=10))
    t.join()
    assert [e.seq for e in events] == list(range(21))
    assert pub.next_seq("j1") == 21


def counted_lrange(monkeypatch, conn) -> list[int]:
    """Record the start index of every LRANGE the reader makes."""
    calls, real = [], conn.lrange
    monkeypatch.setattr(conn, "lrange", lambda key, start, end: calls.append(start) or real(key, start, end))
    return calls


def test_live_events_come_from_the_channel_not_the_log(fake, monkeypatch):
    """Once the reader has read the log it takes each event from its channel
    message: one read per event, not a log read as well."""
    pub = EventPublisher(fake)
    pub.publish([ev(0, text="a")])
    reads = counted_lrange(monkeypatch, fake)
    it = iter_events(fake, "j1", timeout=5)
    assert next(it).seq == 0
    for i in range(1, 21):
        pub.publish([ev(i, text="b")])
        assert next(it).seq == i
    pub.publish([ev(21, "done", finish_reason="length")])
    assert next(it).type == EventType.done
    assert list(it) == []
    assert len(reads) <= 3, reads  # at the start, and at most once more (the subscribe confirmation)


def test_a_missed_message_sends_the_reader_to_the_log(fake, monkeypatch):
    """A message that skips a seq means the reader missed one: it reads the log
    from the seq it expects, and a message it already has is dropped."""
    from kiviq.jobs.keys import replay_log

    pub = EventPublisher(fake)
    pub.publish([ev(0, text="a")])
    reads = counted_lrange(monkeypatch, fake)
    it = iter_events(fake, "j1", timeout=5)
    assert next(it).text == "a"
    pub.publish([ev(1, text="b")])
    assert next(it).text == "b"
    fake.rpush(replay_log("j1"), ev(2, text="c").model_dump_json())  # logged, its message lost
    pub.publish([ev(3, text="d")])
    pub.publish([ev(4, "done", finish_reason="stop")])
    rest = list(it)
    assert [(e.seq, e.text) for e in rest] == [(2, "c"), (3, "d"), (4, "")]
    assert 2 in reads  # the log read from the missing seq


def test_restart_does_not_duplicate_text():
    events = [ev(0, text="The "), ev(1, text="sky"), ev(2, "restarted"), ev(3, text="The "),
              ev(4, text="sky"), ev(5, text=" is"), ev(6, "done", finish_reason="stop")]
    assert list(iter_text(iter(events))) == ["The ", "sky", " is"]


def test_error_event_raises_with_reason():
    with pytest.raises(JobFailed, match="boom"):
        list(iter_text(iter([ev(0, text="x"), ev(1, "error", error="boom")])))


def test_timeout_without_terminal_event(fake):
    EventPublisher(fake).publish([ev(0, text="x")])
    with pytest.raises(TimeoutError):
        list(iter_events(fake, "j1", timeout=0.3))


def test_one_publish_call_logs_caps_and_publishes_every_job_in_order(redis_conn, monkeypatch):
    """The publisher's one script call per step, on a real server: each job's events
    in its log and on its channel in order, every log capped and given a TTL."""
    import kiviq.jobs.publisher as publisher
    from kiviq.jobs.keys import event_channel, replay_log

    monkeypatch.setattr(publisher, "REPLAY_MAX_EVENTS", 5)
    listener = redis_conn.pubsub()
    listener.subscribe(event_channel("a"), event_channel("b"))
    while listener.get_message(timeout=0.5) is not None:  # the two subscribe confirmations
        pass
    pub = EventPublisher(redis_conn)

    def event(job, seq):
        return StreamEvent(job_id=job, seq=seq, type=EventType.token, text=f"{job}{seq}")
    for step in range(4):  # two jobs, two events each per call, interleaved
        pub.publish([event("a", 2 * step), event("b", 2 * step), event("a", 2 * step + 1),
                     event("b", 2 * step + 1)])
    for job in ("a", "b"):
        logged = [StreamEvent.model_validate_json(x).seq for x in redis_conn.lrange(replay_log(job), 0, -1)]
        assert logged == [3, 4, 5, 6, 7]  # the last five of eight
        assert 0 < redis_conn.ttl(replay_log(job)) <= publisher.REPLAY_TTL_S
    heard: dict[str, list[int]] = {"a": [], "b": []}
    deadline = time.monotonic() + 5
    while sum(map(len, heard.values())) < 16 and time.monotonic() < deadline:
        m = listener.get_message(timeout=0.5)
        if m and m["type"] == "message":
            e = StreamEvent.model_validate_json(m["data"])
            heard[e.job_id].append(e.seq)
    listener.close()
    assert heard == {"a": list(range(8)), "b": list(range(8))}
