"""kiviq client: enqueue generation jobs and stream results. Never imports mlx."""

from client.client import Client, JobHandle, QueueFull
from client.async_client import AsyncClient, AsyncJobHandle
from client.bulk import BulkSummary
from client.streaming import JobFailed
from jobs.validation import InvalidRequest

__all__ = ["AsyncClient", "AsyncJobHandle", "BulkSummary", "Client", "InvalidRequest", "JobFailed", "JobHandle", "QueueFull"]
