"""Requeue jobs whose worker died (SIGKILL, crash, lost machine).

Every kiviq worker keeps a short-TTL liveness key while it runs. A job in a
StartedJobRegistry whose worker has no liveness key is an orphan: it goes
back to the front of its queue (its stream then restarts cleanly, see
BatchWorker) until it has been attempted ``max_attempts`` times, then fails.
"""

from __future__ import annotations

import logging
import os

from redis import Redis
from rq import Queue
from rq.exceptions import NoSuchJobError
from rq.job import Job, JobStatus

from jobs.keys import alive_key
from jobs.models import EventType, FinishReason, StreamEvent
from jobs.publisher import EventPublisher

log = logging.getLogger("kiviq.worker")

# A worker refreshes its key every few seconds between steps; a step longer
# than this TTL would let another worker requeue its jobs, so keep it well
# above the longest step. Tests shorten it to see recovery quickly.
ALIVE_TTL_S = float(os.environ.get("KIVIQ_ALIVE_TTL_S", "60"))


def mark_alive(conn: Redis, worker_name: str) -> None:
    conn.set(alive_key(worker_name), 1, px=int(ALIVE_TTL_S * 1000))


def mark_dead(conn: Redis, worker_name: str) -> None:
    conn.delete(alive_key(worker_name))


def requeue_orphans(conn: Redis, queues: list[Queue], *, max_attempts: int) -> list[str]:
    """Requeue (or fail, past ``max_attempts``) started jobs of dead workers.

    Returns:
        The ids of the jobs handled.
    """
    handled = []
    for queue in queues:
        registry = queue.started_job_registry
        for job_id in registry.get_job_ids(cleanup=False):
            try:
                job = Job.fetch(job_id, connection=conn, serializer=queue.serializer)
            except NoSuchJobError:
                continue
            if job.get_status(refresh=False) != JobStatus.STARTED:
                continue
            if job.worker_name and conn.exists(alive_key(job.worker_name)):
                continue
            attempts = int(job.meta.get("kiviq_attempts", 1))
            with conn.pipeline() as pipe:
                registry.remove_executions(job, pipeline=pipe)
                if attempts >= max_attempts:
                    message = f"worker {job.worker_name} died while running this job ({attempts} attempts)"
                    queue.failed_job_registry.add(job, exc_string=message, pipeline=pipe)
                    job.set_status(JobStatus.FAILED, pipeline=pipe)
                    pipe.execute()
                    publisher = EventPublisher(conn)
                    publisher.publish([StreamEvent(job_id=job.id, seq=publisher.next_seq(job.id),
                                                   type=EventType.error, finish_reason=FinishReason.error,
                                                   error=message)])
                    log.warning("job %s failed: %s", job.id, message)
                else:
                    job.meta["kiviq_attempts"] = attempts + 1
                    job.save_meta()
                    pipe.execute()
                    queue._enqueue_job(job, at_front=True)
                    log.warning("job %s requeued: worker %s is gone (attempt %d of %d)",
                                job.id, job.worker_name, attempts + 1, max_attempts)
            handled.append(job.id)
    return handled
