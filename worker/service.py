"""The kiviq worker: an rq-registered, never-forking worker that feeds queued
jobs into the engine between steps and streams every step's events.

rq runs one job per ``work()`` iteration, so this worker drives rq's per-job
pieces itself (DESIGN.md, "rq 3.0 facts"): ``worker.claims`` to pull (in
place of ``Queue.dequeue_any``, which can lose a job to a kill),
the writes of ``prepare_execution`` / ``prepare_job_execution`` to mark a
burst started (``worker.admission.start_jobs``, one transaction),
``handle_job_success`` / ``handle_job_failure`` / ``Job.cancel`` when its
sequence ends, and rq's heartbeats while it runs (``worker.heartbeats``).

A step's events go to Redis through an outbox whose thread publishes them,
records the rq endings of jobs whose final event they hold, reads cancel flags
and, with free slots, whether jobs wait, while the engine computes the next
step. If Redis goes away the outbox retries with backoff and the engine stops a
step or two ahead of it: nothing it generated is lost (``worker.outbox``).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import redis
from rq import Queue, SimpleWorker
from rq.job import Job, JobStatus
from rq.serializers import JSONSerializer
from rq.utils import now
from rq.worker import WorkerStatus

from kiviq.engine.setup import context_length
from kiviq.jobs.keys import cancel_flag, max_queued_key, queue_names
from kiviq.jobs.models import EventType, FinishReason, GenerationResult, StreamEvent, TokenEvent
from kiviq.jobs.validation import validate_request
from kiviq.worker import admission, claims
from kiviq.worker.active_job import ActiveJob, describe_error, queue_wait
from kiviq.worker.heartbeats import heartbeat_running
from kiviq.worker.logprobs import LogprobConverter
from kiviq.worker.prompts import build_request, encode_prompts
from kiviq.worker.metrics import PhaseClock
from kiviq.worker.outbox import Outbox
from kiviq.worker.recovery import ALIVE_TTL_S, RECOVERY_LOCK_MS, mark_alive, mark_dead, requeue_orphans

log = logging.getLogger("kiviq.worker")

HEARTBEAT_EVERY_S = min(5.0, ALIVE_TTL_S / 3)
RECOVERY_EVERY_S = float(os.environ.get("KIVIQ_RECOVERY_EVERY_S", "30"))
IDLE_DEQUEUE_TIMEOUT_S = 1  # waiting for a job while idle; short so signals are seen
TEARDOWN_WAIT_S = 5.0  # rq's own cleanup at shutdown, at most (BatchWorker._teardown_within)
COMMAND_POLL_S = 0.5  # rq's command listener wakes this often (BatchWorker.subscribe)


class BatchWorker(SimpleWorker):
    """Serve kiviq jobs from all priority queues with one engine.

    Args:
        engine: the generation engine (holds the loaded model).
        connection: Redis connection.
        max_active: most sequences admitted into the engine at once.
        grace_s: on SIGTERM/SIGINT, how long running sequences may finish
            before the rest are requeued.
        max_queued: if set, published for clients as the queue limit
            (``submit`` then raises QueueFull).
        max_attempts: runs of a job whose worker died before it fails.
        metrics: optional WorkerMetrics-like object fed with step statistics.
    """

    def __init__(self, engine: Any, connection: redis.Redis, *, max_active: int = 32,
                 grace_s: float = 30.0, name: str | None = None, max_queued: int | None = None,
                 max_attempts: int = 3, metrics: Any = None):
        queues = [Queue(n, connection=connection, serializer=JSONSerializer) for n in queue_names()]
        super().__init__(queues, name=name, connection=connection, serializer=JSONSerializer)
        self.engine = engine
        self.max_context = context_length(engine.model)
        self.max_active = min(max_active, engine.capacity)
        self.grace_s = grace_s
        self.max_queued = max_queued
        self.max_attempts = max_attempts
        self.metrics = metrics
        self.outbox: Outbox | None = None  # made in serve(): its thread lives as long as serving
        self.active: dict[str, ActiveJob] = {}
        self._outbox_events: list[StreamEvent | TokenEvent] = []
        # (job id, its rq bookkeeping and claim release): go with the put that holds
        # the job's final event, and run on the outbox's thread once it is published.
        self._outbox_endings: list[tuple[str, Callable[[], None]]] = []
        self._last_heartbeat = 0.0
        self._last_recovery = 0.0
        self._stop_at: float | None = None
        self._logprobs = LogprobConverter(engine.tokenizer)
        self.ended = 0  # jobs ended (finished, failed or cancelled) in this serve()

    # ---- lifecycle -------------------------------------------------------

    def serve(self, burst: bool = False, logging_level: str = "INFO") -> int:
        """Run until stopped (or, with ``burst``, until the queues are empty).

        Returns:
            The number of jobs that ended (finished, failed or cancelled).
        """
        # rq lists queues from its rq:queues set, which only enqueue fills:
        # register all three so `rq info` and rq-dashboard show them from now.
        self.connection.sadd(Queue.redis_queues_keys, *[q.key for q in self.queues])
        self.bootstrap(logging_level)
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        if self.max_queued is not None:
            self.connection.set(max_queued_key(), self.max_queued)
        self.ended = 0
        backoff = 0.5
        # Claims under this name already are from an earlier worker that used it.
        requeue_orphans(self.connection, self.queues, max_attempts=self.max_attempts, own=self.name,
                        wait_s=RECOVERY_LOCK_MS / 1000)
        self.outbox = self.new_outbox()
        try:
            while True:
                try:
                    clock = PhaseClock()  # the worker's own time around each step (metrics)
                    self._flush_outbox()
                    clock.lap("publish")
                    if self._stop_at is not None and (not self.active or time.monotonic() >= self._stop_at):
                        break
                    idle = not self.active
                    self._housekeeping()
                    self._sync_state()
                    if self._stop_at is None:
                        self._admit(block=idle and not burst)
                    clock.lap("idle" if idle else "admit_housekeeping")
                    if not self.active:
                        if burst and self.engine.num_active == 0:
                            break
                        continue
                    self._apply_cancels()
                    clock.lap("cancel_check")
                    self._step()
                    clock.lap("step")
                    self._flush_outbox(after_step=True)
                    clock.lap("publish")
                    if self.metrics is not None:
                        self.metrics.worker_loop(clock.spent)
                    backoff = 0.5
                except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as e:
                    log.error("Redis unreachable (%s); retrying in %.1f s", type(e).__name__, backoff)
                    time.sleep(backoff)
                    backoff = min(backoff * 2, 10.0)
        finally:
            started = time.monotonic()
            try:
                self._flush_outbox()
                self.outbox.close()
                self._requeue_all()
                mark_dead(self.connection, self.name)
                log.info("shutdown: events published and jobs settled in %.1f s", time.monotonic() - started)
                self._teardown_within(TEARDOWN_WAIT_S)
            except redis.exceptions.RedisError as e:  # rq's cleanup requeues what we could not
                log.error("shutdown bookkeeping failed: %s", e)
            log.info("shutdown: done in %.1f s", time.monotonic() - started)
        return self.ended

    def new_outbox(self) -> Outbox:
        """An outbox for this worker's Redis, which asks its queues' lengths when a put says so."""
        return Outbox(self.connection, queue_keys=[q.key for q in self._ordered_queues],
                      on_publish=self.metrics.outbox_publish if self.metrics else None)

    def subscribe(self) -> None:
        """rq's command channel (``rq.command``: shutdown, stop-job), its listener
        thread waking every COMMAND_POLL_S instead of rq's 60 s. Stopping a worker
        joins that thread, and once rq's unsubscribe has emptied its subscriptions the
        thread waits without a read that could end early: with 60 s a stopping worker
        sometimes waited out TEARDOWN_WAIT_S (a race between the two threads)."""
        self.pubsub = self.connection.pubsub()
        self.pubsub.subscribe(**{self.pubsub_channel_name: self.handle_payload})
        self.pubsub_thread = self.pubsub.run_in_thread(sleep_time=COMMAND_POLL_S, daemon=True,
                                                       exception_handler=self._pubsub_exception_handler)

    def _teardown_within(self, seconds: float) -> None:
        """rq's teardown (its scheduler, its registry entry, the command channel) on a
        daemon thread, waited for ``seconds``: the jobs are settled by then, and a Redis
        client call stuck in there must not keep a stopped worker alive."""
        def run() -> None:
            try:
                self.teardown()
            except redis.exceptions.RedisError as e:
                log.error("shutdown: rq's teardown failed: %s", e)

        thread = threading.Thread(target=run, name="kiviq-rq-teardown", daemon=True)
        thread.start()
        thread.join(seconds)
        if thread.is_alive():
            log.warning("shutdown: rq's teardown still running after %.0f s; exiting without it", seconds)

    def _sync_state(self) -> None:
        """rq state: ``busy`` while sequences are active, ``idle`` otherwise
        (rq's own loop would set idle before each dequeue; this one never
        runs it, and ``prepare_job_execution`` leaves the worker ``busy``)."""
        want = WorkerStatus.BUSY if self.active else WorkerStatus.IDLE
        if self.get_state() != want:
            self.set_state(want)

    def _on_signal(self, signum, frame):
        if self._stop_at is None:
            log.info("Signal %s: no new jobs; finishing running ones for up to %.0f s", signum, self.grace_s)
            self._stop_at = time.monotonic() + self.grace_s
        else:  # second signal: stop now, requeue what runs
            self._stop_at = 0.0

    def _housekeeping(self) -> None:
        t = time.monotonic()
        if t - self._last_heartbeat >= HEARTBEAT_EVERY_S:
            self._last_heartbeat = t
            mark_alive(self.connection, self.name)
            if self.active:
                heartbeat_running(self, list(self.active.values()))
            else:
                self.heartbeat()
        if t - self._last_recovery >= RECOVERY_EVERY_S:
            self._last_recovery = t
            ending = self.outbox.pending_endings() | {job_id for job_id, _ in self._outbox_endings}
            running = set(self.active) | ending
            requeue_orphans(self.connection, self.queues, max_attempts=self.max_attempts, own=self.name,
                            running=running)
        if self.should_run_maintenance_tasks:
            self.run_maintenance_tasks()

    # ---- admission -------------------------------------------------------

    def _admit(self, block: bool) -> None:
        """Claim and start queued jobs while slots are free. Beside running jobs the
        queues are asked only once the outbox saw a job waiting in them (its check
        after the last step): an empty ask would be a round trip on the engine's thread."""
        if self.active and not block and not self.outbox.take_queued():
            return
        by_key = {q.key: q for q in self._ordered_queues}
        keys = list(by_key)
        while len(self.active) < self.max_active:
            if block:
                found = claims.wait_and_claim(self.connection, keys, self.name, IDLE_DEQUEUE_TIMEOUT_S)
                claimed = [found] if found is not None else []
            else:
                limit = self.max_active - len(self.active)
                claimed = claims.claim_batch(self.connection, keys, self.name, limit)
            if claimed:
                self._start_claimed([(by_key[key], job_id) for key, job_id in claimed])
            if not claimed or (not block and len(claimed) < limit):  # the queues are empty
                return
            block = False

    def _start_claimed(self, claimed: list[tuple[Queue, str]]) -> None:
        """Start the jobs just claimed, in order; their data and streams are read
        in one pipeline each (``worker.admission``)."""
        fresh, seen = [], set(self.active)
        for queue, job_id in claimed:
            if job_id in seen:  # queued twice while it runs: this copy has nothing to do
                claims.release(self.connection, self.name, job_id)
            else:
                seen.add(job_id)
                fresh.append((queue, job_id))
        ids = [job_id for _, job_id in fresh]
        # If Redis goes away here the claims stay; recovery requeues them if we never come back.
        jobs = admission.fetch_jobs(self.connection, ids, self.job_class, self.serializer)
        states = admission.stream_states(self.connection, ids)
        readable = []  # (queue, job, its stream, its payload or the error reading it)
        for (queue, job_id), job, state in zip(fresh, jobs, states):
            if job is None:  # deleted while queued: nothing to run
                claims.release(self.connection, self.name, job_id)
            elif isinstance(job, Exception):  # a job whose hash cannot even be read
                self._fail_unreadable(job_id, queue, state, job)
            else:  # checked before rq touches the job's data itself
                readable.append((queue, job, state, admission.payload_or_error(job)))
        # If Redis goes away here none is started, and all stay claimed.
        executions = admission.start_jobs(self, [job for _, job, _, _ in readable],
                                          [not isinstance(p, Exception) for *_, p in readable])
        opened = []  # (active, its validated request): encoded together, then added in order
        try:
            for (queue, job, state, payload), execution in zip(readable, executions):
                started = self._open(job, queue, state, execution, payload)
                if started is not None:
                    opened.append(started)
        finally:  # an error midway: the jobs opened so far still run (the rest stay claimed: recovery requeues them)
            self._submit(opened)

    def _submit(self, opened: list[tuple[ActiveJob, Any]]) -> None:
        """Encode the opened jobs' prompts in one batch and add them to the engine, in order."""
        prompts = encode_prompts(self.engine.tokenizer, [request for _, request in opened])
        for (active, request), tokens in zip(opened, prompts):
            try:
                if isinstance(tokens, Exception):
                    raise tokens
                engine_request = build_request(active.job.id, request, self.engine.tokenizer, self.max_context,
                                               tokens=tokens)
            except Exception as e:
                self._finish_failed(active, describe_error(e))
                continue
            active.prompt_tokens = len(engine_request.prompt_tokens)
            if engine_request.sampling.logprobs is not None:
                active.logprobs = []
            self.engine.add(engine_request)
            log.info("job %s admitted (%d prompt tokens)", active.job.id, active.prompt_tokens)

    def _open(self, job: Job, queue: Queue, stream: admission.StreamState, execution: Any,
              payload: Any) -> tuple[ActiveJob, Any] | None:
        """Track a job just marked started in rq (``payload``: its request, or the
        error reading it); returns it with its validated request, or None when it
        ended here (already ended, cancelled, or a request that fails validation)."""
        job.started_at = now()
        active = ActiveJob(job, queue, execution, stream.next_seq)
        self.active[job.id] = active
        if self.metrics is not None:  # taken from its queue: admitted, whatever happens next
            self.metrics.job_admitted(job.id, queue_wait(job), queue.name)
        if self._already_ended(active, stream.last_event):
            return None
        if active.next_seq > 0:  # a requeued job: clients drop what they saw
            self._outbox_events.append(self._event(active, EventType.restarted))
        if stream.cancel_requested:
            self._cancel(active)
            return None
        try:
            if isinstance(payload, Exception):
                raise payload
            return active, validate_request(payload)
        except Exception as e:
            self._finish_failed(active, describe_error(e))
            return None

    def _already_ended(self, active: ActiveJob, last_event: bytes | None) -> bool:
        """A worker that died after publishing a job's final event but before
        recording it in rq leaves the job to be requeued; finish the rq side
        from that event (its stream's last) instead of generating (and
        publishing) it twice."""
        if not last_event:
            return False
        event = StreamEvent.model_validate_json(last_event)
        if event.type == EventType.done and event.result is not None:
            self._record_success(active, event.result)
        elif event.type == EventType.error:
            self._record_failure(active, event.error or "job failed")
        else:
            return False
        self._ended(active, "finished" if event.type == EventType.done else "failed", event.finish_reason)
        log.info("job %s had already ended (%s); recorded without rerunning", active.job.id, event.type.value)
        return True

    # ---- stepping --------------------------------------------------------

    def _apply_cancels(self) -> None:
        """Cancel the jobs whose flag the outbox saw (one step after the client set it)."""
        for job_id in self.outbox.take_cancels():
            active = self.active.get(job_id)
            if active is not None:
                self._cancel(active)

    def _step(self) -> None:
        started = time.monotonic()
        events = self.engine.step()
        returned = time.monotonic()
        counts = []  # (job id, tokens) of this step, for the metrics in one call
        endings = []
        for ev in events:
            job_id = ev.request_id
            active = self.active.get(job_id)
            if active is None:
                continue
            logprobs = None
            if ev.token_ids:
                if active.first_token_at is None:
                    active.first_token_at = returned
                    if self.metrics is not None:
                        self.metrics.first_token(job_id, returned - active.admitted_at)
                counts.append((job_id, len(ev.token_ids)))
                active.token_ids.extend(ev.token_ids)
                if active.logprobs is not None:
                    logprobs = self._logprobs(ev.logprobs or [])
                    active.logprobs.extend(logprobs)
            active.text.append(ev.text)
            if ev.text or ev.token_ids:  # made into a StreamEvent on the outbox's thread
                self._outbox_events.append(TokenEvent(job_id, self._next_seq(active), ev.text, ev.token_ids, logprobs))
            if ev.finish_reason is not None:
                endings.append((active, ev))
        if self.metrics is not None:  # before the endings: a job's last tokens count before it ends
            self.metrics.step_tokens(counts)
        for active, ev in endings:
            if ev.finish_reason == FinishReason.error.value:
                self._finish_failed(active, ev.error or "generation failed")
            else:
                self._finish_ok(active, FinishReason(ev.finish_reason))
        if self.metrics is not None:
            self.metrics.observe_engine_step(self.engine, time.monotonic() - started)

    def _event(self, active: ActiveJob, type_: EventType, **fields) -> StreamEvent:
        return StreamEvent(job_id=active.job.id, seq=self._next_seq(active), type=type_, **fields)

    @staticmethod
    def _next_seq(active: ActiveJob) -> int:
        """The sequence number of the job's next event (numbered here, in order, with no gaps)."""
        active.next_seq += 1
        return active.next_seq - 1

    def _flush_outbox(self, after_step: bool = False) -> None:
        """Hand pending events and endings to the outbox (after a step, with the
        running jobs, whose cancel flags it then reads, and, with free slots, a
        question for the queues)."""
        if self._outbox_events or self._outbox_endings or after_step:
            ask = after_step and self._stop_at is None and len(self.active) < self.max_active
            self.outbox.put(self._outbox_events, self.active if after_step else (), self._outbox_endings,
                            ask_queues=ask)
            self._outbox_events, self._outbox_endings = [], []

    def _ending(self, job_id: str, record: Callable[[], None]) -> None:
        """rq's bookkeeping for a job that ended, then its claim's release: run on the
        outbox's thread once the put that holds the job's events so far is published."""
        def run() -> None:
            record()
            claims.release(self.connection, self.name, job_id)

        self._outbox_endings.append((job_id, run))

    # ---- endings ---------------------------------------------------------

    def _ended(self, active: ActiveJob, outcome: str, finish_reason: FinishReason | None = None) -> None:
        self.active.pop(active.job.id, None)
        self.ended += 1
        if self.metrics is not None:
            self.metrics.job_finished(active.job.id, outcome, time.monotonic() - active.admitted_at,
                                      active.prompt_tokens, len(active.token_ids),
                                      finish_reason=finish_reason.value if finish_reason else None)
            store = getattr(self.engine, "kv_store", None)
            if store is not None:
                self.metrics.kv_memory(store.used_bytes(), store.budget_bytes())

    def _finish_ok(self, active: ActiveJob, reason: FinishReason) -> None:
        result = active.result(reason)
        self._outbox_events.append(self._event(active, EventType.done, finish_reason=reason, result=result))
        self._record_success(active, result)
        self._ended(active, "timeout" if reason == FinishReason.timeout else "finished", reason)
        log.info("job %s finished: %s, %d tokens", active.job.id, reason.value, len(active.token_ids))

    def _record_success(self, active: ActiveJob, result: GenerationResult) -> None:
        """Queue rq's success bookkeeping (result stored once) behind the events."""
        job = active.job

        def record() -> None:
            job._result = result.model_dump(mode="json", exclude_none=True)
            job._status = JobStatus.FINISHED
            self.handle_execution_ended(job, active.queue, job.success_callback_timeout)
            self.handle_job_success(job=job, queue=active.queue,
                                    started_job_registry=active.queue.started_job_registry,
                                    execution=active.execution)

        self._ending(job.id, record)

    def _record_failure(self, active: ActiveJob, message: str) -> None:
        job = active.job

        def record() -> None:
            job._status = JobStatus.FAILED
            self.handle_execution_ended(job, active.queue, job.failure_callback_timeout)
            self.handle_job_failure(job, active.queue, exc_string=message, execution=active.execution)

        self._ending(job.id, record)

    def _finish_failed(self, active: ActiveJob, message: str) -> None:
        job = active.job
        self.engine.abort(job.id)
        self._outbox_events.append(self._event(active, EventType.error, finish_reason=FinishReason.error,
                                               error=message))
        self._record_failure(active, message)
        self._ended(active, "failed")
        log.warning("job %s failed: %s", job.id, message)

    def _cancel(self, active: ActiveJob) -> None:
        """Stop a job on a client's request: KV freed now, rq status canceled."""
        job = active.job
        self.engine.abort(job.id)
        result = active.result(FinishReason.cancelled)
        self._outbox_events.append(self._event(active, EventType.done, finish_reason=FinishReason.cancelled,
                                               result=result))

        def record() -> None:
            with self.connection.pipeline() as pipe:
                self.cleanup_execution(job, pipeline=pipe, execution=active.execution)
                pipe.delete(cancel_flag(job.id))
                pipe.execute()
            if job.get_status(refresh=True) != JobStatus.CANCELED:
                job.cancel()

        self._ending(job.id, record)
        self._ended(active, "cancelled")
        log.info("job %s cancelled after %d tokens", job.id, len(active.token_ids))

    def _fail_unreadable(self, job_id: str, queue: Queue, stream: admission.StreamState, error: Exception) -> None:
        """Record a job whose stored data could not be loaded at all."""
        log.warning("job %s unreadable: %s", job_id, error)
        admission.fail_unreadable(self.connection, self.outbox.publisher, self.name, job_id, queue, stream,
                                  f"unreadable job data: {describe_error(error)}")
        if self.metrics is not None:  # taken from a queue and ended: counted like any other job
            self.metrics.job_admitted(job_id, 0.0, queue.name)
            self.metrics.job_finished(job_id, "failed", 0.0, 0, 0)

    def _requeue_all(self) -> None:
        """Put jobs still in the engine back at the front of their queues."""
        for active in list(self.active.values()):
            job = active.job
            self.engine.abort(job.id)
            with self.connection.pipeline() as pipe:  # MULTI: back in the queue and released together
                self.cleanup_execution(job, pipeline=pipe, execution=active.execution)
                active.queue._enqueue_job(job, pipeline=pipe, at_front=True)
                claims.release(pipe, self.name, job.id)
                pipe.execute()
            if self.metrics is not None:
                self.metrics.job_requeued(job.id)
            log.info("job %s requeued", job.id)
        self.active.clear()
