"""The Python client: submit jobs, stream their tokens, fetch results."""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from typing import Any

from redis import Redis
from rq import Queue
from rq.exceptions import DuplicateJobError
from rq.job import Job
from rq.results import Result
from rq.serializers import JSONSerializer

from client.streaming import JobFailed, iter_events, iter_text
from jobs.keys import TASK_PATH, job_id_for_idempotency_key, queue_name
from jobs.models import GenerateRequest, GenerationResult, StreamEvent
from jobs.validation import validate_request

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
RESULT_TTL_S = 24 * 3600
FAILURE_TTL_S = 7 * 24 * 3600


def redis_url_from_env(redis_url: str | None = None) -> str:
    """The explicit URL, else ``$REDIS_URL``, else the local default."""
    return redis_url or os.environ.get("REDIS_URL") or DEFAULT_REDIS_URL


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
        """rq's status of the job (queued, started, finished, failed, ...)."""
        return self._job().get_status(refresh=True).value

    def result(self, timeout: float = 300.0) -> GenerationResult:
        """Block until the job ends and return its result.

        Raises:
            JobFailed: the job failed (the message is the worker's reason).
            TimeoutError: no result within ``timeout`` seconds.
        """
        job = self._job()
        res = job.latest_result(timeout=max(1, math.ceil(timeout)))
        if res is None:
            raise TimeoutError(f"job {self.job_id}: no result within {timeout} s")
        if res.type != Result.Type.SUCCESSFUL:
            raise JobFailed(f"job {self.job_id} failed: {last_line(res.exc_string)}")
        return GenerationResult.model_validate(res.return_value)

    def _job(self) -> Job:
        return Job.fetch(self.job_id, connection=self._client.redis, serializer=JSONSerializer)


def last_line(text: str | None) -> str:
    """The exception line of a traceback (what a user needs to read)."""
    lines = [line for line in (text or "").strip().splitlines() if line.strip()]
    return lines[-1] if lines else "unknown error"


class Client:
    """Enqueue generation jobs into Redis and read their results.

    Args:
        redis_url: ``redis://`` or ``rediss://`` URL; default ``$REDIS_URL`` or
            ``redis://127.0.0.1:6379/0``.
        connection: an existing redis-py connection (overrides ``redis_url``).
    """

    def __init__(self, redis_url: str | None = None, *, connection: Redis | None = None):
        self.redis = connection if connection is not None else Redis.from_url(redis_url_from_env(redis_url))

    def submit(self, prompt: str | None = None, **fields: Any) -> JobHandle:
        """Validate a request and enqueue it.

        Args:
            prompt: raw completion prompt (or pass ``messages=[...]`` for chat).
            **fields: any other GenerateRequest field (max_tokens, temperature,
                top_p, stop, seed, priority, timeout_s, idempotency_key, ...).

        Returns:
            A JobHandle. With an idempotency key that was submitted before,
            the handle of the existing job (nothing new is enqueued).

        Raises:
            InvalidRequest: a field is invalid; the message names it. Nothing
                reaches Redis.
        """
        if prompt is not None:
            fields["prompt"] = prompt
        request = validate_request(fields)
        return self.enqueue(request)

    def enqueue(self, request: GenerateRequest) -> JobHandle:
        """Enqueue an already validated request."""
        key = request.idempotency_key
        job_id = job_id_for_idempotency_key(key) if key else None
        queue = Queue(queue_name(request.priority), connection=self.redis, serializer=JSONSerializer)
        try:
            job = queue.enqueue_call(
                TASK_PATH,
                args=(request.model_dump(mode="json", exclude_none=True),),
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
