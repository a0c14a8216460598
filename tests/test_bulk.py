"""Bulk JSONL generation runs: resume and --retry-failed (fakeredis with a fake
worker thread), the CLI's summary and exit status, and end to end with a real
worker, including a SIGKILLed run that is rerun. Parsing, mapping and output
records alone: test_bulk_format.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import fakeredis
import pytest
from rq.job import Job
from rq.registry import FinishedJobRegistry
from rq.serializers import JSONSerializer

from kiviq.client import Client, InvalidRequest
from kiviq.client.bulk import run_bulk
from kiviq.client.bulk_format import error_record, idempotency_key, ok_record, parse_line
from kiviq.client.cli import main as cli_main
from kiviq.jobs.keys import job_id_for_idempotency_key, max_queued_key, queue_name, queue_names, replay_log
from kiviq.jobs.models import EventType, FinishReason, GenerationResult, StreamEvent, Usage
from kiviq.jobs.publisher import EventPublisher
from bulk_records import done_event, line_of, read_out, sample_result, text_of, validate_record, write_jsonl

ROOT = Path(__file__).resolve().parents[1]


def test_progress_default_is_quiet_when_stderr_is_not_a_terminal(tmp_path, fake_conn, capsys):
    src = write_jsonl(tmp_path / "in.jsonl", ['{"prompt": "broken'])  # an error line: no worker needed
    summary = run_bulk(Client(connection=fake_conn), str(src), str(tmp_path / "out.jsonl"))
    assert summary.failed == 1 and capsys.readouterr().err == ""
    run_bulk(Client(connection=fake_conn), str(src), str(tmp_path / "out2.jsonl"), progress=True)
    assert "bulk: 100%" in capsys.readouterr().err


def test_invalid_defaults_raise():
    with pytest.raises(InvalidRequest, match="max_tokens"):
        Client(connection=fakeredis.FakeRedis()).bulk("nope.jsonl", "out.jsonl", defaults={"max_tokens": 0})
    with pytest.raises(InvalidRequest, match="prompt"):
        Client(connection=fakeredis.FakeRedis()).bulk("nope.jsonl", "out.jsonl", defaults={"prompt": "x"})


# ---- the run loop against fakeredis and a fake worker --------------------


class FakeWorker(threading.Thread):
    """Pops jobs from the kiviq queues and ends each with a done event
    ('echo: <prompt>'), or an error event when the prompt says FAIL (while
    ``fail`` is set); sets the rq status as a worker would."""

    def __init__(self, conn):
        super().__init__(daemon=True)
        self.conn = conn
        self.ran: list[str] = []
        self.fail = True
        self.stop = threading.Event()

    def run(self):
        pub = EventPublisher(self.conn)
        keys = [f"rq:queue:{n}" for n in queue_names()]
        while not self.stop.is_set():
            popped = self.conn.blpop(keys, timeout=0.05)
            if popped is None:
                continue
            job_id = popped[1].decode()
            self.ran.append(job_id)
            request = Job.fetch(job_id, connection=self.conn, serializer=JSONSerializer).args[0]
            prompt = request.get("prompt") or request["messages"][-1]["content"]
            seq = pub.next_seq(job_id)
            if "FAIL" in prompt and self.fail:
                pub.publish([StreamEvent(job_id=job_id, seq=seq, type=EventType.error, error="boom")])
                self.conn.hset(Job.key_for(job_id), "status", "failed")
                continue
            text = f"echo: {prompt}"[: 6 + request.get("max_tokens", 256)]
            result = GenerationResult(job_id=job_id, text=text, token_ids=[1, 2], finish_reason=FinishReason.length,
                                      usage=Usage(prompt_tokens=3, completion_tokens=2))
            pub.publish([StreamEvent(job_id=job_id, seq=seq, type=EventType.token, text=text, token_ids=[1, 2]),
                         StreamEvent(job_id=job_id, seq=seq + 1, type=EventType.done,
                                     finish_reason=FinishReason.length, result=result)])
            self.conn.hset(Job.key_for(job_id), "status", "finished")


@pytest.fixture
def fake_server():
    return fakeredis.FakeServer()


@pytest.fixture
def fake_conn(fake_server):
    return fakeredis.FakeRedis(server=fake_server)


@pytest.fixture
def fake_worker(fake_server):
    w = FakeWorker(fakeredis.FakeRedis(server=fake_server))
    w.start()
    yield w
    w.stop.set()
    w.join(timeout=5)


MIXED = [
    {"custom_id": "c1", "method": "POST", "url": "/v1/completions", "body": {"prompt": "one", "max_tokens": 4}},
    {"custom_id": "c2", "method": "POST", "url": "/v1/chat/completions",
     "body": {"model": "m", "messages": [{"role": "user", "content": "two"}], "max_completion_tokens": 4}},
    {"prompt": "three"},
    '{"prompt": "four", ',
    {"custom_id": "c5", "prompt": "five", "colour": "red"},
    {"custom_id": "c6", "prompt": "please FAIL"},
    {"custom_id": "c1", "prompt": "duplicate of c1"},
    {"messages": [{"role": "user", "content": "eight"}]},
]


def test_bulk_writes_one_line_per_input_line_fake(tmp_path, fake_conn, fake_worker):
    src = write_jsonl(tmp_path / "in.jsonl", MIXED[:6] + [""] + MIXED[6:])  # a blank line is ignored
    out = tmp_path / "out.jsonl"
    summary = Client(connection=fake_conn).bulk(str(src), str(out), max_in_flight=2, defaults={"max_tokens": 6},
                                                progress=False)
    records = read_out(out)
    for r in records:
        validate_record(r)
    by_line = {line_of(r): r for r in records}
    assert sorted(by_line) == [1, 2, 3, 4, 5, 6, 8, 9] and len(records) == 8
    assert by_line[1]["custom_id"] == "c1" and text_of(by_line[1]) == "echo: one"
    body = by_line[1]["response"]["body"]
    assert body["object"] == "text_completion" and body["model"] == "kiviq"
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    assert body["choices"][0]["finish_reason"] == "length"
    assert by_line[2]["response"]["body"]["object"] == "chat.completion"
    assert text_of(by_line[2]) == "echo: two" and by_line[2]["response"]["body"]["model"] == "m"
    assert by_line[3]["custom_id"] == "line-3" and text_of(by_line[3]) == "echo: three"
    assert by_line[4]["custom_id"] == "line-4" and by_line[4]["error"]["code"] == "invalid_json"
    assert by_line[5]["custom_id"] == "c5" and "colour" in by_line[5]["error"]["message"]
    assert by_line[6]["error"]["code"] == "job_failed" and "boom" in by_line[6]["error"]["message"]
    assert by_line[8]["error"]["code"] == "duplicate_custom_id" and by_line[8]["custom_id"] == "c1"
    assert by_line[9]["custom_id"] == "line-9" and text_of(by_line[9]) == "echo: eight"
    assert (summary.total, summary.ok, summary.failed, summary.skipped) == (8, 4, 4, 0)
    assert summary.completion_tokens == 8
    assert len(fake_worker.ran) == 5  # c1, c2, line-3, c6, line-9
    assert len({r["id"] for r in records}) == 8  # batch_req ids are unique

    # A rerun finds everything done: nothing is written or enqueued again, and
    # the summary still counts the earlier run's lines (failures included).
    again = Client(connection=fake_conn).bulk(str(src), str(out), progress=False)
    assert (again.ok, again.failed, again.skipped, again.retried) == (4, 4, 8, 0)
    assert read_out(out) == records and len(fake_worker.ran) == 5


def test_retry_failed_reruns_error_lines_and_keeps_one_line_per_custom_id(tmp_path, fake_conn, fake_worker):
    lines = [{"custom_id": "a", "prompt": "fine"},
             {"custom_id": "b", "prompt": "typo", "colour": "red"},
             {"custom_id": "c", "url": "/v1/chat/completions", "body": {
                 "model": "m", "messages": [{"role": "user", "content": "please FAIL"}]}}]
    src = write_jsonl(tmp_path / "in.jsonl", lines)
    out = tmp_path / "out.jsonl"
    client = Client(connection=fake_conn)
    first = run_bulk(client, str(src), str(out), progress=False)
    assert (first.ok, first.failed) == (1, 2) and len(fake_worker.ran) == 2
    a_line = read_out(out)[[r["custom_id"] for r in read_out(out)].index("a")]

    # The user fixes line b; the worker's trouble with c is gone. A plain rerun
    # still skips both (error lines count as done) and still reports them.
    lines[1] = {"custom_id": "b", "prompt": "fixed"}
    write_jsonl(src, lines)
    fake_worker.fail = False
    plain = run_bulk(client, str(src), str(out), progress=False)
    assert (plain.ok, plain.failed, plain.skipped) == (1, 2, 3) and len(fake_worker.ran) == 2

    retry = run_bulk(client, str(src), str(out), progress=False, retry_failed=True)
    assert (retry.ok, retry.failed, retry.skipped, retry.retried) == (3, 0, 1, 2)
    records = read_out(out)
    for r in records:
        validate_record(r)
    assert sorted(r["custom_id"] for r in records) == ["a", "b", "c"]  # replaced, not appended to
    assert all(r["error"] is None for r in records) and records[0] == a_line
    by_id = {r["custom_id"]: r for r in records}
    assert text_of(by_id["b"]) == "echo: fixed" and text_of(by_id["c"]) == "echo: please FAIL"
    # c's failed job was dropped and run again under the same idempotency key.
    assert len(fake_worker.ran) == 4 and fake_worker.ran.count(by_id["c"]["response"]["request_id"]) == 2
    assert run_bulk(client, str(src), str(out), progress=False, retry_failed=True).retried == 0


def test_rerun_reattaches_to_jobs_left_by_a_killed_run(tmp_path, fake_server, fake_conn):
    """Jobs a previous run enqueued (still queued, or already finished) are
    awaited, not enqueued again; done lines are skipped; a torn line is dropped."""
    src = write_jsonl(tmp_path / "in.jsonl", [{"custom_id": f"q{i}", "prompt": f"p{i}", "max_tokens": 3}
                                             for i in range(5)])
    client = Client(connection=fake_conn)
    lines = [parse_line(s, i + 1) for i, s in enumerate(src.read_text().splitlines())]
    # The "killed run": enqueued q0..q3, wrote q0's line and half of q1's.
    for line in lines[:4]:
        key = idempotency_key(str(src), line.custom_id, line.request)
        client.enqueue(line.request.model_copy(update={"idempotency_key": key}))
    out = tmp_path / "out.jsonl"
    out.write_text(json.dumps(ok_record(lines[0], done_event(sample_result()))) + "\n"
                   + '{"id": "batch_req_y", "custom_id": "q1", "re')
    worker = FakeWorker(fakeredis.FakeRedis(server=fake_server))
    worker.start()
    try:
        summary = client.bulk(str(src), str(out), max_in_flight=2, progress=False)
    finally:
        worker.stop.set()
        worker.join(timeout=5)
    assert [r["custom_id"] for r in read_out(out)][0] == "q0"
    assert sorted(r["custom_id"] for r in read_out(out)) == ["q0", "q1", "q2", "q3", "q4"]
    # ok counts q0's line from the killed run too; q1..q3 re-attached
    assert (summary.ok, summary.skipped, summary.reattached) == (5, 1, 3)
    assert len(worker.ran) == 5 and len(set(worker.ran)) == 5  # q0..q3 from the killed run, q4: each once


def test_queue_full_waits_instead_of_failing(tmp_path, fake_server, fake_conn, monkeypatch):
    """With the operator's queue limit reached, bulk waits and retries (the
    worker starts only after the first refusal), writing no error lines."""
    import kiviq.client.bulk as bulk
    from kiviq.client.client import QueueFull

    monkeypatch.setattr(bulk, "QUEUE_FULL_RETRY_S", 0.05)
    refusals = []
    enqueue = Client.enqueue

    def counting_enqueue(self, request):
        try:
            return enqueue(self, request)
        except QueueFull:
            refusals.append(request)
            if not worker.is_alive():
                worker.start()
            raise

    monkeypatch.setattr(Client, "enqueue", counting_enqueue)
    fake_conn.set(max_queued_key(), 1)
    worker = FakeWorker(fakeredis.FakeRedis(server=fake_server))
    src = write_jsonl(tmp_path / "in.jsonl", [{"prompt": f"p{i}", "max_tokens": 2} for i in range(4)])
    out = tmp_path / "out.jsonl"
    try:
        summary = Client(connection=fake_conn).bulk(str(src), str(out), progress=False)
    finally:
        worker.stop.set()
        if worker.is_alive():
            worker.join(timeout=5)
    assert summary.ok == 4 and summary.failed == 0 and refusals
    assert len(read_out(out)) == 4 and len(worker.ran) == 4


def test_vanished_job_is_an_error_line(tmp_path, fake_conn, monkeypatch):
    """A job deleted from Redis with no final event does not hang the run."""
    import kiviq.client.bulk as bulk

    monkeypatch.setattr(bulk, "SWEEP_EVERY_S", 0.05)
    src = write_jsonl(tmp_path / "in.jsonl", [{"custom_id": "gone", "prompt": "p", "max_tokens": 2}])
    line = parse_line(src.read_text().splitlines()[0], 1)
    job_id = job_id_for_idempotency_key(idempotency_key(str(src), "gone", line.request))

    def delete_soon():
        deadline = time.monotonic() + 5
        while not fake_conn.exists(Job.key_for(job_id)) and time.monotonic() < deadline:
            time.sleep(0.01)
        fake_conn.delete(Job.key_for(job_id))

    t = threading.Thread(target=delete_soon)
    t.start()
    summary = Client(connection=fake_conn).bulk(str(src), str(tmp_path / "out.jsonl"), progress=False)
    t.join()
    (record,) = read_out(tmp_path / "out.jsonl")
    assert summary.failed == 1 and "no longer exists" in record["error"]["message"]
    assert validate_record(record) is None and record["error"]["code"] == "job_failed"


# ---- the CLI: summary, exit status, nothing written when it cannot start --


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_cli(capsys, *argv: str) -> tuple[int, dict | None, str]:
    rc = cli_main(["bulk", *argv])
    captured = capsys.readouterr()
    return rc, (json.loads(captured.out) if captured.out.strip() else None), captured.err


@pytest.fixture
def redis_fake_worker(redis_url):
    """The fake worker on the suite's own redis-server (what the CLI connects to)."""
    from redis import Redis

    w = FakeWorker(Redis.from_url(redis_url))
    w.start()
    yield w
    w.stop.set()
    w.join(timeout=5)


def test_cli_summary_counts_earlier_runs_and_retry_failed_fixes(redis_url, redis_fake_worker, tmp_path, capsys):
    lines = [{"custom_id": "a", "prompt": "one"},
             {"custom_id": "b", "url": "/v1/completions", "body": {"prompt": "two", "temperature": -1}},
             {"custom_id": "c", "prompt": "FAIL now"},
             {"custom_id": "d", "messages": [{"role": "user", "content": "four"}]}]
    src = write_jsonl(tmp_path / "in.jsonl", lines)
    out = tmp_path / "out.jsonl"
    args = (str(src), str(out), "--redis-url", redis_url, "--no-progress")
    rc, summary, _ = run_cli(capsys, *args)
    assert rc == 1 and (summary["total"], summary["ok"], summary["failed"], summary["skipped"]) == (4, 2, 2, 0)

    # The same command again: nothing runs, but the failures are still counted and still exit 1.
    rc, summary, _ = run_cli(capsys, *args)
    assert rc == 1 and (summary["ok"], summary["failed"], summary["skipped"]) == (2, 2, 4)
    assert len(read_out(out)) == 4 and len(redis_fake_worker.ran) == 3

    lines[1]["body"]["temperature"] = 0.5  # the user fixes b; c's trouble is gone
    write_jsonl(src, lines)
    redis_fake_worker.fail = False
    rc, summary, _ = run_cli(capsys, *args, "--retry-failed")
    assert rc == 0, summary
    assert (summary["ok"], summary["failed"], summary["skipped"], summary["retried"]) == (4, 0, 2, 2)
    records = read_out(out)
    assert sorted(r["custom_id"] for r in records) == ["a", "b", "c", "d"]
    assert all(validate_record(r) is not None for r in records)
    rc, summary, _ = run_cli(capsys, *args)
    assert rc == 0 and (summary["ok"], summary["failed"], summary["skipped"]) == (4, 0, 4)


def test_cli_writes_nothing_when_redis_is_unreachable(tmp_path, capsys):
    src = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "x"}])
    out = tmp_path / "out.jsonl"
    url = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    rc, summary, err = run_cli(capsys, str(src), str(out), "--redis-url", url)
    assert rc == 1 and summary is None and not out.exists()
    assert err.startswith("kiviq: error: ") and err.count("\n") == 1 and "Redis" in err and "Traceback" not in err

    # An existing OUT (an error line to retry, a torn last line) is left byte for byte.
    failed = error_record(parse_line('{"prompt": "x"}', 1), "m", "job_failed")
    out.write_text(json.dumps(failed) + "\n" + '{"custom_id": "torn", "re')
    before, mtime = out.read_bytes(), out.stat().st_mtime_ns
    rc, _, _ = run_cli(capsys, str(src), str(out), "--redis-url", url, "--retry-failed")
    assert rc == 1 and out.read_bytes() == before and out.stat().st_mtime_ns == mtime
    assert sorted(os.listdir(tmp_path)) == ["in.jsonl", "out.jsonl"]

    # A missing input is a usage error, before Redis is even tried; OUT is not created.
    rc, _, err = run_cli(capsys, str(tmp_path / "missing.jsonl"), str(tmp_path / "new.jsonl"), "--redis-url", url)
    assert rc == 2 and "missing.jsonl" in err and not (tmp_path / "new.jsonl").exists()


# ---- end to end: real Redis, real worker --------------------------------


def bulk_cmd(redis_url: str, src: Path, out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "kiviq.client.cli", "bulk", str(src), str(out), "--redis-url", redis_url, *extra]


def test_bulk_end_to_end(worker_process, redis_url, tmp_path):
    mixed = [
        {"custom_id": "c1", "method": "POST", "url": "/v1/completions",
         "body": {"prompt": "The capital of France is", "max_tokens": 4}},
        {"custom_id": "c2", "method": "POST", "url": "/v1/chat/completions",
         "body": {"model": "gpt-x", "messages": [{"role": "user", "content": "Say hi."}], "max_completion_tokens": 4}},
        {"prompt": "One, two, three,"},
        '{"prompt": "broken',
        {"custom_id": "c5", "prompt": "x", "temperature": -1},
        {"messages": [{"role": "user", "content": "Name a color."}]},
        {"custom_id": "lp-chat", "method": "POST", "url": "/v1/chat/completions",
         "body": {"messages": [{"role": "user", "content": "Say hi."}], "logprobs": True, "top_logprobs": 2}},
        {"custom_id": "lp-cmpl", "method": "POST", "url": "/v1/completions",
         "body": {"model": "smol", "prompt": "The sky is", "logprobs": 3}},
    ]
    src = write_jsonl(tmp_path / "in.jsonl", mixed)
    out = tmp_path / "out.jsonl"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    t0 = time.monotonic()
    proc = subprocess.run(bulk_cmd(redis_url, src, out, "--max-tokens", "4", "--progress"), cwd=ROOT, env=env,
                          capture_output=True, timeout=300)  # bytes: keep the progress bar's \r
    stderr = proc.stderr.decode()
    assert proc.returncode == 1, stderr  # some lines failed (their errors are in OUT)
    summary = json.loads(proc.stdout)
    assert (summary["ok"], summary["failed"], summary["skipped"]) == (6, 2, 0)
    # tqdm's bar (forced on: stderr is a pipe here), redrawn with \r, ending on a newline.
    assert "\rbulk: 100%" in stderr and "8/8" in stderr and "ok=6, failed=2" in stderr and "tok/s=" in stderr
    assert stderr.endswith("\n")
    records = read_out(out)
    ids = [r["custom_id"] for r in records]
    assert sorted(ids) == sorted(["c1", "c2", "line-3", "line-4", "c5", "line-6", "lp-chat", "lp-cmpl"])
    by_id = {r["custom_id"]: r for r in records}
    assert by_id["line-4"]["error"]["code"] == "invalid_json" and by_id["line-4"]["error"]["line"] == 4
    assert "temperature" in by_id["c5"]["error"]["message"]
    bodies = {r["custom_id"]: validate_record(r) for r in records}  # every line, every body: OpenAI's types
    for cid in ("c1", "c2", "line-3", "line-6", "lp-chat", "lp-cmpl"):
        body = bodies[cid]
        assert body.usage.completion_tokens <= 4 and body.choices[0].finish_reason in ("stop", "length")
    assert bodies["c2"].model == "gpt-x" and bodies["lp-cmpl"].model == "smol" and bodies["c1"].model == "kiviq"
    assert [b.object for b in (bodies["c1"], bodies["c2"])] == ["text_completion", "chat.completion"]
    chat_lp = bodies["lp-chat"].choices[0].logprobs.content
    assert len(chat_lp) == bodies["lp-chat"].usage.completion_tokens
    assert all(len(t.top_logprobs) == 2 and t.bytes == list(t.token.encode()) for t in chat_lp)
    assert "".join(t.token for t in chat_lp) == bodies["lp-chat"].choices[0].message.content
    cmpl_lp = bodies["lp-cmpl"].choices[0].logprobs
    assert len(cmpl_lp.tokens) == len(cmpl_lp.token_logprobs) == len(cmpl_lp.text_offset) \
        == bodies["lp-cmpl"].usage.completion_tokens
    assert all(1 <= len(alts) <= 3 for alts in cmpl_lp.top_logprobs) and cmpl_lp.text_offset[0] == 0
    # Greedy: the bulk result equals the same request submitted directly.
    direct = Client(redis_url).submit(prompt="The capital of France is", max_tokens=4).result(timeout=300)
    assert bodies["c1"].choices[0].text == direct.text
    print(f"bulk e2e: {time.monotonic() - t0:.1f} s")


def test_bulk_killed_and_rerun_runs_each_job_once(worker_process, redis_url, redis_conn, tmp_path):
    n = 8
    src = write_jsonl(tmp_path / "in.jsonl", [{"custom_id": f"k{i}", "prompt": f"Count to {i}:", "max_tokens": 4}
                                             for i in range(n)])
    out = tmp_path / "out.jsonl"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    first = subprocess.Popen(bulk_cmd(redis_url, src, out, "--max-in-flight", "3"), cwd=ROOT, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 300
    while not (out.exists() and out.read_text().count("\n") >= 1):
        assert first.poll() is None and time.monotonic() < deadline, first.stderr.read().decode()
        time.sleep(0.05)
    first.send_signal(signal.SIGKILL)
    first.wait()
    done_before = out.read_text().count("\n")
    assert done_before < n  # killed half-way
    enqueued_before = len(redis_conn.keys("rq:job:*"))

    rerun = subprocess.run(bulk_cmd(redis_url, src, out), cwd=ROOT, env=env, capture_output=True, text=True,
                           timeout=300)
    assert rerun.returncode == 0, rerun.stderr
    summary = json.loads(rerun.stdout)
    # ok counts every line of OUT: the killed run's and this run's.
    assert summary["skipped"] == done_before and summary["ok"] == n and summary["failed"] == 0
    # Jobs the killed run enqueued but had not written were awaited, not resubmitted.
    assert summary["reattached"] == enqueued_before - done_before
    records = read_out(out)
    assert sorted(r["custom_id"] for r in records) == sorted(f"k{i}" for i in range(n))
    assert all(r["error"] is None for r in records)

    # Every job ran exactly once: n jobs finished, each with one rq result and
    # one stream (no restart), all under the idempotency-derived ids.
    for r in records:
        validate_record(r)
    job_ids = {r["response"]["request_id"] for r in records}
    assert len(job_ids) == n and all(j.startswith(job_id_for_idempotency_key("bulk-")) for j in job_ids)
    finished = FinishedJobRegistry(queue_name("default"), connection=redis_conn, serializer=JSONSerializer)
    assert set(finished.get_job_ids()) == job_ids
    assert {k.decode() for k in redis_conn.keys("rq:job:*")} == {f"rq:job:{j}" for j in job_ids}
    for job_id in job_ids:
        assert redis_conn.xlen(f"rq:results:{job_id}") == 1
        events = [StreamEvent.model_validate_json(e) for e in redis_conn.lrange(replay_log(job_id), 0, -1)]
        assert [e.type for e in events].count(EventType.done) == 1
        assert EventType.restarted not in [e.type for e in events]
