"""Which jobs a worker holds, recorded in the same Redis call that takes them.

rq's multi-queue dequeue pops a job id (LPOP) before anything records who
holds it, and marks the job STARTED only a few round trips later. A worker
killed inside that gap would lose the job for good: it is in no queue, and
no registry names it as started. kiviq instead moves the id from its queue
onto the worker's claim list in one Lua call, and takes it off only when the
job's ending is recorded in rq or the job is back in a queue (in the same
transaction as the requeue). A dead worker's claim list is therefore the
complete set of jobs it may have left unfinished (see worker.recovery).
"""

from __future__ import annotations

import time

from redis import Redis
from redis.client import Pipeline
from redis.commands.core import Script

from kiviq.jobs.keys import claim_key, claim_pattern

# KEYS: the queue keys in priority order, then the claim list; ARGV[1]: the most
# ids to take. A script runs atomically, so an id is always in exactly one of
# the lists. Returns queue key, id, queue key, id, ...
_CLAIM_SCRIPT = """
local claim, limit, out = KEYS[#KEYS], tonumber(ARGV[1]), {}
for i = 1, #KEYS - 1 do
  while #out < 2 * limit do
    local id = redis.call('LPOP', KEYS[i])
    if not id then break end
    redis.call('RPUSH', claim, id)
    out[#out + 1] = KEYS[i]
    out[#out + 1] = id
  end
end
return out
"""

# Sent by SHA once loaded (redis-py's Script falls back to EVAL when a server lacks it).
_CLAIM = Script(None, _CLAIM_SCRIPT.encode())  # bytes: no client needed for its SHA

# No Redis command blocks on several lists and moves atomically (BLMPOP pops,
# BLMOVE watches one list), so an idle worker polls; a claim is one cheap call.
IDLE_POLL_S = 0.02


def claim_batch(conn: Redis, queue_keys: list[str], worker_name: str, limit: int) -> list[tuple[str, str]]:
    """Move up to ``limit`` job ids, first queue first, onto the worker's claim
    list in one call: a worker with many free slots admits a burst of jobs
    without a round trip per job.

    Returns:
        (queue key, job id) pairs in the order taken; empty when every queue is.
    """
    found = _CLAIM(keys=[*queue_keys, claim_key(worker_name)], args=[max(1, limit)], client=conn)
    return [(_text(found[i]), _text(found[i + 1])) for i in range(0, len(found), 2)]


def claim_next(conn: Redis, queue_keys: list[str], worker_name: str) -> tuple[str, str] | None:
    """Move the first job id of the first non-empty queue onto the worker's claim list.

    Returns:
        (queue key, job id), or None when every queue is empty.
    """
    found = claim_batch(conn, queue_keys, worker_name, 1)
    return found[0] if found else None


def wait_and_claim(conn: Redis, queue_keys: list[str], worker_name: str, timeout_s: float) -> tuple[str, str] | None:
    """``claim_next``, retried until a job comes or ``timeout_s`` passes."""
    deadline = time.monotonic() + timeout_s
    while True:
        found = claim_next(conn, queue_keys, worker_name)
        if found is not None or time.monotonic() >= deadline:
            return found
        time.sleep(IDLE_POLL_S)


def release(conn: Redis | Pipeline, worker_name: str, job_id: str) -> None:
    """Take a job off the worker's claim list (its ending is recorded, or it is requeued)."""
    conn.lrem(claim_key(worker_name), 1, job_id)


def claimed(conn: Redis, worker_name: str) -> list[str]:
    """The job ids a worker holds, oldest claim first."""
    return [_text(j) for j in conn.lrange(claim_key(worker_name), 0, -1)]


def claimants(conn: Redis) -> list[str]:
    """Names of the workers that hold at least one claim (live or dead)."""
    prefix = claim_key("")
    return [_text(k)[len(prefix):] for k in conn.scan_iter(match=claim_pattern(), count=1000)]


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
