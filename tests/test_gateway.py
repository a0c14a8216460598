"""The OpenAI-compatible gateway (kiviq serve), end to end, Batch API included: the real
``openai`` package against a live gateway (uvicorn in a thread), a real
``kiviq worker`` with SmolLM2 and the suite's own Redis. One worker and one
gateway serve the whole module; requests are short."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")

from redis import Redis  # noqa: E402

from kiviq.client import Client  # noqa: E402
from kiviq.gateway.app import create_app  # noqa: E402
from kiviq.jobs.keys import max_queued_key  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
KEY = "sk-test-gateway"
MODEL = "SmolLM2-135M-Instruct"
MAX_TOKENS = 12
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
PROMPT = "The three primary colors are"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def gw_redis(redis_server):
    conn = Redis.from_url(redis_server)
    conn.flushdb()
    yield redis_server
    conn.flushdb()


@pytest.fixture(scope="module")
def gw_worker(gw_redis):
    from rq import Worker

    log_path = Path(os.environ.get("PYTEST_TMPDIR", "/tmp")) / f"kiviq-gw-worker-{os.getpid()}.log"
    log_file = open(log_path, "w")
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-m", "kiviq.worker", "--redis-url", gw_redis], cwd=ROOT, env=env,
                            stdout=log_file, stderr=subprocess.STDOUT)
    conn = Redis.from_url(gw_redis)
    deadline = time.monotonic() + 180
    while not Worker.count(connection=conn):
        if proc.poll() is not None or time.monotonic() > deadline:
            pytest.fail(f"worker did not start:\n{log_path.read_text()[-4000:]}")
        time.sleep(0.2)
    yield proc
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
    log_file.close()


class _Server:
    """uvicorn serving an app in a thread, on a free port."""

    def __init__(self, app):
        self.port = _free_port()
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning", lifespan="on")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "gateway did not start"
            time.sleep(0.05)
        self.base = f"http://127.0.0.1:{self.port}"

    def stop(self):
        self.server.should_exit = True
        self.thread.join(timeout=30)


@pytest.fixture(scope="module")
def gateway(gw_redis, gw_worker, tmp_path_factory):
    server = _Server(create_app(gw_redis, [KEY, "sk-second"], files_dir=str(tmp_path_factory.mktemp("gw-files")),
                                batch_max_in_flight=2))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def oai(gateway):
    return openai.OpenAI(base_url=gateway.base + "/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def http(gateway):
    with httpx.Client(base_url=gateway.base, headers={"Authorization": f"Bearer {KEY}"}, timeout=120) as c:
        yield c


def _assert_openai_error(response, status: int, param: str | None = None):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"] and "Traceback" not in error["message"]
    if param is not None:
        assert error["param"] == param, error
    return error


def test_chat_completion_equals_the_client_result(oai, gw_redis):
    expected = Client(gw_redis).submit(messages=MESSAGES, max_tokens=MAX_TOKENS).result(timeout=300)
    r = oai.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-") and r.model == MODEL
    assert r.choices[0].message.content == expected.text and r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens == expected.usage.prompt_tokens
    assert r.usage.completion_tokens == expected.usage.completion_tokens
    assert r.usage.total_tokens == expected.usage.total_tokens
    # max_completion_tokens is the newer name of max_tokens
    r2 = oai.chat.completions.create(model=MODEL, messages=MESSAGES, max_completion_tokens=MAX_TOKENS, seed=3)
    assert r2.choices[0].message.content == expected.text


def test_completion_equals_the_client_result(oai, gw_redis):
    expected = Client(gw_redis).submit(prompt=PROMPT, max_tokens=MAX_TOKENS).result(timeout=300)
    r = oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0)
    assert r.object == "text_completion" and r.id.startswith("cmpl-")
    assert r.choices[0].text == expected.text
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == MAX_TOKENS
    # stop (a string of the greedy answer) and seed map onto the job the same way
    word = expected.text.split()[1]
    stopped = Client(gw_redis).submit(prompt=PROMPT, max_tokens=MAX_TOKENS, stop=[word]).result(timeout=300)
    r = oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, stop=word, seed=7)
    assert r.choices[0].text == stopped.text and word not in r.choices[0].text
    assert r.choices[0].finish_reason == "stop"


def test_streamed_deltas_equal_the_whole_text(oai):
    whole = oai.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=MAX_TOKENS)
    chunks = list(oai.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=MAX_TOKENS, stream=True,
                                              stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    assert all(c.usage is None for c in chunks[:-1])
    assert len({c.id for c in chunks}) == 1 and chunks[0].object == "chat.completion.chunk"

    plain = oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS)
    streamed = list(oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == plain.choices[0].text
    assert streamed[-1].choices[0].finish_reason == "length" and streamed[-1].usage is None


def test_logprobs(oai):
    r = oai.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=MAX_TOKENS, logprobs=True,
                                    top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert "".join(t.token for t in content) == r.choices[0].message.content
    assert len(content) == r.usage.completion_tokens
    for t in content:
        assert t.logprob <= 0 and len(t.top_logprobs) == 2 and t.top_logprobs[0].token == t.token
    streamed = list(oai.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=MAX_TOKENS,
                                                logprobs=True, top_logprobs=2, stream=True))
    assert [t.logprob for c in streamed if c.choices and c.choices[0].logprobs
            for t in c.choices[0].logprobs.content] == [t.logprob for t in content]

    c = oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, logprobs=2)
    lp = c.choices[0].logprobs
    assert "".join(lp.tokens) == c.choices[0].text and len(lp.token_logprobs) == MAX_TOKENS
    assert all(len(top) <= 2 for top in lp.top_logprobs) and lp.text_offset[0] == 0


BAD_BODIES = [
    ("/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, "frobnicate": 1}, "frobnicate"),
    ("/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, "temperature": "hot"}, "temperature"),
    ("/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, "n": 2}, "n"),
    ("/v1/chat/completions", {"model": MODEL, "messages": []}, "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, "max_tokens": 0}, "max_tokens"),
    ("/v1/chat/completions", {"model": MODEL}, "messages"),
    ("/v1/completions", {"model": MODEL, "prompt": PROMPT, "top_p": 0}, "top_p"),
    ("/v1/completions", {"model": MODEL, "prompt": [PROMPT, PROMPT]}, "prompt"),
]


def test_bad_input_is_a_4xx_in_openai_shape_and_serving_goes_on(http, oai):
    for path, body, param in BAD_BODIES:
        _assert_openai_error(http.post(path, json=body), 400, param)
    _assert_openai_error(http.post("/v1/chat/completions", content=b"{not json"), 400)
    _assert_openai_error(http.post("/v1/chat/completions", content=b"[1, 2]"), 400)
    big = b'{"prompt": "' + b"x" * (20 * 1024 * 1024) + b'"}'
    assert _assert_openai_error(http.post("/v1/completions", content=big), 413)["code"] == "request_too_large"
    _assert_openai_error(http.get("/v1/nothing-here"), 404)
    _assert_openai_error(http.get("/v1/models/no-such-model"), 404, "model")
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=MODEL, messages=MESSAGES, n=2)
    assert "n=1" in str(e.value)
    r = oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)  # still serving
    assert r.usage.completion_tokens == 2


def test_api_keys(gateway, oai):
    body = {"prompt": PROMPT, "max_tokens": 1}
    with httpx.Client(base_url=gateway.base, timeout=60) as anon:
        assert _assert_openai_error(anon.post("/v1/completions", json=body), 401)["code"] == "invalid_api_key"
        _assert_openai_error(anon.get("/v1/models", headers={"Authorization": "Bearer wrong"}), 401)
        assert anon.get("/v1/models", headers={"Authorization": "Bearer sk-second"}).status_code == 200
        assert anon.get("/health").status_code == 200  # probes need no key
        assert anon.get("/ready").status_code == 200
    bad = openai.OpenAI(base_url=gateway.base + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_models_and_readiness(oai, http, redis_server):
    assert [m.id for m in oai.models.list()] == [MODEL]
    assert oai.models.retrieve(MODEL).id == MODEL
    assert http.get("/health").json() == {"status": "ok"}
    assert http.get("/ready").json()["workers"] == 1
    # A database no worker serves: not ready.
    from starlette.testclient import TestClient

    with TestClient(create_app(redis_server.rsplit("/", 1)[0] + "/7")) as c:
        _assert_openai_error(c.get("/ready"), 503)
        assert c.get("/v1/models").json() == {"object": "list", "data": []}


def test_queue_full_is_429_with_retry_after(http, gw_redis):
    conn = Redis.from_url(gw_redis)
    conn.set(max_queued_key(), 0)
    try:
        r = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 1})
    finally:
        conn.delete(max_queued_key())
    assert _assert_openai_error(r, 429)["code"] == "queue_full"
    assert int(r.headers["retry-after"]) > 0


def test_the_gateway_pool_is_its_own_size_and_wait(redis_server):
    """The gateway's AsyncClient builds the pool, with the gateway's size and a
    bounded wait (a stream past the limit gets a 503, not an endless wait)."""
    from starlette.testclient import TestClient

    from kiviq.gateway.app import POOL_WAIT_S, REDIS_MAX_CONNECTIONS

    for options, size in (({}, REDIS_MAX_CONNECTIONS), ({"redis_max_connections": 3}, 3)):
        with TestClient(create_app(redis_server, **options)) as c:
            client = c.app.state.gateway.client
            assert (client.redis.connection_pool.max_connections, client.redis.connection_pool.timeout) == (
                size, POOL_WAIT_S)
            assert client.sync.redis.connection_pool.max_connections == size


def test_redis_unreachable_is_503_without_the_password(caplog):
    from starlette.testclient import TestClient

    url = f"redis://:hunter2secret@127.0.0.1:{_free_port()}/0"
    with TestClient(create_app(url)) as c:
        r = c.post("/v1/chat/completions", json={"messages": MESSAGES})
        _assert_openai_error(r, 503)
        _assert_openai_error(c.get("/ready"), 503)
    assert "hunter2secret" not in r.text and "hunter2secret" not in caplog.text


def test_a_client_that_disconnects_mid_stream_cancels_its_job(gateway, gw_redis):
    from kiviq.client.top import read_worker_stats

    conn = Redis.from_url(gw_redis)

    def kv_used() -> list[int]:
        return sorted(s["kv_used_bytes"] for s in read_worker_stats(conn).values())

    before = kv_used()
    body = {"messages": [{"role": "user", "content": "Write a very long story about the sea."}],
            "max_tokens": 4000, "stream": True}
    with httpx.Client(base_url=gateway.base, headers={"Authorization": f"Bearer {KEY}"}, timeout=120) as c:
        with c.stream("POST", "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            next(line for line in lines if '"content"' in line and line != first)  # generating
            deadline = time.monotonic() + 10
            while kv_used() == before:  # the running job holds KV memory
                assert time.monotonic() < deadline, "the worker's stats never showed the job's KV memory"
                time.sleep(0.2)
    import json

    job_id = json.loads(first[len("data: "):])["id"].removeprefix("chatcmpl-")
    result = Client(gw_redis).job(job_id).result(timeout=60)
    assert result.finish_reason.value == "cancelled"
    assert result.usage.completion_tokens < 4000
    deadline = time.monotonic() + 15  # the worker's stats snapshot: its KV memory is back where it was
    while kv_used() != before:
        assert time.monotonic() < deadline, (kv_used(), before)
        time.sleep(0.2)


def test_a_client_that_gives_up_on_a_non_streamed_answer_cancels_its_job(gateway, gw_redis, caplog):
    import logging
    import re

    body = {"prompt": "Once upon a time", "max_tokens": 4000}
    with caplog.at_level(logging.INFO, logger="kiviq.gateway"):
        with httpx.Client(base_url=gateway.base, headers={"Authorization": f"Bearer {KEY}"}, timeout=2) as c:
            with pytest.raises(httpx.ReadTimeout):
                c.post("/v1/completions", json=body)
        deadline = time.monotonic() + 30
        while "cancelled job" not in caplog.text and time.monotonic() < deadline:
            time.sleep(0.1)
    job_id = re.search(r"cancelled job (\S+)", caplog.text).group(1)
    result = Client(gw_redis).job(job_id).result(timeout=60)
    assert result.finish_reason.value == "cancelled" and result.usage.completion_tokens < 4000


# --- the Batch API ----------------------------------------------------------------


def _jsonl(lines) -> bytes:
    import json

    return "".join(json.dumps(line) + "\n" for line in lines).encode()


def _wait_batch(oai, batch_id: str, statuses: tuple[str, ...], timeout: float = 180):
    deadline = time.monotonic() + timeout
    while True:
        batch = oai.batches.retrieve(batch_id)
        if batch.status in statuses:
            return batch
        assert time.monotonic() < deadline, f"batch still {batch.status}"
        time.sleep(0.3)


def test_batch_round_trip(oai, http):
    import json

    from openai.types import Completion
    from openai.types.chat import ChatCompletion

    questions = ["What is the capital of France?", "Name a color.", "Say hi."]
    lines = [{"custom_id": f"q{i}", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": MODEL, "messages": [{"role": "user", "content": q}], "max_tokens": 8}}
             for i, q in enumerate(questions)]
    lines.append({"custom_id": "c0", "method": "POST", "url": "/v1/completions",
                  "body": {"model": MODEL, "prompt": PROMPT, "max_tokens": 8}})
    lines.append({"custom_id": "bad", "method": "POST", "url": "/v1/chat/completions",
                  "body": {"model": MODEL, "messages": MESSAGES, "n": 2}})
    f = oai.files.create(file=("in.jsonl", _jsonl(lines)), purpose="batch")
    assert f.purpose == "batch" and f.bytes == len(_jsonl(lines)) and oai.files.retrieve(f.id).id == f.id
    assert oai.files.content(f.id).content == _jsonl(lines)
    batch = oai.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h",
                               metadata={"run": "test"})
    assert batch.status in ("validating", "in_progress") and batch.metadata == {"run": "test"}
    batch = _wait_batch(oai, batch.id, ("completed", "failed", "cancelled"))
    assert batch.status == "completed" and batch.errors is None
    assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (5, 4, 1)
    out = [json.loads(line) for line in oai.files.content(batch.output_file_id).text.splitlines()]
    errors = [json.loads(line) for line in oai.files.content(batch.error_file_id).text.splitlines()]
    assert sorted(r["custom_id"] for r in out) == ["c0", "q0", "q1", "q2"]
    assert [r["custom_id"] for r in errors] == ["bad"] and "n" in errors[0]["error"]["message"]
    for r in out:
        body = r["response"]["body"]
        kind = Completion if r["custom_id"] == "c0" else ChatCompletion
        assert kind.model_validate(body).usage.completion_tokens >= 1
    # the same request through the HTTP API answers the same (greedy) text
    q0 = next(r for r in out if r["custom_id"] == "q0")["response"]["body"]["choices"][0]["message"]["content"]
    direct = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": questions[0]}],
                                         max_tokens=8)
    assert direct.choices[0].message.content == q0
    assert batch.id in [b.id for b in oai.batches.list()]
    # finished batches cannot be cancelled; unknown ids are 404s
    _assert_openai_error(http.post(f"/v1/batches/{batch.id}/cancel"), 400)
    _assert_openai_error(http.get("/v1/batches/batch-doesnotexist0"), 404)
    _assert_openai_error(http.get("/v1/files/file-doesnotexist0/content"), 404)
    _assert_openai_error(http.get("/v1/files/../../etc/passwd"), 404)
    _assert_openai_error(http.post("/v1/batches", json={"input_file_id": "file-nope", "endpoint":
                                                        "/v1/chat/completions", "completion_window": "24h"}), 404)
    _assert_openai_error(http.post("/v1/batches", json={"input_file_id": f.id, "endpoint": "/v1/embeddings",
                                                        "completion_window": "24h"}), 400, "endpoint")
    _assert_openai_error(http.post("/v1/files", files={"file": ("x.jsonl", b"{}")}, data={"purpose": "fine-tune"}),
                         400, "purpose")


def test_list_and_delete_files(oai, http):
    a, b, c = (oai.files.create(file=(f"{name}.jsonl", _jsonl([{"custom_id": name, "prompt": "hi"}])),
                                purpose="batch") for name in "abc")
    ours = {a.id, b.id, c.id}
    newest_first = [f.id for f in oai.files.list()]
    assert [i for i in newest_first if i in ours] == [c.id, b.id, a.id]
    assert [f.id for f in oai.files.list(order="asc") if f.id in ours] == [a.id, b.id, c.id]
    first = oai.files.list(limit=2)
    assert len(first.data) == 2 and first.has_more == (len(newest_first) > 2)
    assert [f.id for f in first] == newest_first  # the SDK pages on with after=<last id>
    assert all(f.purpose == "batch_output" for f in oai.files.list(purpose="batch_output"))
    assert ours <= {f.id for f in oai.files.list(purpose="batch")}
    raw = http.get("/v1/files", params={"purpose": "no-such-purpose"}).json()
    assert raw == {"object": "list", "data": [], "first_id": None, "last_id": None, "has_more": False}

    deleted = oai.files.delete(b.id)
    assert (deleted.id, deleted.object, deleted.deleted) == (b.id, "file", True)
    assert [f.id for f in oai.files.list() if f.id in ours] == [c.id, a.id]
    with pytest.raises(openai.NotFoundError):
        oai.files.retrieve(b.id)
    assert _assert_openai_error(http.delete(f"/v1/files/{b.id}"), 404, "file_id")["code"] == "not_found"
    _assert_openai_error(http.get(f"/v1/files/{b.id}/content"), 404)
    _assert_openai_error(http.delete("/v1/files/..%2F..%2Fetc%2Fpasswd"), 404)
    _assert_openai_error(http.get("/v1/files", params={"limit": 0}), 400, "limit")
    _assert_openai_error(http.get("/v1/files", params={"limit": "many"}), 400, "limit")
    _assert_openai_error(http.get("/v1/files", params={"order": "sideways"}), 400, "order")
    assert oai.files.retrieve(a.id).id == a.id and oai.files.content(c.id).text  # the others are untouched


def test_cancel_a_running_batch_whose_input_cannot_be_deleted_meanwhile(oai, gw_redis):
    lines = [{"custom_id": f"long{i}", "method": "POST", "url": "/v1/chat/completions",
              "body": {"messages": [{"role": "user", "content": "Write a long story about a ship."}],
                       "max_tokens": 3000}} for i in range(6)]
    f = oai.files.create(file=("long.jsonl", _jsonl(lines)), purpose="batch")
    batch = oai.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    _wait_batch(oai, batch.id, ("in_progress",))
    with pytest.raises(openai.ConflictError) as refused:  # a resumed batch would need it again
        oai.files.delete(f.id)
    assert refused.value.status_code == 409 and refused.value.code == "file_in_use" and batch.id in str(refused.value)
    assert oai.files.retrieve(f.id).id == f.id and oai.batches.retrieve(batch.id).status == "in_progress"
    time.sleep(1.0)  # its first jobs are running
    assert oai.batches.cancel(batch.id).status == "cancelling"
    batch = _wait_batch(oai, batch.id, ("cancelled",), timeout=60)
    assert batch.request_counts.total == 6 and batch.request_counts.completed < 6
    assert batch.cancelled_at is not None
    assert oai.files.delete(f.id).deleted  # the batch has ended: its input may go
    # the worker is free again: a short request answers at once
    started = time.monotonic()
    oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)
    assert time.monotonic() - started < 30
    assert Client(gw_redis).queued() == 0


def test_a_restarted_gateway_resumes_unfinished_batches(gw_redis, gw_worker, tmp_path):
    """A batch left in_progress (its gateway died) with part of its output
    written is finished by the next gateway on the same directory: one line
    per custom_id, the written one kept."""
    import json

    from starlette.testclient import TestClient

    from kiviq.gateway.batches import BatchStore

    store = BatchStore(str(tmp_path), gw_redis)
    lines = [{"custom_id": f"r{i}", "prompt": f"Count to {i}:", "max_tokens": 4} for i in range(3)]
    f = store.add_file(_jsonl(lines), "in.jsonl", "batch")
    batch = {"id": "batch-resumeme", "object": "batch", "endpoint": "/v1/completions", "errors": None,
             "input_file_id": f["id"], "completion_window": "24h", "status": "in_progress",
             "output_file_id": None, "error_file_id": None, "created_at": 1, "in_progress_at": 1,
             "expires_at": 2, "finalizing_at": None, "completed_at": None, "failed_at": None, "expired_at": None,
             "cancelling_at": None, "cancelled_at": None,
             "request_counts": {"total": 3, "completed": 1, "failed": 0}, "metadata": None}
    (tmp_path / "batches" / "batch-resumeme.json").write_text(json.dumps(batch))
    written = {"id": "batch_req_x", "custom_id": "r1", "error": None,
               "response": {"status_code": 200, "request_id": "earlier", "body": {"choices": [{"text": "kept"}]}}}
    (tmp_path / "batches" / "batch-resumeme.out").write_text(json.dumps(written) + "\n")
    with TestClient(create_app(gw_redis, files_dir=str(tmp_path))) as c:
        deadline = time.monotonic() + 120
        while (b := c.get("/v1/batches/batch-resumeme").json())["status"] != "completed":
            # finalizing: every line is written and its files are being closed (OpenAI's state too)
            assert time.monotonic() < deadline and b["status"] in ("in_progress", "finalizing"), b
            time.sleep(0.2)
        out = [json.loads(line) for line in c.get(f"/v1/files/{b['output_file_id']}/content").text.splitlines()]
    assert sorted(r["custom_id"] for r in out) == ["r0", "r1", "r2"]
    assert next(r for r in out if r["custom_id"] == "r1")["response"]["request_id"] == "earlier"
    assert b["request_counts"] == {"total": 3, "completed": 3, "failed": 0} and b["error_file_id"] is None


# --- load: the 200 concurrent streams through one gateway to one worker ------------
#
# Where the time goes (2-core CPU, SmolLM2): the worker's forward passes. It
# keeps both cores busy through a round, while the gateway spends ~1 CPU-second
# and the streaming client ~1 per round of 200. A round runs in waves of the
# worker's --max-active (32; 64 or 200 are no faster: the cost is tokens, not
# steps), each a prefill of 32 prompts plus one decode step per new token:
# 1 token per stream ~6 s a round, 3 tokens ~13 s, 4 tokens ~15 s. So every
# stream sends a 4-token prompt and asks for 3 new tokens: enough for several
# token events per stream to check their order. (The ~150 s an earlier run took
# was mostly prefill padded to 64 tokens on a CPU, since dropped.)
LOAD_STREAMS = int(os.environ.get("KIVIQ_GATEWAY_STREAMS", "200"))
LOAD_MAX_TOKENS = 3
# Gateway memory after a second round of LOAD_STREAMS streams, over the first.
# Measured on a 2-core runner: +60..+200 KiB a round once the first round has
# grown the gateway's pools and buffers (50 MiB at start, 64 MiB after round
# one). The bound is 10x the most measured: a gateway that kept ~10 KiB of any
# stream it served (its chunks, its request, its job handle) fails it. A stream
# that never gives its pub/sub connection back (~8 KiB of RSS, too close to the
# bound) is caught by the Redis connection count instead.
RSS_GROWTH_BOUND_KIB = 2048


def _rss_kib(pid: int) -> int:
    """A process's resident memory: VmRSS on Linux, ``ps`` elsewhere (macOS)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    except FileNotFoundError:
        return int(subprocess.check_output(["ps", "-o", "rss=", "-p", str(pid)]).strip())


@pytest.fixture
def gateway_process(gw_redis, gw_worker, tmp_path):
    """``kiviq serve`` as a process of its own, so that its memory is its alone."""
    port = _free_port()
    log_path = tmp_path / "gateway.log"
    with open(log_path, "w") as log_file:
        proc = subprocess.Popen([sys.executable, "-m", "kiviq.gateway", "--redis-url", gw_redis, "--port", str(port),
                                 "--api-key", KEY, "--no-batches", "--log-level", "WARNING"], cwd=ROOT,
                                env=dict(os.environ, PYTHONPATH=str(ROOT)), stdout=log_file,
                                stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            if httpx.get(base + "/health", timeout=5).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"the gateway did not start:\n{log_path.read_text()[-4000:]}")
        time.sleep(0.1)
    yield proc, base
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()


async def _stream_completion(client, i: int) -> list[dict]:
    """The chunks of one streamed completion, checked to end in one ``[DONE]``."""
    import json

    body = {"prompt": f"Number {i} is", "max_tokens": LOAD_MAX_TOKENS, "stream": True,
            "stream_options": {"include_usage": True}}
    lines = []
    async with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                lines.append(line[len("data: "):])
    assert lines[-1] == "[DONE]" and lines.count("[DONE]") == 1, lines
    return [json.loads(line) for line in lines[:-1]]


def _stream_round(base: str) -> list[list[dict]]:
    """LOAD_STREAMS streamed completions at once; the chunks of each."""
    import asyncio

    async def run():
        async with httpx.AsyncClient(base_url=base, headers={"Authorization": f"Bearer {KEY}"}, timeout=300,
                                     limits=httpx.Limits(max_connections=LOAD_STREAMS + 50)) as client:
            return await asyncio.gather(*(_stream_completion(client, i) for i in range(LOAD_STREAMS)))

    return asyncio.run(run())


def _check_streams(streams: list[list[dict]], conn: Redis) -> None:
    """Each stream carries its job's token events, every one once and in
    order (compared with the worker's replay log), then one finish chunk and
    one usage chunk that match the job's result."""
    from kiviq.gateway.responses import finish_reason
    from kiviq.jobs.keys import replay_log
    from kiviq.jobs.models import EventType, StreamEvent

    client = Client(connection=conn)
    job_ids = [chunks[0]["id"].removeprefix("cmpl-") for chunks in streams]
    assert len(set(job_ids)) == len(streams)
    for job_id, chunks in zip(job_ids, streams):
        assert {c["id"] for c in chunks} == {"cmpl-" + job_id}
        *deltas, finish, usage = chunks
        result = client.job(job_id).result(timeout=10)
        events = [StreamEvent.model_validate_json(e) for e in conn.lrange(replay_log(job_id), 0, -1)]
        assert [e.seq for e in events] == list(range(len(events))) and events[-1].type == EventType.done
        assert [c["choices"][0]["text"] for c in deltas] == [e.text for e in events
                                                              if e.type == EventType.token and e.text]
        assert all(c["choices"][0]["finish_reason"] is None for c in deltas)
        assert "".join(c["choices"][0]["text"] for c in deltas) == result.text
        assert finish["choices"][0]["finish_reason"] == finish_reason(result.finish_reason)
        assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == result.usage.completion_tokens


def test_200_concurrent_streams_lose_and_repeat_nothing_in_bounded_memory(gateway_process, gw_redis):
    proc, base = gateway_process
    conn = Redis.from_url(gw_redis)
    rss, clients = [_rss_kib(proc.pid)], []
    for _ in range(2):
        _check_streams(_stream_round(base), conn)
        rss.append(_rss_kib(proc.pid))
        clients.append(conn.info("clients")["connected_clients"])
    print(f"gateway RSS (KiB): at start {rss[0]}, after round 1 {rss[1]}, after round 2 {rss[2]}; "
          f"Redis clients after each round: {clients}")
    assert rss[2] - rss[1] < RSS_GROWTH_BOUND_KIB, rss
    # the second round reused the first one's connections (a stream that kept
    # its pub/sub connection would open LOAD_STREAMS new ones)
    assert clients[1] - clients[0] < LOAD_STREAMS // 4, clients
