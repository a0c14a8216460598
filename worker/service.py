"""The kiviq worker: an rq-registered, never-forking worker that feeds queued
jobs into the engine between steps and streams every step's events.

rq runs one job per ``work()`` iteration, so this worker drives rq's per-job
pieces itself (DESIGN.md, "rq 3.0 facts"): ``Queue.dequeue_any`` to pull,
``prepare_execution`` / ``prepare_job_execution`` to mark a job started,
``handle_job_success`` / ``handle_job_failure`` when its sequence ends, and
``maintain_heartbeats`` while it runs.
"""

from __future__ import annotations

import logging
import signal
import time
from dataclasses import dataclass, field
from datetime import timezone
from typing import Any

import redis
from rq import Queue, SimpleWorker
from rq.exceptions import DequeueTimeout, DeserializationError
from rq.executions import Execution
from rq.job import Job, JobStatus
from rq.serializers import JSONSerializer
from rq.utils import now

from engine.request import StepEvent
from engine.setup import context_length
from jobs.keys import TASK_PATH, queue_names
from jobs.models import EventType, FinishReason, GenerationResult, StreamEvent, Timing, Usage
from jobs.validation import validate_request
from worker.prompts import build_request
from worker.publisher import EventPublisher

log = logging.getLogger("kiviq.worker")


def describe_error(error: Exception) -> str:
    """One line a user can act on: the exception type and message."""
    return f"{type(error).__name__}: {error}"

HEARTBEAT_EVERY_S = 10.0
IDLE_DEQUEUE_TIMEOUT_S = 1  # blocking pop while idle; short so signals are seen


@dataclass
class ActiveJob:
    """A job whose sequence is in the engine."""

    job: Job
    queue: Queue
    execution: Execution
    next_seq: int
    admitted_at: float = field(default_factory=time.monotonic)
    first_token_at: float | None = None
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    prompt_tokens: int = 0


class BatchWorker(SimpleWorker):
    """Serve kiviq jobs from all priority queues with one engine.

    Args:
        engine: the generation engine (holds the loaded model).
        connection: Redis connection.
        max_active: most sequences admitted into the engine at once.
        grace_s: on SIGTERM/SIGINT, how long running sequences may finish
            before the rest are requeued.
    """

    def __init__(self, engine: Any, connection: redis.Redis, *, max_active: int = 32,
                 grace_s: float = 30.0, name: str | None = None):
        queues = [Queue(n, connection=connection, serializer=JSONSerializer) for n in queue_names()]
        super().__init__(queues, name=name, connection=connection, serializer=JSONSerializer)
        self.engine = engine
        self.max_context = context_length(engine.model)
        self.max_active = min(max_active, engine.capacity)
        self.grace_s = grace_s
        self.publisher = EventPublisher(connection)
        self.active: dict[str, ActiveJob] = {}
        self._last_heartbeat = 0.0
        self._stop_at: float | None = None

    # ---- lifecycle -------------------------------------------------------

    def serve(self, burst: bool = False, logging_level: str = "INFO") -> int:
        """Run until stopped (or, with ``burst``, until the queues are empty).

        Returns:
            The number of jobs that ended (finished or failed).
        """
        self.bootstrap(logging_level)
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        ended = 0
        backoff = 0.5
        try:
            while True:
                try:
                    if self._stop_at is not None and (not self.active or time.monotonic() >= self._stop_at):
                        break
                    if self.should_run_maintenance_tasks:
                        self.run_maintenance_tasks()
                    if self._stop_at is None:
                        self._admit(block=not self.active and not burst)
                    if not self.active:
                        if burst:
                            break
                        continue
                    ended += self._step()
                    self._heartbeat_if_due()
                    backoff = 0.5
                except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as e:
                    log.error("Redis unreachable (%s); retrying in %.1f s", e, backoff)
                    time.sleep(backoff)
                    backoff = min(backoff * 2, 30.0)
        finally:
            self._requeue_all()
            self.teardown()
        return ended

    def _on_signal(self, signum, frame):
        if self._stop_at is None:
            log.info("Signal %s: no new jobs; finishing running ones for up to %.0f s", signum, self.grace_s)
            self._stop_at = time.monotonic() + self.grace_s
        else:  # second signal: stop now, requeue what runs
            self._stop_at = 0.0

    # ---- admission -------------------------------------------------------

    def _admit(self, block: bool) -> None:
        while len(self.active) < self.max_active:
            try:
                found = Queue.dequeue_any(
                    self._ordered_queues,
                    IDLE_DEQUEUE_TIMEOUT_S if block else None,
                    connection=self.connection,
                    job_class=self.job_class,
                    serializer=self.serializer,
                )
            except DequeueTimeout:
                return
            except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError):
                raise
            except Exception as e:  # a job whose hash cannot even be read
                self._fail_unreadable(getattr(e, "job_id", None), getattr(e, "queue", None), e)
                continue
            if found is None:
                return
            block = False
            self._start(*found)

    def _start(self, job: Job, queue: Queue) -> None:
        execution = self.prepare_execution(job)
        try:
            payload, error = self._job_payload(job), None
        except Exception as e:  # checked before rq touches the job's data itself
            payload, error = None, e
        if error is None:
            self.prepare_job_execution(job)
        job.started_at = now()
        active = ActiveJob(job, queue, execution, self.publisher.next_seq(job.id))
        self.active[job.id] = active
        if active.next_seq > 0:  # a requeued job: clients drop what they saw
            self._publish([self._event(active, EventType.restarted)])
        try:
            if error is not None:
                raise error
            request = validate_request(payload)
            engine_request = build_request(job.id, request, self.engine.tokenizer, self.max_context)
        except Exception as e:
            self._finish_failed(active, describe_error(e))
            return
        active.prompt_tokens = len(engine_request.prompt_tokens)
        self.engine.add(engine_request)
        log.info("job %s admitted (%d prompt tokens)", job.id, active.prompt_tokens)

    @staticmethod
    def _job_payload(job: Job) -> Any:
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

    # ---- stepping --------------------------------------------------------

    def _step(self) -> int:
        events = self.engine.step()
        out: list[StreamEvent] = []
        finished: list[tuple[ActiveJob, StepEvent]] = []
        for ev in events:
            active = self.active.get(ev.request_id)
            if active is None:
                continue
            if ev.token_ids and active.first_token_at is None:
                active.first_token_at = time.monotonic()
            active.token_ids.extend(ev.token_ids)
            active.text.append(ev.text)
            if ev.text or ev.token_ids:
                out.append(self._event(active, EventType.token, text=ev.text, token_ids=ev.token_ids))
            if ev.finish_reason is not None:
                finished.append((active, ev))
        self._publish(out)
        for active, ev in finished:
            if ev.finish_reason == FinishReason.error.value:
                self._finish_failed(active, ev.error or "generation failed")
            else:
                self._finish_ok(active, FinishReason(ev.finish_reason))
        return len(finished)

    def _event(self, active: ActiveJob, type_: EventType, **fields) -> StreamEvent:
        event = StreamEvent(job_id=active.job.id, seq=active.next_seq, type=type_, **fields)
        active.next_seq += 1
        return event

    def _publish(self, events: list[StreamEvent]) -> None:
        self.publisher.publish(events)

    # ---- endings ---------------------------------------------------------

    def _result(self, active: ActiveJob, reason: FinishReason) -> GenerationResult:
        end = time.monotonic()
        job = active.job
        queue_s = 0.0
        if job.enqueued_at and job.started_at:
            queue_s = max(0.0, (job.started_at - job.enqueued_at.replace(tzinfo=job.started_at.tzinfo or timezone.utc)).total_seconds())
        first = active.first_token_at
        n = len(active.token_ids)
        decode_tps = (n - 1) / (end - first) if first and n > 1 and end > first else 0.0
        return GenerationResult(
            job_id=job.id,
            text="".join(active.text),
            token_ids=active.token_ids,
            finish_reason=reason,
            usage=Usage(prompt_tokens=active.prompt_tokens, completion_tokens=n),
            timing=Timing(
                queue_s=queue_s,
                ttft_s=(first - active.admitted_at) if first else 0.0,
                total_s=end - active.admitted_at,
                decode_tokens_per_s=decode_tps,
            ),
        )

    def _finish_ok(self, active: ActiveJob, reason: FinishReason) -> None:
        result = self._result(active, reason)
        self._publish([self._event(active, EventType.done, finish_reason=reason, result=result)])
        job = active.job
        self.active.pop(job.id, None)
        job._result = result.model_dump(mode="json")
        job._status = JobStatus.FINISHED
        self.handle_execution_ended(job, active.queue, job.success_callback_timeout)
        self.handle_job_success(job=job, queue=active.queue, started_job_registry=active.queue.started_job_registry,
                                execution=active.execution)
        log.info("job %s finished: %s, %d tokens", job.id, reason.value, len(active.token_ids))

    def _finish_failed(self, active: ActiveJob, message: str) -> None:
        job = active.job
        self.engine.abort(job.id)
        self.active.pop(job.id, None)
        self._publish([self._event(active, EventType.error, finish_reason=FinishReason.error, error=message)])
        job._status = JobStatus.FAILED
        self.handle_execution_ended(job, active.queue, job.failure_callback_timeout)
        self.handle_job_failure(job, active.queue, exc_string=message, execution=active.execution)
        log.warning("job %s failed: %s", job.id, message)

    def _fail_unreadable(self, job_id: str | None, queue: Queue | None, error: Exception) -> None:
        """Record a job whose stored data could not be loaded at all."""
        log.warning("job %s unreadable: %s", job_id, error)
        if not job_id or queue is None:
            return
        message = f"unreadable job data: {type(error).__name__}: {error}"
        job = Job(id=job_id, connection=self.connection, serializer=self.serializer)
        with self.connection.pipeline() as pipe:
            queue.failed_job_registry.add(job, exc_string=message, pipeline=pipe)
            pipe.hset(job.key, mapping={"status": JobStatus.FAILED.value, "exc_info": message})
            pipe.execute()

    def _requeue_all(self) -> None:
        """Put jobs still in the engine back at the front of their queues."""
        for active in list(self.active.values()):
            job = active.job
            self.engine.abort(job.id)
            try:
                with self.connection.pipeline() as pipe:
                    self.cleanup_execution(job, pipeline=pipe, execution=active.execution)
                    pipe.execute()
                active.queue._enqueue_job(job, at_front=True)
                log.info("job %s requeued", job.id)
            except redis.exceptions.RedisError as e:  # left for rq's abandoned-job cleanup
                log.error("could not requeue job %s: %s", job.id, e)
        self.active.clear()

    def _heartbeat_if_due(self) -> None:
        if time.monotonic() - self._last_heartbeat < HEARTBEAT_EVERY_S:
            return
        self._last_heartbeat = time.monotonic()
        for active in self.active.values():
            self.maintain_heartbeats(active.job, active.execution)
