"""A burst of queued jobs admitted at once (``claims.claim_batch`` and the reads
of ``worker.admission``), and rq's heartbeats for every running job in one
transaction (``worker.heartbeats``), against a real Redis with a stand-in
engine: each job keeps its own outcome, in queue order."""

from __future__ import annotations

import time
from types import SimpleNamespace

from rq.job import Job, JobStatus
from rq.registry import FailedJobRegistry, StartedJobRegistry
from rq.serializers import JSONSerializer

from kiviq.client import Client
from kiviq.jobs.keys import cancel_flag, queue_name, replay_log
from kiviq.jobs.models import EventType, StreamEvent
from kiviq.worker import claims, service
from kiviq.worker.heartbeats import heartbeat_running


class ByteTokenizer:
    bos_token = None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode())


def stand_in_worker(conn, capacity: int = 16):
    """A BatchWorker whose engine only records what it is given."""
    added: list[str] = []
    engine = SimpleNamespace(capacity=capacity, tokenizer=ByteTokenizer(), num_active=0,
                             model=SimpleNamespace(args=SimpleNamespace(max_position_embeddings=4096)),
                             add=lambda request: added.append(request.request_id), abort=lambda request_id: True)
    worker = service.BatchWorker(engine, conn, max_active=capacity)
    worker.outbox = worker.new_outbox()
    return worker, added


def admit_burst(worker) -> None:
    """What the worker does after a step with free slots: its outbox asks whether jobs
    wait, then the worker claims a burst."""
    worker.outbox.put([], [], ask_queues=True)
    assert worker.outbox.wait_published(timeout=10)
    worker._admit(block=False)


def events_of(conn, job_id: str) -> list[StreamEvent]:
    return [StreamEvent.model_validate_json(e) for e in conn.lrange(replay_log(job_id), 0, -1)]


def test_a_burst_is_admitted_in_queue_order_and_each_bad_job_ends_alone(redis_url, redis_conn):
    client = Client(redis_url)
    ids = [client.submit(prompt=f"job {i}", max_tokens=4).job_id for i in range(7)]
    deleted, unreadable, cancelled, restarted, running = ids[1], ids[2], ids[3], ids[4], ids[5]
    redis_conn.delete(f"rq:job:{deleted}")
    redis_conn.hset(f"rq:job:{unreadable}", "created_at", "not a time")
    redis_conn.set(cancel_flag(cancelled), 1)
    redis_conn.rpush(replay_log(restarted), StreamEvent(job_id=restarted, seq=0, type=EventType.token,
                                                        text="x", token_ids=[1]).model_dump_json())
    worker, added = stand_in_worker(redis_conn)
    try:
        worker.active[running] = SimpleNamespace()  # already in the engine: its queued copy has nothing to do
        worker._admit(block=False)
        assert not added  # beside running jobs the queues are asked only once the outbox saw a job waiting
        admit_burst(worker)
        worker._flush_outbox()
        assert worker.outbox.wait_published(timeout=10)  # events published, then the endings recorded
    finally:
        worker.outbox.close()

    assert added == [ids[0], restarted, ids[6]]  # in queue order; the rest never reached the engine
    failed = FailedJobRegistry(queue_name("default"), connection=redis_conn, serializer=JSONSerializer).get_job_ids()
    assert unreadable in failed and events_of(redis_conn, unreadable)[-1].type == EventType.error
    assert cancelled not in worker.active
    assert Job.fetch(cancelled, connection=redis_conn, serializer=JSONSerializer).get_status() == JobStatus.CANCELED
    assert events_of(redis_conn, cancelled)[-1].finish_reason.value == "cancelled"
    assert worker.active[restarted].next_seq == 2  # seq 0 was in its stream; 1 is the restarted event
    assert [e.type for e in events_of(redis_conn, restarted)] == [EventType.token, EventType.restarted]
    for job_id in (ids[0], restarted, ids[6]):
        job = Job.fetch(job_id, connection=redis_conn, serializer=JSONSerializer)
        assert job.get_status() == JobStatus.STARTED
    assert claims.claimed(redis_conn, worker.name) == [ids[0], restarted, ids[6]]  # endings released theirs


def test_heartbeats_for_every_running_job_refresh_what_rqs_do_and_repair_the_same(redis_url, redis_conn):
    client = Client(redis_url)
    ids = [client.submit(prompt=f"job {i}", max_tokens=4).job_id for i in range(3)]
    worker, added = stand_in_worker(redis_conn)
    worker.register_birth()
    try:
        admit_burst(worker)
    finally:
        worker.outbox.close()
    assert added == ids
    running = [worker.active[job_id] for job_id in ids]
    before = {job_id: redis_conn.hget(f"rq:job:{job_id}", "last_heartbeat") for job_id in ids}
    registry = StartedJobRegistry(queue_name("default"), connection=redis_conn)
    scores_before = dict(redis_conn.zrange(registry.key, 0, -1, withscores=True))
    redis_conn.delete(f"rq:job:{ids[2]}")  # deleted while it runs (result_ttl=0, say)
    redis_conn.delete(worker.key)  # the worker's hash expired
    time.sleep(1.1)  # rq stamps whole seconds

    heartbeat_running(worker, running)

    for job_id in ids[:2]:
        assert redis_conn.hget(f"rq:job:{job_id}", "last_heartbeat") > before[job_id]
    assert not redis_conn.exists(f"rq:job:{ids[2]}")  # no stub hash left behind
    scores = dict(redis_conn.zrange(registry.key, 0, -1, withscores=True))
    assert scores.keys() == scores_before.keys() and all(scores[k] > scores_before[k] for k in scores)
    assert redis_conn.hget(worker.key, "birth") and redis_conn.hget(worker.key, "queues")  # whole again
    ttl = redis_conn.ttl(worker.key)
    assert worker.job_monitoring_interval < ttl <= worker.job_monitoring_interval + 60
    for active in running:
        assert 0 < redis_conn.ttl(active.execution.key)


def test_redis_gone_while_a_burst_is_started_starts_none_and_leaves_all_claimed(redis_url, redis_conn,
                                                                               monkeypatch):
    """rq's start bookkeeping for a burst is one transaction: if Redis goes away
    before it runs, no job is marked started or added to the engine, and every
    claim stays for recovery to requeue."""
    import pytest
    import redis

    client = Client(redis_url)
    ids = [client.submit(prompt=f"job {i}", max_tokens=4).job_id for i in range(3)]
    worker, added = stand_in_worker(redis_conn)

    def gone(*args, **kwargs):
        raise redis.exceptions.ConnectionError("gone")

    monkeypatch.setattr(worker, "set_state", gone)  # called last, inside the transaction
    try:
        with pytest.raises(redis.exceptions.ConnectionError):
            admit_burst(worker)
    finally:
        worker.outbox.close()
    assert added == [] and not worker.active
    assert claims.claimed(redis_conn, worker.name) == ids
    for job_id in ids:
        job = Job.fetch(job_id, connection=redis_conn, serializer=JSONSerializer)
        assert job.get_status() == JobStatus.QUEUED
        assert job_id not in job.started_job_registry.get_job_ids()


def test_a_burst_is_marked_started_as_rqs_own_two_calls_mark_each_job(redis_url, redis_conn):
    """``admission.start_jobs`` writes, for a burst in one transaction, what
    ``prepare_execution`` and ``prepare_job_execution`` write job by job; a job
    whose payload could not be read gets only the first (as before)."""
    from kiviq.worker import admission

    client = Client(redis_url)
    ids = [client.submit(prompt=f"job {i}", max_tokens=4).job_id for i in range(4)]
    worker, _ = stand_in_worker(redis_conn)
    worker.outbox.close()
    jobs = admission.fetch_jobs(redis_conn, ids, worker.job_class, worker.serializer)
    by_rq = [worker.prepare_execution(jobs[0]), worker.prepare_execution(jobs[1])]
    worker.prepare_job_execution(jobs[0])
    worker.set_state("idle")
    ours = admission.start_jobs(worker, jobs[2:], [True, False])
    assert worker.get_state() == "busy" and redis_conn.hget(worker.key, "state") == b"busy"
    skip = {"last_heartbeat", "started_at"}  # times

    def stored(job_id: str) -> dict:
        return {k: v for k, v in redis_conn.hgetall(f"rq:job:{job_id}").items() if k.decode() not in skip}

    assert stored(ids[2]) | {b"created_at": b"", b"enqueued_at": b"", b"description": b"", b"data": b""} == \
        stored(ids[0]) | {b"created_at": b"", b"enqueued_at": b"", b"description": b"", b"data": b""}
    assert stored(ids[2])[b"status"] == b"started" and stored(ids[2])[b"worker_name"] == worker.name.encode()
    assert stored(ids[3]).get(b"status") == stored(ids[1]).get(b"status") == b"queued"
    assert redis_conn.ttl(f"rq:job:{ids[2]}") == redis_conn.ttl(f"rq:job:{ids[0]}")
    started = set(jobs[0].started_job_registry.get_job_ids())
    assert set(ids) <= started
    for rq_made, made in zip(by_rq, ours):
        assert made.id in worker.executions and made.job_id in ids[2:]
        assert redis_conn.ttl(made.key) > 0 and redis_conn.ttl(rq_made.key) > 0
        assert redis_conn.smembers(made.worker_executions_key) == redis_conn.smembers(rq_made.worker_executions_key)


def test_a_burst_worker_serves_what_is_queued_and_takes_jobs_that_arrive_while_it_runs(redis_url, redis_conn):
    """``serve(burst=True)`` (``kiviq worker --burst``): the queued jobs, and one
    submitted while they run (free slots: the outbox's check after a step finds it),
    all end with their results recorded and claims released; then the worker exits."""
    from benchmarks.worker_loop import FreeEngine  # one token, " a", per running job per step

    client = Client(redis_url)
    first = [client.submit(prompt=f"job {i}", max_tokens=20) for i in range(2)]
    late, engine = [], FreeEngine(4, 0.0)
    free_step = engine.step

    def step():
        if engine.steps == 2:
            late.append(client.submit(prompt="late", max_tokens=5))
        return free_step()

    engine.step = step
    worker = service.BatchWorker(engine, redis_conn, max_active=4)
    assert worker.serve(burst=True, logging_level="WARNING") == 3
    for handle, n in [(first[0], 20), (first[1], 20), (late[0], 5)]:
        assert handle.result(timeout=10).text == " a" * n
        assert Job.fetch(handle.job_id, connection=redis_conn, serializer=JSONSerializer).get_status() == \
            JobStatus.FINISHED
    assert engine.steps < 20 + 5  # the late job ran beside the others
    assert claims.claimed(redis_conn, worker.name) == []


def test_the_command_listener_stops_within_its_poll(redis_conn):
    """Stopping the worker joins rq's command listener thread. Once rq's unsubscribe
    has emptied its subscriptions the thread waits for a new one without a read to
    wake it: it must wake on its own within the poll (rq's 60 s made a stopping
    worker wait out its teardown limit)."""
    worker, _ = stand_in_worker(redis_conn)
    try:
        worker.subscribe()
        time.sleep(0.2)
        worker.pubsub.unsubscribe()
        time.sleep(0.2)  # the listener reads the confirmation and waits for a subscription
        started = time.monotonic()
        worker.pubsub_thread.stop(timeout=10)
        assert not worker.pubsub_thread.is_alive()
        assert time.monotonic() - started < service.COMMAND_POLL_S + 1.0
    finally:
        worker.outbox.close()
        worker.pubsub.close()
