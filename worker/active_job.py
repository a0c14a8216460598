"""A job while its sequence runs in the worker's engine, and the result it ends with."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import timezone

from rq import Queue
from rq.executions import Execution
from rq.job import Job

from kiviq.jobs.models import FinishReason, GenerationResult, Timing, TokenLogprob, Usage


def describe_error(error: Exception) -> str:
    """One line a user can act on: the exception type and message."""
    return f"{type(error).__name__}: {error}"


def queue_wait(job: Job) -> float:
    """Seconds the job waited in its Redis queue (0 when rq lacks either time)."""
    if not (job.enqueued_at and job.started_at):
        return 0.0
    enq = job.enqueued_at.replace(tzinfo=job.started_at.tzinfo or timezone.utc)
    return max(0.0, (job.started_at - enq).total_seconds())


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
    logprobs: list[TokenLogprob] | None = None  # a list when the request asked for them

    def result(self, reason: FinishReason) -> GenerationResult:
        """What the job ends with now: its text and tokens so far, usage and timing."""
        end = time.monotonic()
        first = self.first_token_at
        n = len(self.token_ids)
        decode_tps = (n - 1) / (end - first) if first and n > 1 and end > first else 0.0
        return GenerationResult(
            job_id=self.job.id,
            text="".join(self.text),
            token_ids=self.token_ids,
            finish_reason=reason,
            usage=Usage(prompt_tokens=self.prompt_tokens, completion_tokens=n),
            logprobs=self.logprobs,
            timing=Timing(
                queue_s=queue_wait(self.job),
                ttft_s=(first - self.admitted_at) if first else 0.0,
                total_s=end - self.admitted_at,
                decode_tokens_per_s=decode_tps,
            ),
        )
