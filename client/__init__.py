"""kiviq client: enqueue generation jobs and stream results. Never imports mlx."""

from kiviq.client.client import Client, JobHandle, QueueFull
from kiviq.client.async_client import AsyncClient, AsyncJobHandle
from kiviq.client.bulk import BulkSummary
from kiviq.client.streaming import JobFailed
from kiviq.jobs.validation import InvalidRequest

__all__ = ["AsyncClient", "AsyncJobHandle", "BulkSummary", "Client", "InvalidRequest", "JobFailed", "JobHandle", "QueueFull"]
