"""End to end: real Redis, real SmolLM2, a `kiviq worker` subprocess, the client."""

from __future__ import annotations

import time

import pytest
from mlx_lm.generate import stream_generate
from mlx_lm.sample_utils import make_sampler
from rq import Queue
from rq.job import Job
from rq.registry import FailedJobRegistry
from rq.serializers import JSONSerializer

from kiviq.client import Client, InvalidRequest, JobFailed
from kiviq.jobs.keys import TASK_PATH, queue_name, replay_log

PROMPTS = [
    "The three primary colors are",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
]
MAX_TOKENS = 24


def mlx_lm_greedy(model, tokenizer, prompt: str, max_tokens: int) -> list[int]:
    """mlx-lm's own greedy generation: the oracle the service must match."""
    return [r.token for r in stream_generate(model, tokenizer, prompt, max_tokens=max_tokens,
                                             sampler=make_sampler(temp=0.0))
            if r.finish_reason != "stop" or r.token not in tokenizer.eos_token_ids]


def test_results_match_mlx_lm_and_stream(start_worker, redis_url, smollm2):
    start_worker("--kv-bits", "16")  # mlx-lm's own fp16 cache: tokens must match exactly
    model, tokenizer = smollm2
    client = Client(redis_url)
    handles = [client.submit(prompt=p, max_tokens=MAX_TOKENS) for p in PROMPTS]
    for prompt, handle in zip(PROMPTS, handles):
        streamed = "".join(handle.stream(timeout=300))
        result = handle.result(timeout=300)
        expected = mlx_lm_greedy(model, tokenizer, prompt, MAX_TOKENS)
        assert result.token_ids == expected, prompt
        assert streamed == result.text
        assert result.text == tokenizer.decode(expected)
        assert result.usage.completion_tokens == len(expected)
        assert result.usage.prompt_tokens == len(tokenizer.encode(prompt))
        assert result.finish_reason.value in ("stop", "length")
    # A client that subscribes after completion still gets every token, once.
    late = client.job(handles[0].job_id)
    assert "".join(late.stream(timeout=10)) == handles[0].result().text
    events = list(late.events(timeout=10))
    assert [e.seq for e in events] == list(range(len(events)))
    assert events[-1].type.value == "done"


def test_compiled_pipelined_worker_matches_the_plain_engine(start_worker, redis_url, smollm2):
    """`kiviq worker --compile-decode --pipeline-decode` returns exactly the tokens of
    the default KIVI engine run in this process, step by step and uncompiled."""
    from kiviq.engine import build_engine
    from engine_runs import run_engine
    from kiviq.jobs.models import GenerateRequest
    from kiviq.worker.prompts import build_request

    proc = start_worker("--compile-decode", "--pipeline-decode")
    model, tokenizer = smollm2
    client = Client(redis_url)
    handles = [client.submit(prompt=p, max_tokens=MAX_TOKENS) for p in PROMPTS]
    requests = [build_request(str(i), GenerateRequest(prompt=p, max_tokens=MAX_TOKENS), tokenizer, 8192)
                for i, p in enumerate(PROMPTS)]
    expected = run_engine(build_engine(model, tokenizer), requests)
    for i, handle in enumerate(handles):
        assert handle.result(timeout=300).token_ids == expected[str(i)], PROMPTS[i]
    assert "decode steps compiled, decode steps pipelined" in proc.log_path.read_text()


def test_chat_capital_of_france_with_kivi_4bit(worker_process, redis_url):
    """The default worker (KIVI 4-bit KV cache) answers correctly."""
    handle = Client(redis_url).submit(
        messages=[{"role": "user", "content": "What is the capital of France?"}], max_tokens=32)
    assert "Paris" in handle.result(timeout=300).text
    log = worker_process.log_path.read_text()
    assert "KV cache: KIVI 4-bit" in log
    assert "model weights: " in log and "no quantized layers" in log  # the small default is dequantized


def _stored_result(conn, job_id: str, timeout: float = 10.0):
    """rq's stored return value of a finished job. The worker publishes a job's
    final event before it records the rq result (events first, by design), so a
    client that has just read the result from the event may be ahead of it."""
    deadline = time.monotonic() + timeout
    while True:
        value = Job.fetch(job_id, connection=conn, serializer=JSONSerializer).return_value()
        if value is not None or time.monotonic() > deadline:
            return value
        time.sleep(0.05)


def test_logprobs_in_stream_and_result_only_when_asked(worker_process, redis_url, redis_conn):
    client = Client(redis_url)
    prompt = "The three primary colors are"
    asked = client.submit(prompt=prompt, max_tokens=10, logprobs=True, top_logprobs=3)
    plain = client.submit(prompt=prompt, max_tokens=10)  # batched with the first
    r = asked.result(timeout=300)
    assert [t.token_id for t in r.logprobs] == r.token_ids
    assert "".join(t.token for t in r.logprobs) == r.text
    for t in r.logprobs:
        assert t.logprob <= 0 and len(t.top_logprobs) == 3
        assert t.top_logprobs[0].token_id == t.token_id  # greedy
        assert t.top_logprobs[0].logprob == t.logprob
        assert [a.logprob for a in t.top_logprobs] == sorted((a.logprob for a in t.top_logprobs), reverse=True)
    tokens = [e for e in asked.events(timeout=10) if e.type.value == "token"]
    assert all(len(e.logprobs) == len(e.token_ids) for e in tokens)
    assert [t for e in tokens for t in e.logprobs] == r.logprobs
    stored = _stored_result(redis_conn, asked.job_id)
    assert len(stored["logprobs"]) == len(r.token_ids)

    p = plain.result(timeout=300)
    assert p.logprobs is None and p.token_ids == r.token_ids
    # Nothing changes for a job that did not ask: not its job data, events or rq result.
    job = Job.fetch(plain.job_id, connection=redis_conn, serializer=JSONSerializer)
    assert "logprobs" not in job.args[0] and "top_logprobs" not in job.args[0]
    assert all(b"logprobs" not in raw for raw in redis_conn.lrange(replay_log(plain.job_id), 0, -1))
    assert "logprobs" not in _stored_result(redis_conn, plain.job_id)


def test_invalid_submit_names_field_and_enqueues_nothing(redis_url, redis_conn):
    client = Client(redis_url)
    cases = {
        "max_tokens": dict(prompt="hi", max_tokens=0),
        "temperature": dict(prompt="hi", temperature=-0.5),
        "top_p": dict(prompt="hi", top_p=1.5),
        "bogus_field": dict(prompt="hi", bogus_field=1),
        "prompt": dict(prompt=""),
        "messages": dict(messages=[]),
        "top_logprobs": dict(prompt="hi", top_logprobs=2),  # without logprobs=True
    }
    for field, kwargs in cases.items():
        with pytest.raises(InvalidRequest) as info:
            client.submit(**kwargs)
        assert field in str(info.value)
    assert redis_conn.dbsize() == 0


def _enqueue_raw(conn, args, func=TASK_PATH, kwargs=None) -> str:
    queue = Queue(queue_name("default"), connection=conn, serializer=JSONSerializer)
    return queue.enqueue_call(func, args=args, kwargs=kwargs, timeout=-1).id


def test_poison_jobs_fail_alone(worker_process, redis_url, redis_conn):
    """Malformed jobs written straight into Redis fail with a clear error in
    rq's failed registry; the worker serves the next good job."""
    bad = {
        "wrong type": (_enqueue_raw(redis_conn, ({"prompt": "hi", "max_tokens": "many"},)), "max_tokens"),
        "unknown field": (_enqueue_raw(redis_conn, ({"prompt": "hi", "colour": "red"},)), "colour"),
        "not an object": (_enqueue_raw(redis_conn, (["hi"],)), "expected a JSON object"),
        "wrong function": (_enqueue_raw(redis_conn, ({"prompt": "hi"},), func="os.system"), "job function"),
        "too long": (_enqueue_raw(redis_conn, ({"prompt": "word " * 9000, "max_tokens": 4},)), "context"),
    }
    # A job whose stored payload is not even valid serialized data.
    garbage_id = _enqueue_raw(redis_conn, ({"prompt": "hi"},))
    redis_conn.hset(f"rq:job:{garbage_id}", "data", b"\x00not json{")
    bad["garbage data"] = (garbage_id, "")

    good = Client(redis_url).submit(prompt="The capital of Italy is", max_tokens=8)
    assert good.result(timeout=300).usage.completion_tokens > 0

    client = Client(redis_url)
    registry = FailedJobRegistry(queue_name("default"), connection=redis_conn, serializer=JSONSerializer)
    failed = set(registry.get_job_ids())
    for name, (job_id, needle) in bad.items():
        assert job_id in failed, name
        job = Job.fetch(job_id, connection=redis_conn, serializer=JSONSerializer)
        assert job.get_status(refresh=True).value == "failed", name
        if needle:
            with pytest.raises(JobFailed, match=needle):
                client.job(job_id).result(timeout=5)
    assert worker_process.poll() is None  # still serving
