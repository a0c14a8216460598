"""rq's heartbeats for every running job in one transaction.

rq's ``maintain_heartbeats`` refreshes one job (its hash, its execution, the
started registry and the worker's hash) in two round trips: with 64 jobs
running, 128 round trips on the engine's thread every few seconds, one step
held up ~18 ms on the CPU machine. This writes the same keys, with the same
TTLs and the same repairs, for all of them in one transaction (~5 ms there).
"""

from __future__ import annotations

from collections.abc import Sequence

from rq.utils import now

from kiviq.worker.active_job import ActiveJob


def heartbeat_running(worker, running: Sequence[ActiveJob]) -> None:
    """What ``worker.maintain_heartbeats(job, execution)`` does for each job of
    ``running``, in one transaction (and a second only for its repairs)."""
    worker_ttl = worker.job_monitoring_interval + 60
    stamp = now()
    with worker.connection.pipeline() as pipe:
        worker.heartbeat(worker_ttl, pipeline=pipe)  # reply 0: 1 if the worker's hash had expired
        job_replies = []
        for active in running:
            job = active.job
            working = (stamp - job.started_at).total_seconds() if job.started_at else 0.0
            ttl = int(worker.get_heartbeat_ttl(job, working_time=working))
            active.execution.heartbeat(job.started_job_registry, ttl, pipeline=pipe)
            job_replies.append(len(pipe))
            job.heartbeat(stamp, ttl, pipeline=pipe, xx=True)
        replies = pipe.execute()
        # As rq repairs them: a job deleted meanwhile (result_ttl=0) has just had a
        # stub hash made by HSET, and a worker hash that expired lacks its fields.
        for active, at in zip(running, job_replies):
            if replies[at] == 1:
                pipe.delete(active.job.key)
        if replies[0] == 1:
            pipe.hset(worker.key, mapping=worker.serialize())
            pipe.expire(worker.key, worker_ttl)
        if len(pipe):
            pipe.execute()
