"""What the worker reads about a burst of claimed jobs before it starts them,
in a fixed number of round trips however many there are.

Admitted one by one, a job costs seven Redis round trips (claim, the job's
hash, its stream's length and last event, its cancel flag, rq's two
bookkeeping writes) on the engine's thread before the first step: 64 queued
jobs take 66-104 ms that way on the CPU machine, 22-33 ms in one burst
(benchmarks/worker_loop.py, "ms until the first step"). The claims come in
one call (``claims.claim_batch``), the reads here in one pipeline each, and
rq's two writes for each job in one transaction for all (``start_jobs``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from redis import Redis
from rq import Queue
from rq.defaults import DEFAULT_FAILURE_TTL
from rq.exceptions import DeserializationError
from rq.executions import Execution
from rq.job import Job, JobStatus
from rq.utils import current_timestamp, now
from rq.worker import WorkerStatus

from kiviq.jobs.keys import TASK_PATH, cancel_flag, replay_log
from kiviq.jobs.models import EventType, FinishReason, StreamEvent
from kiviq.jobs.publisher import EventPublisher
from kiviq.worker import claims


@dataclass(frozen=True)
class StreamState:
    """A claimed job's stream as the worker finds it."""

    next_seq: int  # the sequence number its next event gets (non-zero after a restart)
    last_event: bytes | None  # its replay log's last event (JSON), if any
    cancel_requested: bool  # a client set its cancel flag


def fetch_jobs(conn: Redis, job_ids: list[str], job_class: type[Job], serializer) -> list[Job | Exception | None]:
    """``Job.fetch`` for every id in one pipeline: each a Job, None where the
    job was deleted, or the exception its stored data raised when read (a
    job whose hash cannot be loaded fails alone)."""
    with conn.pipeline(transaction=False) as pipe:
        for job_id in job_ids:
            pipe.hgetall(job_class.key_for(job_id))
        stored = pipe.execute()
    jobs: list[Job | Exception | None] = []
    for job_id, data in zip(job_ids, stored):
        if not data:
            jobs.append(None)
            continue
        job = job_class(job_id, connection=conn, serializer=serializer)
        try:
            job.restore(data)
        except Exception as e:  # noqa: BLE001 - reported as this job's failure
            jobs.append(e)
            continue
        jobs.append(job)
    return jobs


def stream_states(conn: Redis, job_ids: list[str]) -> list[StreamState]:
    """Every job's stream length, last event and cancel flag, in one pipeline."""
    with conn.pipeline(transaction=False) as pipe:
        for job_id in job_ids:
            pipe.llen(replay_log(job_id))
            pipe.lrange(replay_log(job_id), -1, -1)
            pipe.exists(cancel_flag(job_id))
        replies = pipe.execute()
    return [StreamState(next_seq=int(replies[i]), last_event=replies[i + 1][0] if replies[i + 1] else None,
                        cancel_requested=bool(replies[i + 2])) for i in range(0, len(replies), 3)]


def start_jobs(worker, jobs: list[Job], ready: list[bool]) -> list[Execution]:
    """Mark a burst of claimed jobs started in rq, in one transaction: for each, what
    ``worker.prepare_execution(job)`` writes (its Execution, the started registry, the
    worker busy) and, where ``ready`` (its payload could be read), what
    ``worker.prepare_job_execution(job)`` adds (heartbeats; the job's hash marked
    started, without its TTL). Job by job that is two round trips each, ~0.55 ms a
    job on the CPU machine, all before the burst's first step. Returns the executions."""
    executions = []
    with worker.connection.pipeline() as pipe:
        for job, prepare in zip(jobs, ready):
            ttl = worker.get_heartbeat_ttl(job)
            execution = Execution.create(job, ttl, pipeline=pipe, worker_name=worker.name)
            worker.executions[execution.id] = execution
            executions.append(execution)
            if prepare:
                worker.heartbeat(ttl, pipeline=pipe)
                job.heartbeat(now(), ttl, pipeline=pipe)
                job.prepare_for_execution(worker.name, pipeline=pipe)
                pipe.persist(job.key)
        if jobs:
            worker.set_state(WorkerStatus.BUSY, pipeline=pipe)
        pipe.execute()
    return executions


def payload_or_error(job: Job) -> Any:
    """``job_payload(job)``, or the exception it raised (the job then fails alone)."""
    try:
        return job_payload(job)
    except Exception as e:  # noqa: BLE001 - reported as this job's failure
        return e


def job_payload(job: Job) -> Any:
    """The request dict of a kiviq job; anything else is malformed."""
    try:
        job.func_name
    except DeserializationError as e:
        raise ValueError(f"job data is not valid serialized JSON ({e.__cause__ or e})") from None
    if job.func_name != TASK_PATH:
        raise ValueError(f"job function must be {TASK_PATH!r}, got {job.func_name!r}")
    if len(job.args) != 1 or job.kwargs:
        raise ValueError("a kiviq job takes exactly one positional argument: the request object")
    return job.args[0]


def fail_unreadable(conn: Redis, publisher: EventPublisher, worker_name: str, job_id: str, queue: Queue,
                    stream: StreamState, message: str) -> None:
    """Fail a claimed job whose stored data could not be loaded: rq's failed
    registry and status, its claim released, an error event on its stream."""
    job_key = Job.key_for(job_id)
    with conn.pipeline() as pipe:
        # What FailedJobRegistry.add writes, less its job.save: a Job that could not be loaded cannot be saved.
        pipe.zadd(queue.failed_job_registry.key, {job_id: current_timestamp() + DEFAULT_FAILURE_TTL})
        pipe.hset(job_key, mapping={"status": JobStatus.FAILED.value, "exc_info": message})
        pipe.expire(job_key, DEFAULT_FAILURE_TTL)
        claims.release(pipe, worker_name, job_id)
        pipe.execute()
    publisher.publish([StreamEvent(job_id=job_id, seq=stream.next_seq, type=EventType.error,
                                   finish_reason=FinishReason.error, error=message)])
