"""The one place that names kiviq's Redis keys, channels and queues.

Every producer and consumer builds names through these helpers, so a prefix
change (``KIVIQ_KEY_PREFIX``) moves everything at once.
"""

from __future__ import annotations

import os
from enum import Enum


class Priority(str, Enum):
    """Queue priorities, drained by the worker in declaration order."""

    high = "high"
    default = "default"
    low = "low"


PREFIX = os.environ.get("KIVIQ_KEY_PREFIX", "kiviq")

# rq function path recorded on every job; see jobs.tasks.generate.
TASK_PATH = "kiviq.jobs.tasks.generate"


def queue_name(priority: Priority | str) -> str:
    """rq queue name for a priority (``kiviq-high``, ...)."""
    return f"{PREFIX}-{Priority(priority).value}"


def queue_names() -> list[str]:
    """All queue names, highest priority first (the worker's drain order)."""
    return [queue_name(p) for p in Priority]


def event_channel(job_id: str) -> str:
    """Pub/sub channel that carries a job's live events."""
    return f"{PREFIX}:events:{job_id}"


def replay_log(job_id: str) -> str:
    """List holding every event of a job in order, for late subscribers."""
    return f"{PREFIX}:log:{job_id}"


def job_id_for_idempotency_key(key: str) -> str:
    """Deterministic rq job id for an idempotency key (a retried submit finds it)."""
    return f"{PREFIX}-idem-{key}"


def cancel_flag(job_id: str) -> str:
    """Set by a client to ask the worker running a job to stop it."""
    return f"{PREFIX}:cancel:{job_id}"


def max_queued_key() -> str:
    """Operator-set limit on queued jobs across all priorities (backpressure)."""
    return f"{PREFIX}:max-queued"


def alive_key(worker_name: str) -> str:
    """Short-TTL liveness key of a worker: gone means its jobs can be requeued."""
    return f"{PREFIX}:alive:{worker_name}"


def claim_key(worker_name: str) -> str:
    """List of the job ids a worker has taken off a queue and not yet given back
    (ended in rq, or requeued); see worker.claims."""
    return f"{PREFIX}:claimed:{worker_name}"


def claim_pattern() -> str:
    """SCAN pattern matching every ``claim_key``."""
    return f"{PREFIX}:claimed:*"


def recovery_lock_key() -> str:
    """Held while one worker requeues a dead worker's jobs, so no job is requeued twice."""
    return f"{PREFIX}:recovery-lock"


def worker_stats_key(worker_name: str) -> str:
    """JSON snapshot of one worker's metrics (``kiviq top``), kept alive by a TTL."""
    return f"{PREFIX}:stats:worker:{worker_name}"


def worker_stats_pattern() -> str:
    """SCAN pattern matching every ``worker_stats_key``."""
    return f"{PREFIX}:stats:worker:*"
