"""One pub/sub connection for every stream an ``AsyncClient`` reads.

A stream subscribes its job's channel here and gets a mailbox of that channel's
messages; one task reads the connection and routes each message by channel. A
connection per stream would hold one of the client's pool for the stream's whole
life (the pool's size would cap concurrent streams, as in an HTTP gateway), and
each stream would wait on its own socket: one reader for all of them takes a
quarter to a third less CPU per event (docs/performance.md, "Reading a stream").

If the connection drops, the task subscribes every channel again on a new one
and sends each stream back to its replay log for what was published meanwhile
(a stream whose log read fails, Redis being down, ends with that error).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque

from redis.asyncio import Redis as AsyncRedis
from redis.asyncio.client import PubSub
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

READ_POLL_S = 1.0  # the reading task's wait for a message before it looks again
LOST = (RedisConnectionError, RedisTimeoutError, OSError)  # a connection that dropped


class StreamSubscriber:
    """Channels subscribed while a stream reads them, over one connection.

    A stream's mailbox receives its channel's messages (redis-py's dicts) in
    order, and ``None`` where messages may have been lost (the reader then
    reads its log, as after a quiet wait).
    """

    def __init__(self, redis: AsyncRedis):
        self._redis = redis
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pubsub: PubSub | None = None
        self._mailboxes: dict[bytes, set[Mailbox]] = {}
        self._task: asyncio.Task | None = None
        self._lock: asyncio.Lock | None = None

    def _bind(self) -> None:
        """Start afresh in a new event loop (a client may serve one ``asyncio.run``
        after another; a connection and a task belong to the loop that made them)."""
        loop = asyncio.get_running_loop()
        if loop is not self._loop:
            self._loop, self._pubsub, self._mailboxes, self._task = loop, None, {}, None
            # subscribe / unsubscribe commands in the order their callers' bookkeeping
            # changed: a channel's last reader leaving and a new one arriving must not
            # reach Redis as SUBSCRIBE then UNSUBSCRIBE
            self._lock = asyncio.Lock()

    async def subscribe(self, channel: str) -> "Mailbox":
        """A mailbox of ``channel``'s messages from now on: the SUBSCRIBE is sent
        before this returns, so a reader may read the channel's log after it and
        miss nothing."""
        self._bind()
        mailbox, key = Mailbox(), channel.encode()
        async with self._lock:
            if self._pubsub is None:
                self._pubsub = self._redis.pubsub(ignore_subscribe_messages=True)
            first = key not in self._mailboxes
            self._mailboxes.setdefault(key, set()).add(mailbox)
            if first:
                try:
                    await self._pubsub.subscribe(channel)
                except BaseException:
                    self._forget(key, mailbox)
                    raise
            if self._task is None or self._task.done():
                self._task = asyncio.get_running_loop().create_task(self._read())
        return mailbox

    async def unsubscribe(self, channel: str, mailbox: "Mailbox") -> None:
        """``mailbox`` no longer reads ``channel``; the last one unsubscribes it."""
        self._bind()
        async with self._lock:
            if self._forget(channel.encode(), mailbox) and self._pubsub is not None:
                with contextlib.suppress(*LOST):  # a dropped connection took its subscriptions along
                    await self._pubsub.unsubscribe(channel)

    def _forget(self, key: bytes, mailbox: "Mailbox") -> bool:
        """Drop ``mailbox`` from ``key``'s readers; True if it was the last."""
        mailboxes = self._mailboxes.get(key)
        if mailboxes is None:
            return False
        mailboxes.discard(mailbox)
        if mailboxes:
            return False
        del self._mailboxes[key]
        return True

    async def _read(self) -> None:
        """Route messages while any channel is subscribed."""
        while self._mailboxes and self._pubsub is not None:
            try:
                message = await self._pubsub.get_message(timeout=READ_POLL_S)
            except LOST:
                await self._resubscribe()
                continue
            if message is not None:
                for mailbox in self._mailboxes.get(message["channel"], ()):
                    mailbox.put(message)

    async def _resubscribe(self) -> None:
        """Every channel subscribed again on a new connection, each stream sent to
        its log meanwhile; retried with a growing pause while Redis is away."""
        pause = 0.05
        while True:
            async with self._lock:
                broken = self._pubsub
                if broken is None or not self._mailboxes:
                    return
                for mailboxes in self._mailboxes.values():
                    for mailbox in mailboxes:
                        mailbox.put(None)
                fresh = self._redis.pubsub(ignore_subscribe_messages=True)
                try:
                    await fresh.subscribe(*(key.decode() for key in self._mailboxes))
                except LOST:
                    with contextlib.suppress(Exception):
                        await fresh.aclose()
                else:
                    self._pubsub = fresh
                    with contextlib.suppress(Exception):
                        await broken.aclose()
                    return
            await asyncio.sleep(pause)
            pause = min(2 * pause, READ_POLL_S)

    async def aclose(self) -> None:
        """Stop reading and close the connection."""
        if self._loop is not asyncio.get_running_loop():
            self._loop = None  # what there is belongs to another loop
            return
        task, pubsub = self._task, self._pubsub
        self._task, self._pubsub, self._mailboxes = None, None, {}
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if pubsub is not None:
            await pubsub.aclose()


class Mailbox:
    """One stream's messages, in order: an ``asyncio.Queue`` with a cheap timed
    get (``asyncio.wait_for`` made a task and a timeout per message, as much CPU
    as reading the message)."""

    def __init__(self) -> None:
        self._items: deque = deque()
        self._waiter: asyncio.Future | None = None

    def put(self, item: dict | None) -> None:
        """A message, or None: messages may have been lost."""
        self._items.append(item)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def get(self, wait: float) -> dict | None:
        """The next message within ``wait`` seconds, else None (as for a lost one)."""
        if not self._items:
            loop = asyncio.get_running_loop()
            self._waiter = waiter = loop.create_future()
            timer = loop.call_later(wait, _wake, waiter)
            try:
                await waiter
            finally:
                timer.cancel()
                self._waiter = None
            if not self._items:
                return None
        return self._items.popleft()


def _wake(waiter: asyncio.Future) -> None:
    if not waiter.done():
        waiter.set_result(None)
