"""Bulk generation: a JSONL file of requests in, a JSONL file of results out.

Input lines are either OpenAI Batch API requests::

    {"custom_id": "q1", "method": "POST", "url": "/v1/chat/completions",
     "body": {"messages": [...], "max_tokens": 64}}

or plain kiviq requests (``custom_id`` optional, default ``line-<n>``)::

    {"prompt": "The sky is", "max_tokens": 8}

Output lines follow the OpenAI batch output shape, one per input line, in
completion order::

    {"id": "<job id>", "custom_id": "q1", "line": 1, "error": null,
     "response": {"status_code": 200, "body": {"text": ..., "finish_reason": ..., "usage": {...}}}}
    {"id": null, "custom_id": "q2", "line": 2, "response": null,
     "error": {"code": "invalid_request", "message": "line 2: ..."}}

A run is resumable: custom_ids already in the output file are skipped, and
every job carries an idempotency key derived from the input file, the
custom_id and the request, so a rerun re-attaches to jobs a killed run left
queued or running instead of enqueueing them again.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import IO, TYPE_CHECKING, Any

from rq.job import Job
from rq.serializers import JSONSerializer

from kiviq.client.bulk_format import (
    BulkLine,
    check_defaults,
    count_lines,
    error_record,
    idempotency_key,
    iter_input,
    ok_record,
    parse_line,
    read_done,
)
from kiviq.client.errors import QueueFull
from kiviq.jobs.keys import event_channel, job_id_for_idempotency_key, replay_log
from kiviq.jobs.models import EventType, GenerationResult, StreamEvent

if TYPE_CHECKING:
    from kiviq.client.client import Client

SWEEP_EVERY_S = 2.0  # re-check every in-flight job's log tail (pub/sub is only a wake-up)
QUEUE_FULL_RETRY_S = 1.0


@dataclass
class BulkSummary:
    """What a bulk run did. ``skipped``: already in the output file;
    ``reattached``: jobs a previous run had enqueued, awaited not resubmitted."""

    total: int = 0
    ok: int = 0
    failed: int = 0
    skipped: int = 0
    reattached: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    seconds: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class Progress:
    """A one-line progress bar on stderr, redrawn in place with ``\\r``."""

    def __init__(self, summary: BulkSummary, enabled: bool, stream: IO[str] | None = None):
        self.summary = summary
        self.enabled = enabled
        self.stream = stream or sys.stderr
        self.started = time.monotonic()
        self._last_draw = 0.0
        self._width = 0

    def line(self) -> str:
        s = self.summary
        done = s.ok + s.failed + s.skipped
        elapsed = max(time.monotonic() - self.started, 1e-9)
        processed = s.ok + s.failed  # this run's own work, for the rate
        if processed and done < s.total:
            eta_s = (s.total - done) * elapsed / processed
            eta = f"{int(eta_s // 3600)}:{int(eta_s % 3600 // 60):02d}:{int(eta_s % 60):02d}"
        else:
            eta = "--:--:--" if done < s.total else "0:00:00"
        pct = 100.0 * done / s.total if s.total else 100.0
        return (f"bulk {done}/{s.total} ({pct:.0f}%) ok {s.ok} failed {s.failed} skipped {s.skipped} | "
                f"{s.completion_tokens / elapsed:.1f} tok/s | ETA {eta}")

    def update(self, force: bool = False) -> None:
        if not self.enabled:
            return
        t = time.monotonic()
        if not force and t - self._last_draw < 0.2:
            return
        self._last_draw = t
        text = self.line()
        pad = max(0, self._width - len(text))
        self._width = len(text)
        self.stream.write("\r" + text + " " * pad)
        self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            self.update(force=True)
            self.stream.write("\n")
            self.stream.flush()


# ---- the run -------------------------------------------------------------


class _BulkRun:
    def __init__(self, client: "Client", in_path: str, out_path: str, max_in_flight: int,
                 defaults: dict[str, Any], progress: bool | None):
        if max_in_flight < 1:
            raise ValueError("max_in_flight must be at least 1")
        self.client = client
        self.redis = client.redis
        self.in_path = in_path
        self.out_path = out_path
        self.max_in_flight = max_in_flight
        self.defaults = defaults
        self.summary = BulkSummary()
        enabled = sys.stderr.isatty() if progress is None else progress
        self.progress = Progress(self.summary, enabled)
        self.in_flight: dict[str, BulkLine] = {}
        self.suspect: dict[str, int] = {}  # job id -> sweeps that found it gone without a final event
        self.seen_ids: set[str] = set()
        self.out: IO[str] | None = None
        self.pubsub = None

    def run(self) -> BulkSummary:
        started = time.monotonic()
        self.summary.total = count_lines(self.in_path)  # FileNotFoundError before OUT is touched
        done_ids, done_dup_lines = read_done(self.out_path)
        self.pubsub = self.redis.pubsub(ignore_subscribe_messages=True)
        self.out = open(self.out_path, "a", encoding="utf-8")
        try:
            lines = self._lines(done_ids, done_dup_lines)
            retry: BulkLine | None = None
            exhausted = False
            blocked_until = 0.0
            next_sweep = time.monotonic() + SWEEP_EVERY_S
            while True:
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
                self.progress.update()
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
                    self.summary.skipped += 1
                else:
                    self._write(error_record(line, f"line {n}: duplicate custom_id {line.custom_id!r} "
                                                   "(an earlier line has it)", "duplicate_custom_id"))
                    self.summary.failed += 1
                continue
            self.seen_ids.add(line.custom_id)
            if line.custom_id in done_ids:
                self.summary.skipped += 1
            elif line.error is not None:
                self._write(error_record(line, line.error, line.code or "invalid_request"))
                self.summary.failed += 1
            else:
                yield line
            self.progress.update()

    def _submit(self, line: BulkLine) -> str | None:
        """Enqueue a line's job (or find the one a previous run enqueued);
        None if the queues are full."""
        key = idempotency_key(self.in_path, line.custom_id, line.request)
        job_id = job_id_for_idempotency_key(key)
        self.pubsub.subscribe(event_channel(job_id))  # before the job can produce events
        existed = bool(self.redis.exists(Job.key_for(job_id)))
        try:
            handle = self.client.enqueue(line.request.model_copy(update={"idempotency_key": key}))
        except QueueFull:
            self.pubsub.unsubscribe(event_channel(job_id))
            return None
        assert handle.job_id == job_id
        self.summary.reattached += existed
        self.in_flight[job_id] = line
        return job_id

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
        if event.type == EventType.done and event.result is not None:
            line = self._forget(job_id)
            self._write(ok_record(line, event))
            self.summary.ok += 1
            self.summary.prompt_tokens += event.result.usage.prompt_tokens
            self.summary.completion_tokens += event.result.usage.completion_tokens
        else:
            self._fail(job_id, f"job {job_id} failed: {event.error or 'ended without a result'}")

    def _fail(self, job_id: str, message: str) -> None:
        line = self._forget(job_id)
        self._write(error_record(line, message, "job_failed", job_id))
        self.summary.failed += 1

    def _forget(self, job_id: str) -> BulkLine:
        self.suspect.pop(job_id, None)
        self.pubsub.unsubscribe(event_channel(job_id))
        return self.in_flight.pop(job_id)

    def _write(self, record: dict[str, Any]) -> None:
        self.out.write(json.dumps(record, ensure_ascii=False) + "\n")
        self.out.flush()
        self.progress.update()


def run_bulk(client: "Client", in_path: str, out_path: str, *, max_in_flight: int = 64,
             defaults: dict[str, Any] | None = None, progress: bool | None = None) -> BulkSummary:
    """Generate for every line of ``in_path``, appending results to ``out_path``.

    Args:
        client: the Client whose Redis the jobs go to.
        in_path: JSONL input (OpenAI Batch API lines or plain request lines).
        out_path: JSONL output; appended to. Lines whose custom_id is already
            there are skipped, so a rerun resumes a killed run.
        max_in_flight: most jobs queued or running at once.
        defaults: request fields every line starts from (e.g. max_tokens);
            a line's own fields win.
        progress: draw a progress bar on stderr: None (default) when stderr
            is a TTY, True always, False never.

    Returns:
        A BulkSummary (ok / failed / skipped counts, tokens, seconds).

    Raises:
        InvalidRequest: ``defaults`` are invalid (per-line problems are
            written to ``out_path``, never raised).
        FileNotFoundError: ``in_path`` does not exist.
    """
    return _BulkRun(client, in_path, out_path, max_in_flight, check_defaults(defaults), progress).run()
