"""The Python client: submit jobs, stream their tokens, fetch results."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from redis import Redis
from rq import Queue
from rq.exceptions import DuplicateJobError
from rq.job import Job
from rq.serializers import JSONSerializer

from kiviq.client.bulk import run_bulk
from kiviq.client.cancel import cancel_job
from kiviq.client.errors import QueueFull
from kiviq.client.streaming import JobFailed, iter_events, iter_text
from kiviq.jobs.keys import TASK_PATH, job_id_for_idempotency_key, max_queued_key, queue_name, queue_names
from kiviq.jobs.models import EventType, GenerateRequest, GenerationResult, StreamEvent
from kiviq.jobs.settings import redis_url_from_env
from kiviq.jobs.validation import validate_request

RESULT_TTL_S = 24 * 3600
FAILURE_TTL_S = 7 * 24 * 3600


class JobHandle:
    """A submitted job: stream its text or wait for its result."""

    def __init__(self, client: "Client", job_id: str):
        self._client = client
        self.job_id = job_id

    def __repr__(self) -> str:
        return f"JobHandle({self.job_id!r})"

    def events(self, timeout: float | None = None) -> Iterator[StreamEvent]:
        """Every stream event in order, ending with ``done`` or ``error``."""
        return iter_events(self._client.redis, self.job_id, timeout)

    def stream(self, timeout: float | None = None) -> Iterator[str]:
        """Text deltas as they are generated (works after the job finished too).

        Raises:
            JobFailed: the job ended in error.
            TimeoutError: no final event within ``timeout`` seconds.
        """
        return iter_text(self.events(timeout))

    def status(self) -> str:
        """rq's status of the job (queued, started, finished, failed, canceled, ...)."""
        return self._job().get_status(refresh=True).value

    def result(self, timeout: float = 300.0) -> GenerationResult:
        """Block until the job ends and return its result (also for jobs that
        were cancelled or timed out: see ``finish_reason``).

        The final ``done`` event carries the result (the worker also stores it
        as the rq result), so this works the same for every way a job ends.

        Raises:
            JobFailed: the job failed (the message is the worker's reason).
            TimeoutError: no result within ``timeout`` seconds.
        """
        for event in self.events(timeout):
            if event.type == EventType.done and event.result is not None:
                return event.result
            if event.type == EventType.error:
                raise JobFailed(f"job {self.job_id} failed: {event.error}")
        raise JobFailed(f"job {self.job_id} ended without a result")

    def cancel(self) -> bool:
        """Cancel the job (see ``Client.cancel``)."""
        return self._client.cancel(self.job_id)

    def _job(self) -> Job:
        return Job.fetch(self.job_id, connection=self._client.redis, serializer=JSONSerializer)


class Client:
    """Enqueue generation jobs into Redis and read their results.

    Args:
        redis_url: ``redis://`` or ``rediss://`` URL; default ``$REDIS_URL`` or
            ``redis://127.0.0.1:6379/0``.
        connection: an existing redis-py connection (overrides ``redis_url``).
    """

    def __init__(self, redis_url: str | None = None, *, connection: Redis | None = None,
                 max_queued: int | None = None):
        self.redis = connection if connection is not None else Redis.from_url(redis_url_from_env(redis_url))
        self.max_queued = max_queued

    def queued(self) -> int:
        """Jobs waiting in all priority queues."""
        with self.redis.pipeline(transaction=False) as pipe:
            for name in queue_names():
                pipe.llen(Queue(name, connection=self.redis).key)
            return sum(pipe.execute())

    def _check_backpressure(self) -> None:
        limit = self.max_queued
        if limit is None:
            stored = self.redis.get(max_queued_key())
            limit = int(stored) if stored is not None else None
        if limit is not None and self.queued() >= limit:
            raise QueueFull(f"{self.queued()} jobs are queued (limit {limit}); retry later")

    def submit(self, prompt: str | None = None, **fields: Any) -> JobHandle:
        """Validate a request and enqueue it.

        Args:
            prompt: raw completion prompt (or pass ``messages=[...]`` for chat).
            **fields: any other GenerateRequest field (max_tokens, temperature,
                top_p, stop, seed, priority, timeout_s, idempotency_key,
                ``logprobs=True`` with optional ``top_logprobs=N`` (0..20), ...).

        Returns:
            A JobHandle. With an idempotency key that was submitted before,
            the handle of the existing job (nothing new is enqueued).

        Raises:
            InvalidRequest: a field is invalid; the message names it. Nothing
                reaches Redis.
            QueueFull: the operator's queue limit is reached (``kiviq worker
                --max-queued``, or this client's ``max_queued``); nothing was
                enqueued.
        """
        if prompt is not None:
            fields["prompt"] = prompt
        request = validate_request(fields)
        return self.enqueue(request)

    def enqueue(self, request: GenerateRequest) -> JobHandle:
        """Enqueue an already validated request."""
        key = request.idempotency_key
        job_id = job_id_for_idempotency_key(key) if key else None
        if job_id is not None and self.redis.exists(Job.key_for(job_id)):
            return JobHandle(self, job_id)  # a retried submit: no second job, no backpressure error
        self._check_backpressure()
        queue = Queue(queue_name(request.priority), connection=self.redis, serializer=JSONSerializer)
        try:
            job = queue.enqueue_call(
                TASK_PATH,
                args=(request.job_args(exclude_none=True),),
                timeout=-1,  # a batch worker enforces per-job deadlines itself
                result_ttl=RESULT_TTL_S,
                failure_ttl=FAILURE_TTL_S,
                job_id=job_id,
                unique=job_id is not None,
                description="kiviq generate",
            )
        except DuplicateJobError:
            return JobHandle(self, job_id)
        return JobHandle(self, job.id)

    def job(self, job_id: str) -> JobHandle:
        """A handle for a job submitted earlier (by any client)."""
        return JobHandle(self, job_id)

    def bulk(self, in_path: str, out_path: str, *, max_in_flight: int = 64,
             defaults: dict[str, Any] | None = None, progress: bool | None = None, retry_failed: bool = False):
        """Run every request of a JSONL file (OpenAI Batch API or plain lines),
        appending one result line per custom_id to ``out_path``; resumable.
        See ``client.bulk.run_bulk``; returns its BulkSummary."""
        return run_bulk(self, in_path, out_path, max_in_flight=max_in_flight, defaults=defaults,
                        progress=progress, retry_failed=retry_failed)

    def cancel(self, job_id: str) -> bool:
        """Stop a queued job, or a running one at its next decode step (its KV
        memory is freed then). Its stream ends with ``finish_reason="cancelled"``
        and rq's status becomes ``canceled``.

        Returns:
            False if the job does not exist or had already ended.
        """
        return cancel_job(self.redis, job_id)
