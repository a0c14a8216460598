"""Claims and recovery against a real Redis, without a model: a worker killed
at any point between taking a job and recording its end leaves the job to be
requeued (or failed) exactly once, and nothing else is touched."""

from __future__ import annotations

import json

import pytest
from rq import Queue, SimpleWorker
from rq.job import Job, JobStatus
from rq.serializers import JSONSerializer

from kiviq.client import Client
from kiviq.jobs.keys import alive_key, claim_key, queue_name, queue_names, recovery_lock_key, replay_log
from kiviq.worker import claims
from kiviq.worker.recovery import mark_alive, requeue_orphans

DEAD = "worker-that-was-killed"


def queues(conn) -> list[Queue]:
    return [Queue(n, connection=conn, serializer=JSONSerializer) for n in queue_names()]


def keys(conn) -> list[str]:
    return [q.key for q in queues(conn)]


def queued_ids(conn, priority: str = "default") -> list[str]:
    return Queue(queue_name(priority), connection=conn, serializer=JSONSerializer).get_job_ids()


def fetch(conn, job_id: str) -> Job:
    return Job.fetch(job_id, connection=conn, serializer=JSONSerializer)


def four_jobs(client: Client) -> tuple:
    """(low, first, second, high): submitted in that order, two of them to the default queue."""
    low = client.submit(prompt="low", max_tokens=1, priority="low")
    first = client.submit(prompt="a", max_tokens=1)
    second = client.submit(prompt="b", max_tokens=1)
    high = client.submit(prompt="high", max_tokens=1, priority="high")
    return low, first, second, high


def test_claim_takes_the_highest_priority_job_first_and_records_it(redis_url, redis_conn):
    client = Client(redis_url)
    low, first, second, high = four_jobs(client)
    order = [claims.claim_next(redis_conn, keys(redis_conn), DEAD)[1] for _ in range(4)]
    assert order == [high.job_id, first.job_id, second.job_id, low.job_id]
    assert claims.claim_next(redis_conn, keys(redis_conn), DEAD) is None
    assert claims.claimed(redis_conn, DEAD) == order  # every taken id is on the claim list
    assert client.queued() == 0
    claims.release(redis_conn, DEAD, first.job_id)
    assert claims.claimed(redis_conn, DEAD) == [high.job_id, second.job_id, low.job_id]


def test_claim_batch_takes_up_to_its_limit_in_priority_order_in_one_call(redis_url, redis_conn):
    client = Client(redis_url)
    low, first, second, high = four_jobs(client)
    taken = claims.claim_batch(redis_conn, keys(redis_conn), DEAD, 3)
    assert [job_id for _, job_id in taken] == [high.job_id, first.job_id, second.job_id]
    assert [key for key, _ in taken] == [queues(redis_conn)[0].key, queues(redis_conn)[1].key,
                                         queues(redis_conn)[1].key]
    assert claims.claimed(redis_conn, DEAD) == [high.job_id, first.job_id, second.job_id]
    assert claims.claim_batch(redis_conn, keys(redis_conn), DEAD, 5) == [(queues(redis_conn)[2].key, low.job_id)]
    assert claims.claim_batch(redis_conn, keys(redis_conn), DEAD, 5) == []
    assert client.queued() == 0 and len(claims.claimed(redis_conn, DEAD)) == 4


def test_wait_and_claim_returns_none_after_the_timeout(redis_conn):
    assert claims.wait_and_claim(redis_conn, keys(redis_conn), DEAD, timeout_s=0.1) is None


def test_killed_right_after_taking_a_job_it_goes_back_to_the_front(redis_url, redis_conn):
    """The gap rq's LPOP leaves open: the job is in no queue and no registry."""
    client = Client(redis_url)
    taken = client.submit(prompt="taken", max_tokens=1)
    waiting = client.submit(prompt="waiting", max_tokens=1)
    claims.claim_next(redis_conn, keys(redis_conn), DEAD)
    assert queued_ids(redis_conn) == [waiting.job_id]
    assert requeue_orphans(redis_conn, queues(redis_conn), max_attempts=3) == [taken.job_id]
    assert queued_ids(redis_conn) == [taken.job_id, waiting.job_id]
    assert fetch(redis_conn, taken.job_id).meta["kiviq_attempts"] == 2
    assert not redis_conn.exists(claim_key(DEAD))
    assert requeue_orphans(redis_conn, queues(redis_conn), max_attempts=3) == []  # exactly once


def test_killed_between_registering_and_starting_the_job_is_requeued(redis_url, redis_conn):
    """The job is in the started registry but its status is not STARTED yet,
    which a scan of started jobs alone would skip forever."""
    client = Client(redis_url)
    handle = client.submit(prompt="half started", max_tokens=1)
    key, job_id = claims.claim_next(redis_conn, keys(redis_conn), DEAD)
    queue = next(q for q in queues(redis_conn) if q.key == key)
    SimpleWorker(queues(redis_conn), name=DEAD, connection=redis_conn,
                 serializer=JSONSerializer).prepare_execution(fetch(redis_conn, job_id))
    assert job_id in queue.started_job_registry.get_job_ids()
    assert fetch(redis_conn, job_id).get_status() == JobStatus.QUEUED
    assert requeue_orphans(redis_conn, queues(redis_conn), max_attempts=3) == [handle.job_id]
    assert queued_ids(redis_conn) == [handle.job_id]
    assert job_id not in queue.started_job_registry.get_job_ids()
    assert fetch(redis_conn, job_id).get_status() == JobStatus.QUEUED


def test_a_job_whose_end_was_recorded_is_only_released(redis_url, redis_conn):
    client = Client(redis_url)
    handle = client.submit(prompt="done", max_tokens=1)
    claims.claim_next(redis_conn, keys(redis_conn), DEAD)
    fetch(redis_conn, handle.job_id).set_status(JobStatus.FINISHED)
    gone = client.submit(prompt="deleted", max_tokens=1)
    claims.claim_next(redis_conn, keys(redis_conn), DEAD)
    fetch(redis_conn, gone.job_id).delete()
    assert requeue_orphans(redis_conn, queues(redis_conn), max_attempts=3) == []
    assert queued_ids(redis_conn) == [] and not redis_conn.exists(claim_key(DEAD))


def test_live_workers_keep_the_claims_they_run(redis_url, redis_conn):
    client = Client(redis_url)
    running, lost = client.submit(prompt="running", max_tokens=1), client.submit(prompt="lost", max_tokens=1)
    claims.claim_next(redis_conn, keys(redis_conn), "alive-worker")
    claims.claim_next(redis_conn, keys(redis_conn), "alive-worker")
    mark_alive(redis_conn, "alive-worker")
    assert requeue_orphans(redis_conn, queues(redis_conn), max_attempts=3) == []  # another worker's view
    assert claims.claimed(redis_conn, "alive-worker") == [running.job_id, lost.job_id]
    # Its own view: a claim it does not run (its reply was lost, or an earlier
    # worker of that name left it) is an orphan.
    assert requeue_orphans(redis_conn, queues(redis_conn), max_attempts=3, own="alive-worker",
                           running={running.job_id}) == [lost.job_id]
    assert queued_ids(redis_conn) == [lost.job_id]
    assert claims.claimed(redis_conn, "alive-worker") == [running.job_id]


def test_past_max_attempts_the_job_fails_with_an_error_event(redis_url, redis_conn):
    handle = Client(redis_url).submit(prompt="poison", max_tokens=1)
    for attempt in (2, 3):
        claims.claim_next(redis_conn, keys(redis_conn), DEAD)
        requeue_orphans(redis_conn, queues(redis_conn), max_attempts=3)
        assert fetch(redis_conn, handle.job_id).meta["kiviq_attempts"] == attempt
    claims.claim_next(redis_conn, keys(redis_conn), DEAD)
    assert requeue_orphans(redis_conn, queues(redis_conn), max_attempts=3) == [handle.job_id]
    assert queued_ids(redis_conn) == []
    assert fetch(redis_conn, handle.job_id).get_status() == JobStatus.FAILED
    last = json.loads(redis_conn.lrange(replay_log(handle.job_id), -1, -1)[0])
    assert last["type"] == "error" and "3 attempts" in last["error"]
    with pytest.raises(RuntimeError, match="3 attempts"):
        handle.result(timeout=5)


def test_a_second_recovery_waits_for_the_first(redis_url, redis_conn):
    handle = Client(redis_url).submit(prompt="contended", max_tokens=1)
    claims.claim_next(redis_conn, keys(redis_conn), DEAD)
    redis_conn.set(recovery_lock_key(), 1, px=60_000)  # another worker is recovering
    assert requeue_orphans(redis_conn, queues(redis_conn), max_attempts=3) == []
    assert claims.claimed(redis_conn, DEAD) == [handle.job_id]
    redis_conn.delete(recovery_lock_key())
    assert requeue_orphans(redis_conn, queues(redis_conn), max_attempts=3) == [handle.job_id]
    assert not redis_conn.exists(alive_key(DEAD))


def test_a_job_already_back_in_its_queue_is_not_queued_twice(redis_url, redis_conn):
    """rq's own cleanup of abandoned jobs may requeue a dead worker's job first."""
    handle = Client(redis_url).submit(prompt="requeued by rq", max_tokens=1)
    key, job_id = claims.claim_next(redis_conn, keys(redis_conn), DEAD)
    queue = next(q for q in queues(redis_conn) if q.key == key)
    queue._enqueue_job(fetch(redis_conn, job_id), at_front=True)
    assert requeue_orphans(redis_conn, queues(redis_conn), max_attempts=3) == []
    assert queued_ids(redis_conn) == [handle.job_id]
    assert not redis_conn.exists(claim_key(DEAD))


def test_a_job_rq_failed_behind_our_back_gets_a_final_event(redis_url, redis_conn):
    """A job rq failed as abandoned has no final event yet; its client must not wait forever."""
    handle = Client(redis_url).submit(prompt="abandoned", max_tokens=1)
    claims.claim_next(redis_conn, keys(redis_conn), DEAD)
    janitor = SimpleWorker(queues(redis_conn), connection=redis_conn, serializer=JSONSerializer)
    janitor.handle_job_failure(fetch(redis_conn, handle.job_id), queues(redis_conn)[1],
                               exc_string="Traceback (most recent call last):\n"
                                          "rq.exceptions.AbandonedJobError: work-horse terminated")
    assert fetch(redis_conn, handle.job_id).get_status() == JobStatus.FAILED
    assert requeue_orphans(redis_conn, queues(redis_conn), max_attempts=3) == []
    with pytest.raises(RuntimeError, match="AbandonedJobError"):
        handle.result(timeout=5)
    requeue_orphans(redis_conn, queues(redis_conn), max_attempts=3, own=DEAD)
    assert redis_conn.llen(replay_log(handle.job_id)) == 1  # one final event, never two


def test_a_worker_with_free_slots_asks_the_queues_only_once_its_outbox_saw_a_job(redis_url, redis_conn,
                                                                                 monkeypatch):
    """Beside running jobs, an ask of the queues would be a round trip on the engine's
    thread: the worker claims only once the outbox's check after a step (off that
    thread) found a job waiting, and a check finds it whenever it is there."""
    from types import SimpleNamespace

    from kiviq.worker import service

    engine = SimpleNamespace(capacity=4, tokenizer=None, num_active=0,
                             model=SimpleNamespace(args=SimpleNamespace(max_position_embeddings=4096)))
    worker = service.BatchWorker(engine, redis_conn, max_active=4)
    worker.outbox = worker.new_outbox()
    asked, started = [], []
    real_claim = claims.claim_batch
    monkeypatch.setattr(claims, "claim_batch", lambda *a: asked.append(1) or real_claim(*a))
    monkeypatch.setattr(worker, "_start_claimed", lambda claimed: started.extend(job_id for _, job_id in claimed))
    try:
        worker.active["running"] = SimpleNamespace()

        def step() -> None:  # the put after a step, with free slots, and the outbox's check
            worker._flush_outbox(after_step=True)
            assert worker.outbox.wait_published(timeout=10)

        step()
        worker._admit(block=False)
        assert not asked  # the queues were empty at the check: not asked
        job_id = Client(redis_url).submit(prompt="hi", max_tokens=1).job_id
        worker._admit(block=False)
        assert not asked and not started  # not seen yet: a check runs after each step
        step()
        worker._admit(block=False)
        assert started == [job_id] and len(asked) == 1  # one ask took it; fewer than the free slots: no second
        worker._admit(block=False)
        assert len(asked) == 1
    finally:
        worker.active.clear()
        worker.outbox.close()
