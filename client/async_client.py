"""The asyncio client: the same API as ``Client``, awaitable.

Streaming and results use ``redis.asyncio`` natively with the same
exactly-once / in-order protocol as ``client.streaming`` (subscribe first,
read the replay log, then take events from their channel messages); a client's
streams share one pub/sub connection (``client.subscriber``). rq's ``Queue`` is
synchronous, so enqueueing (and anything else that goes through rq: status,
cancel) runs the sync ``Client`` in a thread:
the job a coroutine enqueues is byte for byte the job ``Client`` enqueues,
with the same validation, idempotency and backpressure.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from redis import Redis
from redis import connection as sync_connection_module
from redis.asyncio import Redis as AsyncRedis
from redis.asyncio import BlockingConnectionPool
from redis.asyncio import connection as async_connection_module

from kiviq.client.client import Client
from kiviq.jobs.settings import redis_url_from_env
from kiviq.client.streaming import EventCursor, JobFailed, TextDeltas, wait_s
from kiviq.client.subscriber import StreamSubscriber
from kiviq.jobs.keys import event_channel, replay_log
from kiviq.jobs.models import EventType, GenerateRequest, GenerationResult, StreamEvent
from kiviq.jobs.validation import validate_request

# Async connection classes -> the sync class that speaks to the same server.
_SYNC_CONNECTION_CLASS = {
    async_connection_module.Connection: sync_connection_module.Connection,
    async_connection_module.SSLConnection: sync_connection_module.SSLConnection,
    async_connection_module.UnixDomainSocketConnection: sync_connection_module.UnixDomainSocketConnection,
}
# Connection kwargs that are objects of the async pool itself, or that rq
# cannot work with (it needs bytes replies).
_NOT_COPIED = {"decode_responses", "encoding", "encoding_errors"}


MAX_CONNECTIONS = 1024  # to one Redis per AsyncClient; Redis itself admits 10,000 clients by default


def sync_redis_like(conn: AsyncRedis) -> Redis:
    """A sync redis-py client for the same server, database and credentials
    as an async one (host/port/path, db, username/password, timeouts, TLS
    settings are copied; pool-internal objects are not)."""
    pool = conn.connection_pool
    kwargs = {}
    for key, value in pool.connection_kwargs.items():
        if key in _NOT_COPIED or key.startswith("orig_"):
            continue
        if value is None or isinstance(value, (str, int, float, bool, bytes)) or key == "credential_provider":
            kwargs[key] = value
    cls = _SYNC_CONNECTION_CLASS.get(pool.connection_class, sync_connection_module.Connection)
    return Redis(connection_pool=sync_connection_module.ConnectionPool(connection_class=cls, **kwargs))


async def aiter_events(redis: AsyncRedis, job_id: str, timeout: float | None = None,
                       subscriber: StreamSubscriber | None = None) -> AsyncIterator[StreamEvent]:
    """Every event of a job in order, exactly once, ending at done/error (the
    async twin of ``client.streaming.iter_events``). Its channel is read through
    ``subscriber`` (an ``AsyncClient``'s, shared by its streams), else through a
    pub/sub connection of its own.

    Raises:
        TimeoutError: the job produced no terminal event within ``timeout`` s.
    """
    deadline = None if timeout is None else time.monotonic() + timeout
    own = subscriber is None
    if own:
        subscriber = StreamSubscriber(redis)
    channel = event_channel(job_id)
    messages = await subscriber.subscribe(channel)
    cursor = EventCursor()
    try:
        while not cursor.finished:
            if cursor.read_log:
                events = cursor.accept(await redis.lrange(replay_log(job_id), cursor.next_seq, -1))
            else:
                events = cursor.accept_message(await messages.get(wait_s(deadline, job_id, timeout)))
            for event in events:
                yield event
    finally:
        if own:
            await subscriber.aclose()
        else:
            await subscriber.unsubscribe(channel, messages)


async def aiter_text(events: AsyncIterator[StreamEvent]) -> AsyncIterator[str]:
    """Text deltas from async events (restart-aware, like ``iter_text``)."""
    deltas = TextDeltas()
    async for event in events:
        delta = deltas.feed(event)
        if delta:
            yield delta


class AsyncJobHandle:
    """A submitted job: stream its text or await its result."""

    def __init__(self, client: "AsyncClient", job_id: str):
        self._client = client
        self.job_id = job_id

    def __repr__(self) -> str:
        return f"AsyncJobHandle({self.job_id!r})"

    def events(self, timeout: float | None = None) -> AsyncIterator[StreamEvent]:
        """``async for`` every stream event in order, ending with ``done`` or ``error``."""
        return aiter_events(self._client.redis, self.job_id, timeout, self._client.subscriber)

    def stream(self, timeout: float | None = None) -> AsyncIterator[str]:
        """``async for`` text deltas as they are generated (works after the job finished too).

        Raises:
            JobFailed: the job ended in error.
            TimeoutError: no final event within ``timeout`` seconds.
        """
        return aiter_text(self.events(timeout))

    async def result(self, timeout: float = 300.0) -> GenerationResult:
        """Wait until the job ends and return its result (also for jobs that
        were cancelled or timed out: see ``finish_reason``).

        Raises:
            JobFailed: the job failed (the message is the worker's reason).
            TimeoutError: no result within ``timeout`` seconds.
        """
        events = self.events(timeout)
        try:
            async for event in events:
                if event.type == EventType.done and event.result is not None:
                    return event.result
                if event.type == EventType.error:
                    raise JobFailed(f"job {self.job_id} failed: {event.error}")
        finally:
            await events.aclose()
        raise JobFailed(f"job {self.job_id} ended without a result")

    async def status(self) -> str:
        """rq's status of the job (queued, started, finished, failed, canceled, ...)."""
        return await asyncio.to_thread(self._client.sync.job(self.job_id).status)

    async def cancel(self) -> bool:
        """Cancel the job (see ``Client.cancel``)."""
        return await self._client.cancel(self.job_id)


class AsyncClient:
    """Enqueue generation jobs and read their results from asyncio code.

    Args:
        redis_url: ``redis://`` / ``rediss://`` / ``unix://`` URL; default
            ``$REDIS_URL`` or ``redis://127.0.0.1:6379/0``.
        connection: an existing ``redis.asyncio.Redis`` (overrides
            ``redis_url``; not closed by ``aclose``). Enqueueing goes through
            rq, which is synchronous: it uses a sync client made from this
            connection's parameters, or ``sync_connection`` when given.
        sync_connection: the sync redis-py client for rq (optional).
        max_connections: most connections the client opens to Redis from
            ``redis_url``, per pool (async and sync). The client's streams
            share one pub/sub connection; a command takes one for its call.
        pool_timeout: seconds a command waits for a free async connection
            when all ``max_connections`` are in use, then raises redis'
            ``ConnectionError``; None waits as long as it takes. Both are
            ignored with ``connection`` (its pool is the caller's).
        **client_options: passed to the sync ``Client`` (e.g. ``max_queued``).

    Use as ``async with AsyncClient(url) as client: ...`` or call
    ``await client.aclose()``.
    """

    def __init__(self, redis_url: str | None = None, *, connection: AsyncRedis | None = None,
                 sync_connection: Redis | None = None, max_connections: int = MAX_CONNECTIONS,
                 pool_timeout: float | None = None, **client_options: Any):
        if connection is not None:
            self.redis = connection
            self._owns_redis = False
            sync = sync_connection if sync_connection is not None else sync_redis_like(connection)
            self._owns_sync = sync_connection is None
        else:
            url = redis_url_from_env(redis_url)
            # A blocking pool: a command waits for a free connection where redis-py's
            # default pool raises MaxConnectionsError (concurrent log reads of many
            # streams, aiter_events with no subscriber holding one each).
            self.redis = AsyncRedis.from_pool(BlockingConnectionPool.from_url(
                url, max_connections=max_connections, timeout=pool_timeout))
            self._owns_redis = True
            sync = sync_connection if sync_connection is not None else Redis.from_url(
                url, max_connections=max_connections)
            self._owns_sync = sync_connection is None
        self.sync = Client(connection=sync, **client_options)
        self.subscriber = StreamSubscriber(self.redis)  # one pub/sub connection for all its streams

    async def submit(self, prompt: str | None = None, **fields: Any) -> AsyncJobHandle:
        """Validate a request and enqueue it (see ``Client.submit``).

        Returns:
            An AsyncJobHandle; with an idempotency key that was submitted
            before, the handle of the existing job (nothing new is enqueued).

        Raises:
            InvalidRequest: a field is invalid; the message names it. Nothing
                reaches Redis.
        """
        if prompt is not None:
            fields["prompt"] = prompt
        request = validate_request(fields)  # before any I/O, like the sync client
        return await self.enqueue(request)

    async def enqueue(self, request: GenerateRequest) -> AsyncJobHandle:
        """Enqueue an already validated request."""
        handle = await asyncio.to_thread(self.sync.enqueue, request)
        return AsyncJobHandle(self, handle.job_id)

    def job(self, job_id: str) -> AsyncJobHandle:
        """A handle for a job submitted earlier (by any client)."""
        return AsyncJobHandle(self, job_id)

    async def cancel(self, job_id: str) -> bool:
        """Cancel a job (see ``Client.cancel``)."""
        return await asyncio.to_thread(self.sync.cancel, job_id)

    async def bulk(self, in_path: str, out_path: str, **options: Any):
        """``Client.bulk`` in a thread (it is I/O-bound and self-paced)."""
        return await asyncio.to_thread(self.sync.bulk, in_path, out_path, **options)

    async def aclose(self) -> None:
        """Close the connections this client opened."""
        await self.subscriber.aclose()
        if self._owns_redis:
            await self.redis.aclose()
        if self._owns_sync:
            await asyncio.to_thread(self.sync.redis.close)

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        await self.aclose()
