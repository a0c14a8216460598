"""The worker's outbox thread: order, publication numbers, cancel flags, and a Redis
that is not there (worker/outbox.py). The whole worker through a Redis restart is
tests/test_reliability.py."""

from __future__ import annotations

import threading
import time

import pytest
import redis
from redis import Redis

from kiviq.client.local_redis import free_port
from kiviq.jobs.keys import cancel_flag, replay_log
from kiviq.jobs.models import EventType, StreamEvent, TokenEvent, TokenLogprob, TopLogprob
from kiviq.worker.outbox import Outbox


def token(job: str, seq: int) -> StreamEvent:
    return StreamEvent(job_id=job, seq=seq, type=EventType.token, text=f" t{seq}", token_ids=[seq])


def test_steps_are_published_in_order_and_numbered(redis_conn):
    timings = []
    outbox = Outbox(redis_conn, on_publish=timings.append)
    jobs = ["a", "b"]
    numbers = [outbox.put([token(j, step) for j in jobs], jobs) for step in range(5)]
    assert numbers == [1, 2, 3, 4, 5] and outbox.last_put == 5
    assert outbox.wait_published(timeout=10)
    assert outbox.published == 5
    for j in jobs:
        seqs = [StreamEvent.model_validate_json(e).seq for e in redis_conn.lrange(replay_log(j), 0, -1)]
        assert seqs == [0, 1, 2, 3, 4]
    assert len(timings) == 5 and all(t > 0 for t in timings)
    outbox.close()


def test_token_events_handed_over_as_tuples_reach_redis_as_their_stream_events(redis_conn):
    """The engine's thread puts a step's token events as ``TokenEvent`` tuples; what a
    client reads is the JSON of the same ``StreamEvent``, beside events put as models."""
    lp = [TokenLogprob(token="a", token_id=7, logprob=-0.5, top_logprobs=[TopLogprob(token="b", token_id=8, logprob=-1.0)])]
    tuples = [TokenEvent("a", 0, "Hel", [1, 2]), TokenEvent("a", 1, "lo\n\"x\"", [3], lp)]
    models = [StreamEvent(job_id="a", seq=0, type=EventType.token, text="Hel", token_ids=[1, 2]),
              StreamEvent(job_id="a", seq=1, type=EventType.token, text="lo\n\"x\"", token_ids=[3], logprobs=lp)]
    done = StreamEvent(job_id="a", seq=2, type=EventType.done, finish_reason="stop")
    outbox = Outbox(redis_conn)
    outbox.put([*tuples, done], ["a"])
    assert outbox.wait_published(timeout=10)
    outbox.close()
    stored = redis_conn.lrange(replay_log("a"), 0, -1)
    assert stored == [e.model_dump_json(exclude_none=True).encode() for e in [*models, done]]


def test_cancel_flags_of_running_jobs_are_reported_once(redis_conn):
    outbox = Outbox(redis_conn)
    outbox.put([], ["a", "b", "c"])
    outbox.wait_published(timeout=10)
    assert outbox.take_cancels() == set()
    redis_conn.set(cancel_flag("b"), 1)
    outbox.put([token("a", 0)], ["a", "b"])
    outbox.put([], ["a"])  # "c" ended and "b"'s flag is not asked about again: no duplicate
    outbox.wait_published(timeout=10)
    assert outbox.take_cancels() == {"b"}
    assert outbox.take_cancels() == set()
    outbox.close()


def test_redis_away_blocks_the_engine_after_two_steps_and_shutdown_says_so():
    port = free_port()
    conn = Redis(host="127.0.0.1", port=port, socket_connect_timeout=0.2, socket_timeout=0.2)
    outbox = Outbox(conn, max_pending=2)
    outbox.put([token("a", 0)], ["a"])
    outbox.put([token("a", 1)], ["a"])
    third = threading.Thread(target=outbox.put, args=([token("a", 2)], ["a"]), daemon=True)
    third.start()
    time.sleep(0.5)
    assert third.is_alive()  # the engine's thread waits: two steps are unpublished
    assert outbox.published == 0
    with pytest.raises((redis.exceptions.ConnectionError, redis.exceptions.TimeoutError)):
        outbox.close(timeout=0.5)  # shutdown with Redis away says so instead of dropping quietly


def test_redis_coming_back_gets_every_step_in_order(redis_conn):
    """A server that refuses, then answers (a stand-in that fails its first calls):
    the outbox retries the same step and publishes each step once."""
    failures = {"left": 2}
    real = redis_conn.execute_command

    def flaky(*args, **kwargs):
        if failures["left"] > 0:
            failures["left"] -= 1
            raise redis.exceptions.ConnectionError("server restarting")
        return real(*args, **kwargs)

    redis_conn.execute_command = flaky
    outbox = Outbox(redis_conn)
    for step in range(3):
        outbox.put([token("a", step)], ["a"])
    assert outbox.wait_published(timeout=20)
    seqs = [StreamEvent.model_validate_json(e).seq for e in redis_conn.lrange(replay_log("a"), 0, -1)]
    assert seqs == [0, 1, 2]
    outbox.close()


def test_endings_run_after_their_events_are_published_in_order_each_once(redis_conn):
    """A put's endings (a job's rq bookkeeping) run on the outbox's thread once its
    events are in Redis; one whose Redis call fails is retried, and the endings
    before it are not run again."""
    seen, failures = [], {"left": 2}

    def ending(name: str, flaky: bool = False):
        def run() -> None:
            assert redis_conn.llen(replay_log("a")) == 2  # the put's events are published first
            if flaky and failures["left"] > 0:
                failures["left"] -= 1
                raise redis.exceptions.ConnectionError("server restarting")
            seen.append(name)
        return run

    outbox = Outbox(redis_conn)
    outbox.put([token("a", 0), token("a", 1)], ["a"], [("a", ending("first")), ("b", ending("second", flaky=True)),
                                                         ("c", ending("third"))])
    assert outbox.wait_published(timeout=20)
    assert seen == ["first", "second", "third"] and failures["left"] == 0
    assert outbox.pending_endings() == set()
    outbox.close()


def test_pending_endings_name_the_jobs_whose_ending_is_not_recorded(redis_conn):
    release = threading.Event()
    outbox = Outbox(redis_conn)
    outbox.put([token("a", 0)], ["a"], [("a", lambda: release.wait(10))])
    outbox.put([], [], [("b", lambda: None)])
    assert outbox.pending_endings() == {"a", "b"}  # a running worker's recovery must not requeue them
    release.set()
    assert outbox.wait_published(timeout=10)
    assert outbox.pending_endings() == set()
    outbox.close()


def test_a_put_that_asks_the_queues_reports_a_waiting_job_once(redis_conn):
    outbox = Outbox(redis_conn, queue_keys=["rq:queue:x", "rq:queue:y"])
    outbox.put([], ["a"], ask_queues=True)
    outbox.wait_published(timeout=10)
    assert outbox.take_queued() is False
    redis_conn.rpush("rq:queue:y", "job-1")
    outbox.put([], ["a"])  # not asked: nothing reported
    outbox.wait_published(timeout=10)
    assert outbox.take_queued() is False
    outbox.put([], [], ask_queues=True)
    outbox.wait_published(timeout=10)
    assert outbox.take_queued() is True
    assert outbox.take_queued() is False
    outbox.close()
