"""Fast unit tests of the job contract and the client (fakeredis)."""

from __future__ import annotations

import json
import zlib

import fakeredis
import pytest
from rq import Queue
from rq.serializers import JSONSerializer

from kiviq.client import Client, InvalidRequest
from kiviq.jobs import GenerateRequest, Priority, queue_name, validate_request
from kiviq.jobs.keys import TASK_PATH


@pytest.fixture
def fake():
    return fakeredis.FakeRedis()


@pytest.mark.parametrize("fields, named", [
    (dict(prompt="x", max_tokens=0), "max_tokens"),
    (dict(prompt="x", max_tokens=10**6), "max_tokens"),
    (dict(prompt="x", temperature=-1), "temperature"),
    (dict(prompt="x", top_p=0), "top_p"),
    (dict(prompt="x", top_p=1.01), "top_p"),
    (dict(prompt="x", stop=[""]), "stop"),
    (dict(prompt="x", seed=-1), "seed"),
    (dict(prompt="x", priority="urgent"), "priority"),
    (dict(prompt="x", timeout_s=0), "timeout_s"),
    (dict(prompt="x", idempotency_key="has space"), "idempotency_key"),
    (dict(prompt="x", messages=[{"role": "user", "content": "y"}]), "prompt"),
    (dict(), "messages"),
    (dict(messages=[{"role": "wizard", "content": "y"}]), "messages.0.role"),
    (dict(prompt="x", unknown=1), "unknown"),
    (dict(prompt="x", logprobs="sometimes"), "logprobs"),
    (dict(prompt="x", top_logprobs=3), "top_logprobs"),  # needs logprobs=True
    (dict(prompt="x", logprobs=True, top_logprobs=21), "top_logprobs"),
    (dict(prompt="x", logprobs=True, top_logprobs=-1), "top_logprobs"),
])
def test_invalid_requests_name_the_field(fields, named):
    with pytest.raises(InvalidRequest) as info:
        validate_request(fields)
    assert named in str(info.value)


def test_request_json_round_trip():
    req = validate_request(dict(messages=[{"role": "user", "content": "hi"}], stop="END", seed=3,
                                priority="high", max_tokens=5))
    assert req.stop == ["END"]
    again = GenerateRequest.model_validate_json(req.model_dump_json())
    assert again == req


def test_submit_enqueues_json_job_on_priority_queue(fake):
    handle = Client(connection=fake).submit(prompt="hello", max_tokens=3, priority="high")
    queue = Queue(queue_name(Priority.high), connection=fake, serializer=JSONSerializer)
    assert queue.job_ids == [handle.job_id]
    job = queue.fetch_job(handle.job_id)
    assert job.func_name == TASK_PATH
    assert job.args[0]["prompt"] == "hello" and job.args[0]["max_tokens"] == 3
    # JSON, never pickle: the stored (zlib-compressed) payload parses as JSON.
    raw = zlib.decompress(fake.hget(f"rq:job:{handle.job_id}", "data"))
    assert json.loads(raw)[2][0]["prompt"] == "hello"


def test_invalid_submit_touches_no_key(fake):
    with pytest.raises(InvalidRequest):
        Client(connection=fake).submit(prompt="hello", max_tokens=-1)
    assert fake.dbsize() == 0


def test_idempotency_key_returns_the_existing_job(fake):
    client = Client(connection=fake)
    first = client.submit(prompt="hello", idempotency_key="order-42")
    second = client.submit(prompt="hello", idempotency_key="order-42")
    assert first.job_id == second.job_id
    assert Queue(queue_name("default"), connection=fake).count == 1


def test_top_logprobs_without_logprobs_is_named_as_the_field():
    with pytest.raises(InvalidRequest) as info:
        validate_request(dict(prompt="x", top_logprobs=2))
    assert info.value.fields == ["top_logprobs"]
    assert validate_request(dict(prompt="x", logprobs=True, top_logprobs=20)).top_logprobs == 20


def test_logprob_fields_reach_the_job_only_when_asked(fake):
    client = Client(connection=fake)
    queue = Queue(queue_name("default"), connection=fake, serializer=JSONSerializer)
    plain = queue.fetch_job(client.submit(prompt="hello").job_id).args[0]
    assert "logprobs" not in plain and "top_logprobs" not in plain  # as before the fields existed
    asked = queue.fetch_job(client.submit(prompt="hello", logprobs=True, top_logprobs=2).job_id).args[0]
    assert asked["logprobs"] is True and asked["top_logprobs"] == 2
    assert validate_request(asked).top_logprobs == 2
