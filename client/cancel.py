"""Cancel a job wherever it is: still queued (the client removes it), or
running (the worker stops it at its next decode step)."""

from __future__ import annotations

from redis import Redis
from rq import Queue
from rq.exceptions import NoSuchJobError
from rq.job import Job, JobStatus
from rq.serializers import JSONSerializer

from kiviq.jobs.keys import cancel_flag
from kiviq.jobs.models import EventType, FinishReason, GenerationResult, StreamEvent, Usage
from kiviq.jobs.publisher import EventPublisher

CANCEL_FLAG_TTL_S = 24 * 3600


def cancel_job(redis: Redis, job_id: str) -> bool:
    """Cancel a job.

    The flag is set first, so a worker that dequeues the job right now sees
    it at admission. Removing the id from its queue is atomic: if the client
    removed it, the client finishes the cancellation; otherwise a worker holds
    the job and finishes it at its next step.

    Returns:
        False if the job does not exist or had already ended; True otherwise.
    """
    try:
        job = Job.fetch(job_id, connection=redis, serializer=JSONSerializer)
    except NoSuchJobError:
        return False
    status = job.get_status(refresh=True)
    if status in (JobStatus.FINISHED, JobStatus.FAILED, JobStatus.CANCELED, JobStatus.STOPPED):
        return False
    redis.set(cancel_flag(job_id), 1, ex=CANCEL_FLAG_TTL_S)
    queue = Queue(job.origin, connection=redis, serializer=JSONSerializer)
    if redis.lrem(queue.key, 0, job_id):
        job.cancel()
        publish_cancelled(redis, job_id, prompt_tokens=0)
    return True


def publish_cancelled(redis: Redis, job_id: str, *, prompt_tokens: int, text: str = "",
                      token_ids: list[int] | None = None) -> None:
    """Append and publish the final ``cancelled`` event of a job that never
    reached (or was removed from) a worker."""
    publisher = EventPublisher(redis)
    token_ids = token_ids or []
    result = GenerationResult(job_id=job_id, text=text, token_ids=token_ids, finish_reason=FinishReason.cancelled,
                              usage=Usage(prompt_tokens=prompt_tokens, completion_tokens=len(token_ids)))
    publisher.publish([StreamEvent(job_id=job_id, seq=publisher.next_seq(job_id), type=EventType.done,
                                   finish_reason=FinishReason.cancelled, result=result)])
