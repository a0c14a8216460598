"""AsyncClient: the stream protocol on fakeredis, validation and idempotency
on the real Redis, and end to end against a real worker (same result as the
sync client for a greedy prompt)."""

from __future__ import annotations

import asyncio
import threading
import time

import fakeredis
import pytest
import redis.asyncio as aioredis
from rq import Queue
from rq.serializers import JSONSerializer

from kiviq.client import AsyncClient, Client, InvalidRequest, JobFailed
from kiviq.client.async_client import aiter_events, aiter_text, sync_redis_like
from kiviq.jobs.keys import queue_name
from kiviq.jobs.models import EventType, StreamEvent
from kiviq.jobs.publisher import EventPublisher


def ev(seq, type_="token", text="", **kw):
    return StreamEvent(job_id="j1", seq=seq, type=EventType(type_), text=text, **kw)


async def collect(aiterable):
    return [x async for x in aiterable]


# ---- the stream protocol (fakeredis) -------------------------------------


@pytest.fixture
def fake_pair():
    server = fakeredis.FakeServer()
    return fakeredis.FakeRedis(server=server), fakeredis.FakeAsyncRedis(server=server)


def test_late_subscriber_and_restart_dedupe(fake_pair):
    sync, conn = fake_pair
    EventPublisher(sync).publish([ev(0, text="The "), ev(1, text="sky"), ev(2, "restarted"), ev(3, text="The "),
                                  ev(4, text="sky"), ev(5, text=" is"), ev(6, "done", finish_reason="stop")])

    async def main():
        events = await collect(aiter_events(conn, "j1", timeout=5))
        deltas = await collect(aiter_text(aiter_events(conn, "j1", timeout=5)))
        return events, deltas

    events, deltas = asyncio.run(main())
    assert [e.seq for e in events] == list(range(7))
    assert deltas == ["The ", "sky", " is"]


def test_live_events_in_order_exactly_once(fake_pair):
    sync, conn = fake_pair
    pub = EventPublisher(sync)
    pub.publish([ev(0, text="a")])

    def produce():
        for i in range(1, 15):
            time.sleep(0.005)
            pub.publish([ev(i, text=chr(ord("a") + i))])
        pub.publish([ev(15, "done", finish_reason="length")])

    t = threading.Thread(target=produce)
    t.start()
    events = asyncio.run(collect(aiter_events(conn, "j1", timeout=10)))
    t.join()
    assert [e.seq for e in events] == list(range(16))


def test_a_missed_message_is_read_from_the_log_and_live_events_are_not(fake_pair, monkeypatch):
    """Live events come from their channel messages (the log read once at the
    start, and once for a subscribe confirmation); a message that skips a seq
    sends the reader to the log from the seq it expects."""
    from kiviq.jobs.keys import replay_log

    sync, conn = fake_pair
    pub = EventPublisher(sync)
    pub.publish([ev(0, text="a")])
    reads, real = [], conn.lrange

    async def lrange(key, start, end):
        reads.append(start)
        return await real(key, start, end)

    monkeypatch.setattr(conn, "lrange", lrange)

    async def main():
        it = aiter_events(conn, "j1", timeout=5)
        got = [await it.__anext__()]
        for i in range(1, 11):
            pub.publish([ev(i, text="b")])
            got.append(await it.__anext__())
        live_reads = len(reads)
        sync.rpush(replay_log("j1"), ev(11, text="c").model_dump_json())  # logged, its message lost
        pub.publish([ev(12, text="d")])
        pub.publish([ev(13, "done", finish_reason="stop")])
        return got + await collect(it), live_reads

    events, live_reads = asyncio.run(main())
    assert [e.seq for e in events] == list(range(14))
    assert events[11].text == "c"
    assert live_reads <= 2, reads
    assert 11 in reads


def test_error_and_timeout(fake_pair):
    sync, conn = fake_pair
    EventPublisher(sync).publish([ev(0, text="x"), ev(1, "error", error="boom")])
    with pytest.raises(JobFailed, match="boom"):
        asyncio.run(collect(aiter_text(aiter_events(conn, "j1", timeout=5))))
    client = AsyncClient(connection=conn, sync_connection=sync)
    with pytest.raises(JobFailed, match="boom"):
        asyncio.run(client.job("j1").result(timeout=5))
    EventPublisher(sync).publish([StreamEvent(job_id="j2", seq=0, type=EventType.token, text="x")])
    with pytest.raises(TimeoutError):
        asyncio.run(client.job("j2").result(timeout=0.3))


def test_sync_redis_like_targets_the_same_database(redis_url):
    async def main():
        conn = aioredis.Redis.from_url(redis_url, decode_responses=True, socket_timeout=9)
        await conn.set("probe", "v")
        sync = sync_redis_like(conn)
        try:
            return sync.get("probe"), sync.connection_pool.connection_kwargs
        finally:
            sync.close()
            await conn.aclose()

    value, kwargs = asyncio.run(main())
    assert value == b"v"  # bytes: rq needs undecoded replies
    assert kwargs["db"] == 15 or redis_url.endswith(f"/{kwargs['db']}")
    assert kwargs["socket_timeout"] == 9


# ---- real Redis ----------------------------------------------------------


def test_invalid_async_submit_names_field_and_touches_nothing(redis_url, redis_conn):
    cases = {
        "max_tokens": dict(prompt="hi", max_tokens=0),
        "temperature": dict(prompt="hi", temperature=-0.5),
        "bogus_field": dict(prompt="hi", bogus_field=1),
        "messages": dict(messages=[]),
    }

    async def main():
        async with AsyncClient(redis_url) as client:
            for field, kwargs in cases.items():
                with pytest.raises(InvalidRequest) as info:
                    await client.submit(**kwargs)
                assert field in str(info.value) and field in info.value.fields

    asyncio.run(main())
    assert redis_conn.dbsize() == 0


def test_idempotency_key_returns_the_existing_job(redis_url, redis_conn):
    async def main():
        async with AsyncClient(redis_url) as client:
            a = await client.submit(prompt="hi", max_tokens=2, idempotency_key="same-key")
            b = await client.submit(prompt="hi", max_tokens=2, idempotency_key="same-key")
            return a.job_id, b.job_id, await a.status()

    a, b, status = asyncio.run(main())
    assert a == b and status == "queued"
    queue = Queue(queue_name("default"), connection=redis_conn, serializer=JSONSerializer)
    assert queue.job_ids == [a]
    # Byte-for-byte the sync client's job: the sync client finds it by the same key.
    assert Client(redis_url).submit(prompt="hi", max_tokens=2, idempotency_key="same-key").job_id == a


def test_async_matches_sync_end_to_end(worker_process, redis_url):
    prompt = "The three primary colors are"
    sync_result = Client(redis_url).submit(prompt=prompt, max_tokens=6).result(timeout=300)

    async def main():
        async with AsyncClient(redis_url) as client:
            handle = await client.submit(prompt=prompt, max_tokens=6)
            streamed = "".join([d async for d in handle.stream(timeout=300)])
            result = await handle.result(timeout=300)
            events = [e async for e in client.job(handle.job_id).events(timeout=10)]
            # Two coroutines on two jobs at once (one passes its own connection).
            conn = aioredis.Redis.from_url(redis_url)
            other = AsyncClient(connection=conn)
            h1, h2 = await asyncio.gather(client.submit(prompt=prompt, max_tokens=6),
                                          other.submit(messages=[{"role": "user", "content": "Hi"}], max_tokens=3))
            r1, r2 = await asyncio.gather(h1.result(timeout=300), h2.result(timeout=300))
            await other.aclose()
            await conn.aclose()
            return handle, streamed, result, events, r1, r2

    handle, streamed, result, events, r1, r2 = asyncio.run(main())
    assert result.job_id == handle.job_id
    assert result.token_ids == sync_result.token_ids and result.text == sync_result.text
    assert streamed == result.text
    assert [e.seq for e in events] == list(range(len(events))) and events[-1].type == EventType.done
    assert r1.token_ids == sync_result.token_ids
    assert 0 < r2.usage.completion_tokens <= 3


def test_many_concurrent_streams_share_a_bounded_pool(redis_url, redis_conn):
    """More streams at once than redis-py's default async pool holds (each stream
    keeps a pub/sub connection while it runs): all complete, none raises
    MaxConnectionsError."""
    n = 160
    pub = EventPublisher(redis_conn)

    async def main():
        async with AsyncClient(redis_url) as client:
            tasks = [asyncio.create_task(collect(aiter_events(client.redis, f"many-{i}", timeout=30)))
                     for i in range(n)]
            await asyncio.sleep(0.5)
            for i in range(n):
                pub.publish([StreamEvent(job_id=f"many-{i}", seq=0, type=EventType.token, text="x"),
                             StreamEvent(job_id=f"many-{i}", seq=1, type=EventType.done, finish_reason="stop")])
            return await asyncio.gather(*tasks)

    results = asyncio.run(main())
    assert [len(r) for r in results] == [2] * n


def test_pool_size_and_wait_timeout_are_the_callers(redis_url):
    """With every connection held by a stream, a command waits ``pool_timeout``
    seconds for one, then fails; by default the pool is MAX_CONNECTIONS
    wide and a command waits as long as it takes."""
    from redis.exceptions import ConnectionError as RedisConnectionError

    from kiviq.client.async_client import MAX_CONNECTIONS

    async def main():
        async with AsyncClient(redis_url) as default:
            pool = default.redis.connection_pool
            assert (pool.max_connections, pool.timeout) == (MAX_CONNECTIONS, None)
            assert default.sync.redis.connection_pool.max_connections == MAX_CONNECTIONS
        async with AsyncClient(redis_url, max_connections=1, pool_timeout=0.3) as client:
            pubsub = client.redis.pubsub()
            await pubsub.subscribe("held")  # holds the only connection, as a stream does
            started = time.monotonic()
            with pytest.raises(RedisConnectionError):
                await client.redis.get("anything")
            waited = time.monotonic() - started
            await pubsub.aclose()
            assert await client.redis.get("anything") is None  # free again
            return waited

    assert 0.25 < asyncio.run(main()) < 3


def job_event(job_id: str, seq: int, type_: str = "token") -> StreamEvent:
    """Event ``seq`` of ``job_id``, its text the seq; a ``done`` one ends with stop."""
    return StreamEvent(job_id=job_id, seq=seq, type=EventType(type_), text=f"{seq}",
                       finish_reason="stop" if type_ == "done" else None)


async def wait_subscribed(redis_conn, channels: list[str], timeout: float = 10.0) -> None:
    """Wait until every channel has a subscriber."""
    deadline = time.monotonic() + timeout
    while any(c == 0 for _, c in redis_conn.pubsub_numsub(*channels)):
        assert time.monotonic() < deadline, "the streams did not all subscribe"
        await asyncio.sleep(0.01)


def test_a_clients_streams_share_one_pubsub_connection(redis_url, redis_conn):
    """Forty streams of one client at once through a pool of three connections:
    they share one pub/sub connection (a stream holding its own would wait for
    the pool, then fail), every stream gets its events, and the channels are
    unsubscribed as the streams end."""
    from kiviq.jobs.keys import event_channel

    n, pub = 40, EventPublisher(redis_conn)
    ids = [f"shared-{i}" for i in range(n)]

    async def main():
        async with AsyncClient(redis_url, max_connections=3, pool_timeout=5) as client:
            tasks = [asyncio.create_task(collect(client.job(j).events(timeout=30))) for j in ids]
            await wait_subscribed(redis_conn, [event_channel(j) for j in ids])
            for seq in range(5):
                pub.publish([job_event(j, seq) for j in ids])
                await asyncio.sleep(0.01)
            pub.publish([job_event(j, 5, "done") for j in ids])
            streams = await asyncio.gather(*tasks)
            deadline = time.monotonic() + 5  # the UNSUBSCRIBEs go out as the streams end
            while any(c for _, c in redis_conn.pubsub_numsub(*[event_channel(j) for j in ids])) \
                    and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            return streams, redis_conn.pubsub_numsub(*[event_channel(j) for j in ids])

    streams, subscribed = asyncio.run(main())
    assert [[e.seq for e in s] for s in streams] == [list(range(6))] * n
    assert all(count == 0 for _, count in subscribed)


def test_streams_survive_their_pubsub_connection_being_killed(redis_url, redis_conn):
    """Redis drops the shared pub/sub connection mid-stream: redis-py reconnects
    and resubscribes, and each stream finds what it missed in its log (a skipped
    seq, or a quiet second), in order and exactly once."""
    from kiviq.jobs.keys import event_channel

    ids = [f"killed-{i}" for i in range(8)]
    pub = EventPublisher(redis_conn)

    async def main():
        async with AsyncClient(redis_url) as client:
            tasks = [asyncio.create_task(collect(client.job(j).events(timeout=30))) for j in ids]
            await wait_subscribed(redis_conn, [event_channel(j) for j in ids])
            pub.publish([job_event(j, 0) for j in ids])
            await asyncio.sleep(0.1)
            assert redis_conn.client_kill_filter(_type="pubsub") >= 1
            pub.publish([job_event(j, 1) for j in ids])  # published while no one listens
            await asyncio.sleep(0.1)
            pub.publish([job_event(j, 2) for j in ids])
            pub.publish([job_event(j, 3, "done") for j in ids])
            return await asyncio.gather(*tasks)

    streams = asyncio.run(main())
    assert [[e.seq for e in s] for s in streams] == [[0, 1, 2, 3]] * len(ids)


def test_two_readers_of_one_job_and_one_that_leaves_early(redis_url, redis_conn):
    """Readers of the same job in one client each get every event; one that stops
    reading early leaves the channel to the other, and the last one unsubscribes it."""
    from kiviq.jobs.keys import event_channel

    pub = EventPublisher(redis_conn)
    channel = event_channel("twice")

    async def first_two(events) -> list[int]:
        seqs = []
        async for e in events:
            seqs.append(e.seq)
            if len(seqs) == 2:
                break
        await events.aclose()
        return seqs

    async def main():
        async with AsyncClient(redis_url) as client:
            reads, real = [], client.redis.lrange

            async def lrange(key, start, end):
                reads.append(start)
                return await real(key, start, end)

            client.redis.lrange = lrange
            whole = asyncio.create_task(collect(client.job("twice").events(timeout=30)))
            early = asyncio.create_task(first_two(client.job("twice").events(timeout=30)))
            await wait_subscribed(redis_conn, [channel])
            await asyncio.sleep(0.05)  # both readers subscribed (one connection, one subscription)
            for seq in range(4):
                pub.publish([job_event("twice", seq)])
                await asyncio.sleep(0.02)
            pub.publish([job_event("twice", 4, "done")])
            results = await whole, await early
            deadline = time.monotonic() + 5  # the last UNSUBSCRIBE goes out as the stream ends
            while redis_conn.pubsub_numsub(channel)[0][1] and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            return (*results, redis_conn.pubsub_numsub(channel)[0][1], reads)

    whole, early, still_subscribed, reads = asyncio.run(main())
    assert [e.seq for e in whole] == [0, 1, 2, 3, 4]
    assert early == [0, 1]
    assert reads == [0, 0]  # each reader's first log read, then every event live
    assert still_subscribed == 0
