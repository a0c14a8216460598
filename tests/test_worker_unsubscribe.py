"""The worker's shutdown leaves rq's command channel without waiting for the
listener thread (worker.service.BatchWorker.unsubscribe), against a real Redis."""

from __future__ import annotations

import time
from types import SimpleNamespace

from kiviq.worker.service import BatchWorker


def test_unsubscribe_returns_while_the_listener_waits(redis_conn):
    pubsub = redis_conn.pubsub()
    pubsub.subscribe(**{"rq:pubsub:kiviq-test": lambda message: None})
    errors = []
    # rq's own listener: a daemon thread, a 60 s poll.
    thread = pubsub.run_in_thread(sleep_time=60, daemon=True, exception_handler=lambda e, *_: errors.append(e))
    time.sleep(0.3)  # the listener is inside its 60 s wait
    worker = SimpleNamespace(pubsub=pubsub, pubsub_thread=thread, connection=redis_conn,
                             pubsub_channel_name="rq:pubsub:kiviq-test")
    started = time.monotonic()
    BatchWorker.unsubscribe(worker)
    assert time.monotonic() - started < 5
    thread.join(timeout=5)
    assert not thread.is_alive() and errors == []
    # The listener closed its connection: the subscription is gone on the server.
    deadline = time.monotonic() + 5
    while redis_conn.pubsub_numsub("rq:pubsub:kiviq-test")[0][1] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert redis_conn.pubsub_numsub("rq:pubsub:kiviq-test")[0][1] == 0
    BatchWorker.unsubscribe(SimpleNamespace(pubsub_thread=None))  # never subscribed: nothing to do
