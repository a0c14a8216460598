"""Requeue jobs whose worker died (SIGKILL, crash, lost machine).

Every kiviq worker keeps a short-TTL liveness key while it runs, and a claim
list of the jobs it holds (worker.claims). A claimed job whose worker has no
liveness key is an orphan, whether the worker died while running it or in
the moment between taking it and marking it started: it goes back to the
front of its queue (its stream then restarts cleanly, see BatchWorker) until
it has been attempted ``max_attempts`` times, then fails.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Collection

from redis import Redis
from rq import Queue
from rq.exceptions import NoSuchJobError
from rq.job import Job, JobStatus
from rq.serializers import JSONSerializer

from kiviq.jobs.keys import alive_key, recovery_lock_key, replay_log
from kiviq.jobs.models import EventType, FinishReason, StreamEvent
from kiviq.jobs.publisher import EventPublisher
from kiviq.worker.claims import claimants, claimed, release

log = logging.getLogger("kiviq.worker")

# A worker refreshes its key every few seconds between steps; a step longer
# than this TTL would let another worker requeue its jobs, so keep it well
# above the longest step. Tests shorten it to see recovery quickly.
ALIVE_TTL_S = float(os.environ.get("KIVIQ_ALIVE_TTL_S", "60"))
# Outlives any recovery pass; a holder that dies frees it by expiry.
RECOVERY_LOCK_MS = 30_000
ENDED = (JobStatus.FINISHED, JobStatus.FAILED, JobStatus.CANCELED, JobStatus.STOPPED)


def mark_alive(conn: Redis, worker_name: str) -> None:
    conn.set(alive_key(worker_name), 1, px=int(ALIVE_TTL_S * 1000))


def mark_dead(conn: Redis, worker_name: str) -> None:
    conn.delete(alive_key(worker_name))


def requeue_orphans(conn: Redis, queues: list[Queue], *, max_attempts: int, own: str | None = None,
                    running: Collection[str] = (), wait_s: float = 0.0) -> list[str]:
    """Requeue (or fail, past ``max_attempts``) the unfinished jobs of dead workers.

    A worker is dead when its liveness key is gone; its claim list (see
    worker.claims) names every job it took and did not give back.

    Args:
        conn: Redis connection.
        queues: the queues jobs come from (others are opened by name).
        max_attempts: runs of a job before a dead worker fails it for good.
        own: the calling worker's name. Its claims of jobs not in ``running``
            are orphans too, although it is alive: left by an earlier worker
            that used the same name, or a claim whose reply a dropped
            connection lost.
        running: the jobs the calling worker holds (in its engine, or with
            an ending still to record).
        wait_s: how long to wait while another worker is recovering (0:
            skip this pass; the next one will look again).

    Returns:
        The ids of the jobs requeued or failed.
    """
    # Two workers recovering the same claim list would requeue its jobs twice.
    deadline = time.monotonic() + wait_s
    while not conn.set(recovery_lock_key(), 1, nx=True, px=RECOVERY_LOCK_MS):
        if time.monotonic() >= deadline:
            return []
        time.sleep(0.05)
    try:
        by_name = {q.name: q for q in queues}
        handled = []
        for worker_name in claimants(conn):
            mine = worker_name == own
            if not mine and conn.exists(alive_key(worker_name)):
                continue
            for job_id in claimed(conn, worker_name):
                if mine and job_id in running:
                    continue
                if _recover(conn, by_name, worker_name, job_id, max_attempts):
                    handled.append(job_id)
        return handled
    finally:
        conn.delete(recovery_lock_key())


def _recover(conn: Redis, by_name: dict[str, Queue], worker_name: str, job_id: str, max_attempts: int) -> bool:
    """Give one claimed job of a dead worker back to its queue, or fail it.

    Returns:
        Whether the job was requeued or failed (False: it had already ended,
        or no longer exists, and only its claim was left).
    """
    try:
        job = Job.fetch(job_id, connection=conn, serializer=JSONSerializer)
    except NoSuchJobError:
        release(conn, worker_name, job_id)
        return False
    queue = by_name.get(job.origin) or Queue(job.origin, connection=conn, serializer=JSONSerializer)
    status = job.get_status(refresh=False)
    if status in ENDED or _is_queued(conn, queue, job_id):
        # Recorded in rq, or already back in its queue (rq's own cleanup of
        # abandoned jobs can get there first): only the release was lost.
        if status == JobStatus.FAILED:
            result = job.latest_result()
            _end_stream(conn, job, (result and result.exc_string) or f"worker {worker_name} died running this job")
        release(conn, worker_name, job_id)
        return False
    attempts = int(job.meta.get("kiviq_attempts", 1))
    with conn.pipeline() as pipe:  # MULTI: requeued (or failed) and released together
        queue.started_job_registry.remove_executions(job, pipeline=pipe)
        release(pipe, worker_name, job_id)
        if attempts >= max_attempts:
            message = f"worker {worker_name} died while running this job ({attempts} attempts)"
            queue.failed_job_registry.add(job, exc_string=message, pipeline=pipe)
            job.set_status(JobStatus.FAILED, pipeline=pipe)
            pipe.execute()
            _end_stream(conn, job, message)
            log.warning("job %s failed: %s", job.id, message)
        else:
            job.meta["kiviq_attempts"] = attempts + 1  # saved with the job by the enqueue
            queue._enqueue_job(job, pipeline=pipe, at_front=True)
            pipe.execute()
            log.warning("job %s requeued: worker %s is gone (attempt %d of %d)",
                        job.id, worker_name, attempts + 1, max_attempts)
    return True


def _is_queued(conn: Redis, queue: Queue, job_id: str) -> bool:
    return conn.lpos(queue.key, job_id) is not None


def _end_stream(conn: Redis, job: Job, message: str) -> None:
    """Publish an error event for a failed job whose stream has no final event
    (clients wait for one); a stream that already ended is left alone."""
    last = conn.lrange(replay_log(job.id), -1, -1)
    if last and StreamEvent.model_validate_json(last[0]).type in (EventType.done, EventType.error):
        return
    publisher = EventPublisher(conn)
    publisher.publish([StreamEvent(job_id=job.id, seq=publisher.next_seq(job.id), type=EventType.error,
                                   finish_reason=FinishReason.error, error=message.strip().splitlines()[-1])])
