"""Reliability of the service: cancel, deadlines, backpressure, worker crash
and shutdown, Redis restart (real Redis, real SmolLM2, worker subprocesses)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time

import pytest
from redis import Redis
from rq import Queue
from rq.job import Job
from rq.serializers import JSONSerializer

from kiviq.client import Client, QueueFull
from kiviq.client.local_redis import free_port
from kiviq.jobs.keys import queue_name, replay_log

FAST_RECOVERY = {"KIVIQ_ALIVE_TTL_S": "3", "KIVIQ_RECOVERY_EVERY_S": "1"}
PROMPTS = [f"Write a short note about the number {i}." for i in range(50)]


def wait_for(predicate, timeout: float, what: str, every: float = 0.1):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(every)


def count_done_events(conn: Redis, job_id: str) -> int:
    return sum(b'"type":"done"' in raw for raw in conn.lrange(replay_log(job_id), 0, -1))


def test_cancel_queued_job(redis_url, redis_conn):
    client = Client(redis_url)
    handle = client.submit(prompt="never runs", max_tokens=4)
    assert client.cancel(handle.job_id)
    result = handle.result(timeout=10)
    assert result.finish_reason.value == "cancelled" and result.text == ""
    assert handle.status() == "canceled"
    assert Queue(queue_name("default"), connection=redis_conn).count == 0
    assert not client.cancel(handle.job_id)  # already ended


def test_cancel_running_job_and_keep_serving(worker_process, redis_url):
    client = Client(redis_url)
    handle = client.submit(prompt="Count from one to one thousand: one, two,", max_tokens=2000)
    stream = handle.stream(timeout=300)
    first = next(stream)  # it is running
    assert first
    assert subprocess.run([os.sys.executable, "-m", "kiviq.client.cli", "cancel", handle.job_id, "--redis-url", redis_url],
                          capture_output=True, text=True, cwd=os.path.dirname(os.path.dirname(__file__))).returncode == 0
    result = handle.result(timeout=60)
    assert result.finish_reason.value == "cancelled"
    assert 0 < result.usage.completion_tokens < 2000 and result.text.startswith(first)
    wait_for(lambda: handle.status() == "canceled", 10, "rq status canceled")
    after = client.submit(prompt="The capital of Italy is", max_tokens=4)
    assert after.result(timeout=120).usage.completion_tokens > 0


def test_deadline_ends_with_timeout_and_partial_text(worker_process, redis_url):
    handle = Client(redis_url).submit(prompt="Count from one to one thousand: one, two,", max_tokens=2000,
                                      timeout_s=2.0)
    result = handle.result(timeout=120)
    assert result.finish_reason.value == "timeout"
    assert 0 < result.usage.completion_tokens < 2000 and result.text


def test_backpressure_raises_queue_full_and_enqueues_nothing(redis_url, redis_conn):
    client = Client(redis_url, max_queued=2)
    client.submit(prompt="a", max_tokens=1)
    client.submit(prompt="b", max_tokens=1)
    with pytest.raises(QueueFull, match="limit 2"):
        client.submit(prompt="c", max_tokens=1)
    assert client.queued() == 2
    # The operator's limit, published by `kiviq worker --max-queued`, binds every client.
    redis_conn.set("kiviq:max-queued", 1)
    with pytest.raises(QueueFull):
        Client(redis_url).submit(prompt="d", max_tokens=1)


def test_sigkill_mid_batch_then_new_worker_completes_every_job_once(start_worker, redis_url, redis_conn,
                                                                     monkeypatch):
    for k, v in FAST_RECOVERY.items():
        monkeypatch.setenv(k, v)
    client = Client(redis_url)
    first = start_worker()
    handles = [client.submit(prompt=p, max_tokens=8) for p in PROMPTS]
    wait_for(lambda: sum(count_done_events(redis_conn, h.job_id) for h in handles) >= 5, 300, "a few results")
    first.send_signal(signal.SIGKILL)
    first.wait()
    started_when_killed = Queue(queue_name("default"), connection=redis_conn).started_job_registry.count
    start_worker()
    results = {h.job_id: h.result(timeout=600) for h in handles}
    assert started_when_killed > 0  # the kill really interrupted running sequences
    for h in handles:
        assert count_done_events(redis_conn, h.job_id) == 1
        assert redis_conn.xlen(f"rq:results:{h.job_id}") == 1  # the result was written exactly once
    # Texts equal an uninterrupted run of the same prompts.
    again = [client.submit(prompt=p, max_tokens=8) for p in PROMPTS]
    for h, h2 in zip(handles, again):
        assert results[h.job_id].text == h2.result(timeout=600).text


# A worker that dies the moment after it took a job off the queue, before
# anything else records the job (the gap rq's own LPOP dequeue leaves open).
DIE_AFTER_CLAIM = """
import os, sys
from kiviq.worker import claims
take = claims.claim_next
def claim_then_die(*args, **kwargs):
    found = take(*args, **kwargs)
    if found is not None:
        os._exit(9)
    return found
claims.claim_next = claim_then_die
from kiviq.worker.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_worker_killed_right_after_taking_a_job_loses_nothing(start_worker, redis_url, monkeypatch):
    for k, v in FAST_RECOVERY.items():
        monkeypatch.setenv(k, v)
    handle = Client(redis_url).submit(prompt="The capital of Italy is", max_tokens=4)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    dying = subprocess.run([os.sys.executable, "-c", DIE_AFTER_CLAIM, "--redis-url", redis_url],
                           cwd=root, env=dict(os.environ, PYTHONPATH=root), capture_output=True, text=True,
                           timeout=300)
    assert dying.returncode == 9, dying.stdout[-2000:] + dying.stderr[-2000:]
    assert Client(redis_url).queued() == 0  # the job left the queue with the dead worker
    start_worker()
    result = handle.result(timeout=300)
    assert result.finish_reason.value == "length" and result.usage.completion_tokens == 4


def test_sigterm_finishes_or_requeues_and_exits_zero(start_worker, redis_url, redis_conn):
    client = Client(redis_url)
    worker = start_worker("--grace", "2")
    short = [client.submit(prompt=p, max_tokens=3) for p in PROMPTS[:3]]
    long = [client.submit(prompt=f"Count from one to one thousand, {i}: one, two,", max_tokens=3000)
            for i in range(3)]
    wait_for(lambda: all(count_done_events(redis_conn, h.job_id) for h in short), 300, "short jobs")
    worker.send_signal(signal.SIGTERM)
    assert worker.wait(timeout=60) == 0
    statuses = [Job.fetch(h.job_id, connection=redis_conn, serializer=JSONSerializer).get_status().value
                for h in long]
    assert set(statuses) <= {"queued", "finished"} and "queued" in statuses  # finished or requeued, never lost
    start_worker()
    for h, status in zip(long, statuses):
        if status == "queued":
            wait_for(lambda: h.status() == "started", 120, "requeued job to run again")
            client.cancel(h.job_id)  # no need to generate 3000 tokens: it is back and running
        assert h.result(timeout=120).finish_reason.value in ("cancelled", "length", "stop")


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs a redis-server binary to restart")
def test_redis_restart_mid_run_loses_no_job(start_worker, monkeypatch):
    port, workdir = free_port(), tempfile.mkdtemp(prefix="kiviq-redis-")
    cmd = ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--dir", workdir, "--save", "",
           "--appendonly", "yes", "--appendfsync", "always"]
    url = f"redis://127.0.0.1:{port}/0"
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL)
    try:
        wait_for(lambda: _pings(url), 10, "test redis")
        conn = Redis.from_url(url)
        log = open(os.path.join(workdir, "worker.log"), "w+")
        worker = subprocess.Popen([os.sys.executable, "-m", "kiviq.worker", "--redis-url", url],
                                  cwd=os.path.dirname(os.path.dirname(__file__)),
                                  env=dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(__file__))),
                                  stdout=subprocess.DEVNULL, stderr=log)
        try:
            wait_for(lambda: _workers(conn) > 0, 180, "worker")
            client = Client(url)
            handles = [client.submit(prompt=p, max_tokens=24) for p in PROMPTS[:8]]
            wait_for(lambda: sum(count_done_events(conn, h.job_id) for h in handles) >= 1, 300, "first result")
            server.kill()
            server.wait()
            time.sleep(1.0)
            server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL)
            wait_for(lambda: _pings(url), 10, "restarted redis")
            for h in handles:
                assert h.result(timeout=300).finish_reason.value in ("stop", "length")
            assert worker.poll() is None
        finally:
            worker.terminate()
            try:
                worker.wait(timeout=30)
            except subprocess.TimeoutExpired:
                worker.kill()
                worker.wait()
                log.seek(0)
                pytest.fail("the worker did not exit within 30 s of SIGTERM; its log ends:\n"
                            + "".join(log.readlines()[-25:]))
            finally:
                log.close()
    finally:
        server.kill()
        server.wait()
        shutil.rmtree(workdir, ignore_errors=True)


def _pings(url: str) -> bool:
    try:
        return Redis.from_url(url, socket_connect_timeout=0.5).ping()
    except Exception:
        return False


def _workers(conn: Redis) -> int:
    from rq import Worker

    return len(Worker.all(connection=conn))


def test_job_whose_final_event_exists_is_recorded_not_rerun(worker_process, redis_url, redis_conn):
    """A worker killed between publishing a job's final event and recording
    it in rq: the requeued job is recorded from that event, not generated twice."""
    from kiviq.jobs.models import EventType, GenerationResult, StreamEvent, Usage
    from kiviq.jobs.publisher import EventPublisher

    queue = Queue(queue_name("low"), connection=redis_conn, serializer=JSONSerializer)
    # Made, not queued, while its "earlier run" is written (the idle worker polls its queues).
    job = queue.create_job("kiviq.jobs.tasks.generate", args=({"prompt": "x", "max_tokens": 3},), timeout=-1)
    result = GenerationResult(job_id=job.id, text="earlier run", token_ids=[1, 2], finish_reason="length",
                              usage=Usage(prompt_tokens=1, completion_tokens=2))
    EventPublisher(redis_conn).publish([
        StreamEvent(job_id=job.id, seq=0, type=EventType.token, text="earlier run", token_ids=[1, 2]),
        StreamEvent(job_id=job.id, seq=1, type=EventType.done, finish_reason="length", result=result)])
    queue.enqueue_job(job)
    wait_for(lambda: job.get_status(refresh=True).value == "finished", 60, "job recorded")
    assert count_done_events(redis_conn, job.id) == 1
    assert job.latest_result().return_value["text"] == "earlier run"


def _kv_used(port: int) -> float:
    import urllib.request

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return next(float(line.split()[-1]) for line in text.splitlines() if line.startswith("kiviq:kv_cache_used_bytes"))


def test_cancel_and_timeout_free_kv_memory(start_worker, redis_url):
    port = free_port()
    start_worker("--metrics-port", str(port))
    client = Client(redis_url)
    client.submit(prompt="Hi", max_tokens=1).result(timeout=120)
    before = _kv_used(port)
    long_prompt = "Count from one to one thousand: one, two,"
    running = client.submit(prompt=long_prompt, max_tokens=2000)
    next(running.stream(timeout=120))
    assert _kv_used(port) > before  # the running sequence holds KV memory
    client.cancel(running.job_id)
    assert running.result(timeout=60).finish_reason.value == "cancelled"
    wait_for(lambda: _kv_used(port) == before, 10, "KV freed after cancel")
    timed = client.submit(prompt=long_prompt, max_tokens=2000, timeout_s=1.5)
    assert timed.result(timeout=60).finish_reason.value == "timeout"
    wait_for(lambda: _kv_used(port) == before, 10, "KV freed after timeout")


def test_oversized_payload_fails_at_submit_or_alone_on_the_worker(worker_process, redis_url, redis_conn):
    from kiviq.client import InvalidRequest

    with pytest.raises(InvalidRequest, match="prompt"):
        Client(redis_url).submit(prompt="x" * 1_000_001)
    queue = Queue(queue_name("default"), connection=redis_conn, serializer=JSONSerializer)
    bad = queue.enqueue_call("kiviq.jobs.tasks.generate", args=({"prompt": "x" * 1_000_001},), timeout=-1)
    good = Client(redis_url).submit(prompt="Hello", max_tokens=2)
    assert good.result(timeout=120).finish_reason.value in ("stop", "length")
    with pytest.raises(Exception, match="prompt"):
        Client(redis_url).job(bad.id).result(timeout=30)


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs a redis-server binary")
def test_password_protected_redis_and_no_credentials_in_logs(start_worker, monkeypatch):
    port, secret = free_port(), "s3cret-pass-word"
    server = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                               "--appendonly", "no", "--requirepass", secret], stdout=subprocess.DEVNULL)
    try:
        url = f"redis://:{secret}@127.0.0.1:{port}/0"
        wait_for(lambda: _pings(url), 10, "password redis")
        worker = subprocess.Popen([os.sys.executable, "-m", "kiviq.worker", "--redis-url", url],
                                  cwd=os.path.dirname(os.path.dirname(__file__)),
                                  env=dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(__file__))),
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            handle = Client(url).submit(prompt="Hello", max_tokens=2)
            assert handle.result(timeout=180).finish_reason.value in ("stop", "length")
        finally:
            worker.terminate()
            log = worker.communicate(timeout=30)[0]
        assert secret not in log and "admitted" in log
        with pytest.raises(Exception):
            Redis.from_url(f"redis://127.0.0.1:{port}/0").ping()  # the password is really required
    finally:
        server.kill()
        server.wait()
