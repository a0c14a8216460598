"""Bulk generation: a JSONL file of requests in, a JSONL file of results out.

Input lines are either OpenAI Batch API requests::

    {"custom_id": "q1", "method": "POST", "url": "/v1/chat/completions",
     "body": {"messages": [...], "max_tokens": 64}}

or plain kiviq requests (``custom_id`` optional, default ``line-<n>``)::

    {"prompt": "The sky is", "max_tokens": 8}

Output lines are OpenAI's batch output format, one per input line, in
completion order (see ``bulk_format``)::

    {"id": "batch_req_<hex>", "custom_id": "q1", "error": null,
     "response": {"status_code": 200, "request_id": "<kiviq job id>",
                  "body": {"id": "chatcmpl-<job id>", "object": "chat.completion", "created": 1700000000,
                           "model": "<request's model, else kiviq>", "choices": [{"index": 0,
                           "message": {"role": "assistant", "content": "..."}, "finish_reason": "stop",
                           "logprobs": null}], "usage": {...}, "kiviq": {"line": 1, ...}}}}
    {"id": "batch_req_<hex>", "custom_id": "q2", "response": null,
     "error": {"code": "invalid_request", "message": "line 2: ...", "line": 2}}

A run is resumable: custom_ids already in the output file (results and
errors) are skipped, and every job carries an idempotency key derived from
the input file, the custom_id and the request, so a rerun re-attaches to jobs
a killed run left queued or running instead of enqueueing them again. With
``retry_failed`` the error lines are first removed from the output file (an
atomic rewrite) and their input lines run again; an earlier job of the same
key that ended is deleted so that it really runs again.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from typing import IO, TYPE_CHECKING, Any

from rq.job import Job
from rq.serializers import JSONSerializer
from tqdm import tqdm

from kiviq.client.bulk_format import (
    BulkLine,
    check_defaults,
    count_lines,
    drop_error_lines,
    error_record,
    idempotency_key,
    iter_input,
    ok_record,
    parse_line,
    read_done,
)
from kiviq.client.errors import QueueFull
from kiviq.jobs.keys import cancel_flag, event_channel, job_id_for_idempotency_key, replay_log
from kiviq.jobs.models import EventType, FinishReason, GenerationResult, StreamEvent

if TYPE_CHECKING:
    from kiviq.client.client import Client

SWEEP_EVERY_S = 2.0  # re-check every in-flight job's log tail (pub/sub is only a wake-up)
QUEUE_FULL_RETRY_S = 1.0


@dataclass
class BulkSummary:
    """What the output file holds after a run, and what the run did.

    ``ok`` / ``failed``: result and error lines in the output file, including
    lines earlier runs wrote; ``skipped``: input lines not run because the
    output file had them; ``retried``: error lines removed to be rerun
    (``retry_failed``); ``reattached``: jobs a previous run had enqueued,
    awaited not resubmitted. Tokens and seconds are this run's."""

    total: int = 0
    ok: int = 0
    failed: int = 0
    skipped: int = 0
    retried: int = 0
    reattached: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    seconds: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class Progress:
    """A tqdm bar on stderr over the lines this run works on (skipped lines
    leave its total), with ok / failed / skipped counts and tokens/s."""

    def __init__(self, summary: BulkSummary, enabled: bool, stream: IO[str] | None = None):
        self.summary = summary
        self.started = time.monotonic()
        self.bar = tqdm(total=summary.total, desc="bulk", unit="line", file=stream or sys.stderr,
                        disable=not enabled, dynamic_ncols=True, mininterval=0.2)

    def postfix(self) -> dict[str, Any]:
        s = self.summary
        elapsed = max(time.monotonic() - self.started, 1e-9)
        return {"ok": s.ok, "failed": s.failed, "skipped": s.skipped,
                "tok/s": f"{s.completion_tokens / elapsed:.1f}"}

    def advance(self) -> None:
        """One line of this run written."""
        self.bar.set_postfix(self.postfix(), refresh=False)
        self.bar.update(1)

    def skip(self) -> None:
        """One line found done already: out of the bar's total (and its rate)."""
        if self.bar.total:
            self.bar.total -= 1
        self.bar.set_postfix(self.postfix(), refresh=False)
        if not self.bar.disable:
            self.bar.refresh()

    def close(self) -> None:
        self.bar.set_postfix(self.postfix(), refresh=False)
        self.bar.close()


# ---- the run -------------------------------------------------------------


class _BulkRun:
    def __init__(self, client: "Client", in_path: str, out_path: str, max_in_flight: int,
                 defaults: dict[str, Any], progress: bool | None, retry_failed: bool = False,
                 stop: Callable[[], bool] | None = None):
        if max_in_flight < 1:
            raise ValueError("max_in_flight must be at least 1")
        self.client = client
        self.redis = client.redis
        self.in_path = in_path
        self.out_path = out_path
        self.max_in_flight = max_in_flight
        self.defaults = defaults
        self.retry_failed = retry_failed
        self.stop = stop
        self.summary = BulkSummary()
        self.progress_enabled = sys.stderr.isatty() if progress is None else progress
        self.progress: Progress | None = None
        self.in_flight: dict[str, BulkLine] = {}
        self.suspect: dict[str, int] = {}  # job id -> sweeps that found it gone without a final event
        self.seen_ids: set[str] = set()
        self.retry_ids: set[str] = set()  # custom_ids of the error lines a retry_failed run removed
        self.out: IO[str] | None = None
        self.pubsub = None

    def run(self) -> BulkSummary:
        started = time.monotonic()
        # Nothing touches OUT until the run can start: the input exists, Redis answers.
        self.summary.total = count_lines(self.in_path)  # FileNotFoundError
        self.redis.ping()  # redis.ConnectionError (and friends)
        if self.retry_failed:
            self.retry_ids = set(drop_error_lines(self.out_path))
            self.summary.retried = len(self.retry_ids)
        state = read_done(self.out_path)
        self.summary.ok, self.summary.failed = state.ok, state.failed
        self.progress = Progress(self.summary, self.progress_enabled)
        self.pubsub = self.redis.pubsub(ignore_subscribe_messages=True)
        self.out = open(self.out_path, "a", encoding="utf-8")
        try:
            lines = self._lines(state.done_ids, state.dup_lines)
            retry: BulkLine | None = None
            exhausted = False
            blocked_until = 0.0
            next_sweep = time.monotonic() + SWEEP_EVERY_S
            while True:
                if self.stop is not None and self.stop():  # asked to stop: cancel what is in flight
                    for job_id in list(self.in_flight):
                        self.client.cancel(job_id)
                    break
                new_ids = []
                while not exhausted and len(self.in_flight) < self.max_in_flight \
                        and time.monotonic() >= blocked_until:
                    line = retry or next(lines, None)
                    retry = None
                    if line is None:
                        exhausted = True
                        break
                    job_id = self._submit(line)
                    if job_id is None:  # the queues are full: wait for the worker
                        retry, blocked_until = line, time.monotonic() + QUEUE_FULL_RETRY_S
                        break
                    new_ids.append(job_id)
                if new_ids:  # jobs a previous run left that have ended already
                    self._sweep(new_ids)
                if exhausted and retry is None and not self.in_flight:
                    break
                if not self.in_flight:
                    time.sleep(max(0.0, blocked_until - time.monotonic()))
                    continue
                wait = max(0.0, min(next_sweep, blocked_until if retry else next_sweep) - time.monotonic())
                message = self.pubsub.get_message(timeout=min(wait, SWEEP_EVERY_S))
                while message is not None:
                    self._on_message(message)
                    message = self.pubsub.get_message(timeout=0)
                if time.monotonic() >= next_sweep:
                    self._sweep(list(self.in_flight))
                    next_sweep = time.monotonic() + SWEEP_EVERY_S
        finally:
            self.summary.seconds = time.monotonic() - started
            self.progress.close()
            self.out.close()
            self.pubsub.close()
        return self.summary

    def _lines(self, done_ids: set[str], done_dup_lines: set[int]) -> Iterator[BulkLine]:
        """Lines still to submit; writes error lines and counts skips on the way."""
        for n, text in iter_input(self.in_path):
            if text is None:
                line = BulkLine(n, f"line-{n}", error=f"line {n}: not valid UTF-8", code="invalid_json")
            else:
                line = parse_line(text, n, self.defaults)
            if line.custom_id in self.seen_ids:
                if n in done_dup_lines:
                    self._skip()
                else:
                    self._write(error_record(line, f"line {n}: duplicate custom_id {line.custom_id!r} "
                                                   "(an earlier line has it)", "duplicate_custom_id"), ok=False)
                continue
            self.seen_ids.add(line.custom_id)
            if line.custom_id in done_ids:
                self._skip()
            elif line.error is not None:
                self._write(error_record(line, line.error, line.code or "invalid_request"), ok=False)
            else:
                yield line

    def _skip(self) -> None:
        self.summary.skipped += 1
        self.progress.skip()

    def _submit(self, line: BulkLine) -> str | None:
        """Enqueue a line's job (or find the one a previous run enqueued);
        None if the queues are full."""
        key = idempotency_key(self.in_path, line.custom_id, line.request)
        job_id = job_id_for_idempotency_key(key)
        self.pubsub.subscribe(event_channel(job_id))  # before the job can produce events
        existed = bool(self.redis.exists(Job.key_for(job_id)))
        if existed and line.custom_id in self.retry_ids:
            existed = not self._forget_ended_job(job_id)
        try:
            handle = self.client.enqueue(line.request.model_copy(update={"idempotency_key": key}))
        except QueueFull:
            self.pubsub.unsubscribe(event_channel(job_id))
            return None
        assert handle.job_id == job_id
        self.summary.reattached += existed
        self.in_flight[job_id] = line
        return job_id

    def _forget_ended_job(self, job_id: str) -> bool:
        """Delete a job that ended (an earlier run's failure being retried) so
        the same idempotency key enqueues a fresh one; True if deleted. A job
        still queued or running is kept and re-attached to."""
        status = self.redis.hget(Job.key_for(job_id), "status")
        status = status.decode() if isinstance(status, bytes) else status
        if status not in ("finished", "failed", "stopped", "canceled"):
            return False
        try:
            Job.fetch(job_id, connection=self.redis, serializer=JSONSerializer).delete()
        except Exception:  # noqa: BLE001 - unreadable job data: drop its key directly
            self.redis.delete(Job.key_for(job_id))
        self.redis.delete(replay_log(job_id), cancel_flag(job_id))
        return True

    def _on_message(self, message: dict) -> None:
        try:
            event = StreamEvent.model_validate_json(message["data"])
        except ValueError:
            return
        if event.job_id in self.in_flight and event.type in (EventType.done, EventType.error):
            self._finish(event)

    def _sweep(self, job_ids: list[str]) -> None:
        """Finish jobs whose final event is in their log (pub/sub can miss
        one across a reconnect); fail jobs that vanished or ended without one."""
        with self.redis.pipeline(transaction=False) as pipe:
            for job_id in job_ids:
                pipe.lindex(replay_log(job_id), -1)
                pipe.hmget(Job.key_for(job_id), ["status", "exc_info"])
            replies = pipe.execute()
        for i, job_id in enumerate(job_ids):
            if job_id not in self.in_flight:
                continue
            raw, (status, exc_info) = replies[2 * i], replies[2 * i + 1]
            if raw is not None:
                event = StreamEvent.model_validate_json(raw)
                if event.type in (EventType.done, EventType.error):
                    self._finish(event)
                    continue
            status = status.decode() if isinstance(status, bytes) else status
            if status is not None and status not in ("finished", "failed", "stopped", "canceled"):
                self.suspect.pop(job_id, None)
                continue
            # Gone, or ended without a final event: give its last event a sweep to land.
            self.suspect[job_id] = self.suspect.get(job_id, 0) + 1
            if self.suspect[job_id] >= 2:
                if status == "finished" and self._finish_from_rq(job_id):
                    continue
                if status is None:
                    message = f"job {job_id} no longer exists in Redis (expired or deleted)"
                else:
                    reason = (exc_info.decode(errors="replace") if isinstance(exc_info, bytes) else exc_info) or ""
                    lines = [s for s in reason.strip().splitlines() if s.strip()]
                    message = f"job {job_id} {status}" + (f": {lines[-1]}" if lines else "")
                self._fail(job_id, message)

    def _finish_from_rq(self, job_id: str) -> bool:
        """Finish a job from its rq result (its event log expired or was trimmed)."""
        try:
            res = Job.fetch(job_id, connection=self.redis, serializer=JSONSerializer).latest_result()
            result = GenerationResult.model_validate(res.return_value) if res is not None else None
        except Exception:  # noqa: BLE001 - anything unreadable is reported as vanished
            return False
        if result is None:
            return False
        self._finish(StreamEvent(job_id=job_id, seq=0, type=EventType.done, result=result,
                                 finish_reason=result.finish_reason))
        return True

    def _finish(self, event: StreamEvent) -> None:
        job_id = event.job_id
        if event.type == EventType.done and event.result is not None \
                and event.result.finish_reason != FinishReason.error:
            line = self._forget(job_id)
            self._write(ok_record(line, event), ok=True)
            self.summary.prompt_tokens += event.result.usage.prompt_tokens
            self.summary.completion_tokens += event.result.usage.completion_tokens
        else:
            self._fail(job_id, f"job {job_id} failed: {event.error or 'ended without a result'}")

    def _fail(self, job_id: str, message: str) -> None:
        line = self._forget(job_id)
        self._write(error_record(line, message, "job_failed"), ok=False)

    def _forget(self, job_id: str) -> BulkLine:
        self.suspect.pop(job_id, None)
        self.pubsub.unsubscribe(event_channel(job_id))
        return self.in_flight.pop(job_id)

    def _write(self, record: dict[str, Any], ok: bool) -> None:
        self.out.write(json.dumps(record, ensure_ascii=False) + "\n")
        self.out.flush()
        if ok:
            self.summary.ok += 1
        else:
            self.summary.failed += 1
        self.progress.advance()


def run_bulk(client: "Client", in_path: str, out_path: str, *, max_in_flight: int = 64,
             defaults: dict[str, Any] | None = None, progress: bool | None = None,
             retry_failed: bool = False, stop: Callable[[], bool] | None = None) -> BulkSummary:
    """Generate for every line of ``in_path``, appending results to ``out_path``.

    Args:
        client: the Client whose Redis the jobs go to.
        in_path: JSONL input (OpenAI Batch API lines or plain request lines).
        out_path: JSONL output (OpenAI batch output lines); appended to.
            Lines whose custom_id is already there (result or error) are
            skipped, so a rerun resumes a killed run. Not created or touched
            when the run cannot start (missing input, Redis unreachable).
        max_in_flight: most jobs queued or running at once.
        defaults: request fields every line starts from (e.g. max_tokens);
            a line's own fields win.
        progress: a tqdm progress bar on stderr: None (default) when stderr
            is a TTY, True always, False never.
        retry_failed: remove the error lines already in ``out_path`` (an
            atomic rewrite) and run their input lines again, so the file
            still holds one line per custom_id.
        stop: called between steps; when it returns True the run cancels
            its in-flight jobs and returns (their lines are not written, so
            a later run without ``stop`` would run them again).

    Returns:
        A BulkSummary: ok / failed count every line of ``out_path``
        (earlier runs' too), plus skipped, tokens, seconds.

    Raises:
        InvalidRequest: ``defaults`` are invalid (per-line problems are
            written to ``out_path``, never raised).
        FileNotFoundError: ``in_path`` does not exist.
        redis.exceptions.ConnectionError: Redis cannot be reached.
    """
    return _BulkRun(client, in_path, out_path, max_in_flight, check_defaults(defaults), progress,
                    retry_failed, stop).run()
