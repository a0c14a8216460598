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


def test_redis_gone_midway_through_a_burst_leaves_no_started_job_out_of_the_engine(redis_url, redis_conn,
                                                                                  monkeypatch):
    import pytest
    import redis

    client = Client(redis_url)
    ids = [client.submit(prompt=f"job {i}", max_tokens=4).job_id for i in range(3)]
    worker, added = stand_in_worker(redis_conn)
    real_prepare = worker.prepare_execution

    def prepare(job):
        if job.id == ids[1]:
            raise redis.exceptions.ConnectionError("gone")
        return real_prepare(job)

    monkeypatch.setattr(worker, "prepare_execution", prepare)
    try:
        with pytest.raises(redis.exceptions.ConnectionError):
            admit_burst(worker)
    finally:
        worker.outbox.close()
    assert added == [ids[0]] and list(worker.active) == [ids[0]]  # started, so in the engine
    assert claims.claimed(redis_conn, worker.name) == ids  # the other two stay claimed: recovery requeues them



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
