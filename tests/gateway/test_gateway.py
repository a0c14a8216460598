"""The OpenAI-compatible gateway (kiviq serve), end to end: the real ``openai`` package
against a live gateway (uvicorn in a thread), a real ``kiviq worker`` with SmolLM2 and
the suite's own Redis (tests/gateway/conftest.py). One worker and one gateway serve the
whole module; requests are short. The Batch API and the load test are in
tests/gateway/test_gateway_batches.py."""

from __future__ import annotations

import time

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")

from gateway_common import (  # noqa: E402
    KEY,
    MAX_TOKENS,
    MESSAGES,
    MODEL,
    PROMPT,
    assert_openai_error,
    free_port,
)
from redis import Redis  # noqa: E402

from kiviq.client import Client  # noqa: E402
from kiviq.gateway.app import create_app  # noqa: E402
from kiviq.jobs.keys import max_queued_key  # noqa: E402


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
        assert_openai_error(http.post(path, json=body), 400, param)
    assert_openai_error(http.post("/v1/chat/completions", content=b"{not json"), 400)
    assert_openai_error(http.post("/v1/chat/completions", content=b"[1, 2]"), 400)
    big = b'{"prompt": "' + b"x" * (20 * 1024 * 1024) + b'"}'
    assert assert_openai_error(http.post("/v1/completions", content=big), 413)["code"] == "request_too_large"
    assert_openai_error(http.get("/v1/nothing-here"), 404)
    assert_openai_error(http.get("/v1/models/no-such-model"), 404, "model")
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=MODEL, messages=MESSAGES, n=2)
    assert "n=1" in str(e.value)
    r = oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)  # still serving
    assert r.usage.completion_tokens == 2


def test_api_keys(gateway, oai):
    body = {"prompt": PROMPT, "max_tokens": 1}
    with httpx.Client(base_url=gateway.base, timeout=60) as anon:
        assert assert_openai_error(anon.post("/v1/completions", json=body), 401)["code"] == "invalid_api_key"
        assert_openai_error(anon.get("/v1/models", headers={"Authorization": "Bearer wrong"}), 401)
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
        assert_openai_error(c.get("/ready"), 503)
        assert c.get("/v1/models").json() == {"object": "list", "data": []}


def test_queue_full_is_429_with_retry_after(http, gw_redis):
    conn = Redis.from_url(gw_redis)
    conn.set(max_queued_key(), 0)
    try:
        r = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 1})
    finally:
        conn.delete(max_queued_key())
    assert assert_openai_error(r, 429)["code"] == "queue_full"
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

    url = f"redis://:hunter2secret@127.0.0.1:{free_port()}/0"
    with TestClient(create_app(url)) as c:
        r = c.post("/v1/chat/completions", json={"messages": MESSAGES})
        assert_openai_error(r, 503)
        assert_openai_error(c.get("/ready"), 503)
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
