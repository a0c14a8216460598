"""kiviq client: enqueue generation jobs and stream results. Never imports mlx."""

from client.client import Client, JobHandle
from client.streaming import JobFailed
from jobs.validation import InvalidRequest

__all__ = ["Client", "InvalidRequest", "JobFailed", "JobHandle"]
