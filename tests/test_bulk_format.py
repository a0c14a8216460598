"""Bulk JSONL, the pure parts: line parsing and OpenAI mapping, output records
(validated with the ``openai`` package's own types), resumable output files and
the progress bar."""

from __future__ import annotations

import json
import os

import fakeredis
import pytest
from openai.types import Completion
from openai.types.batch_error import BatchError
from openai.types.chat import ChatCompletion

from bulk_records import done_event, sample_result, validate_record
from kiviq.client import Client
from kiviq.client.bulk import BulkSummary, Progress
from kiviq.client.bulk_format import drop_error_lines, error_record, idempotency_key, ok_record, parse_line, read_done
from kiviq.jobs.models import FinishReason


def test_openai_completions_line_maps_fields():
    line = parse_line(json.dumps({
        "custom_id": "a", "method": "POST", "url": "/v1/completions",
        "body": {"model": "whatever", "prompt": "The sky is", "max_completion_tokens": 5, "temperature": 0.5,
                 "top_p": 0.9, "stop": "\n", "seed": 3, "n": 1}}), 1)
    assert line.error is None and line.custom_id == "a"
    r = line.request
    assert (r.prompt, r.max_tokens, r.temperature, r.top_p, r.stop, r.seed) == ("The sky is", 5, 0.5, 0.9, ["\n"], 3)


def test_openai_chat_line_maps_messages_and_parts():
    line = parse_line(json.dumps({
        "custom_id": "c", "method": "POST", "url": "/v1/chat/completions",
        "body": {"messages": [{"role": "developer", "content": "Be brief."},
                              {"role": "user", "content": [{"type": "text", "text": "Hi "},
                                                           {"type": "text", "text": "there"}]}],
                 "max_tokens": 7}}), 4)
    assert line.error is None
    assert [(m.role, m.content) for m in line.request.messages] == [("system", "Be brief."), ("user", "Hi there")]
    assert line.request.max_tokens == 7


def test_openai_logprobs_fields_map():
    chat = parse_line(json.dumps({"url": "/v1/chat/completions", "body": {
        "messages": [{"role": "user", "content": "Hi"}], "logprobs": True, "top_logprobs": 4}}), 1)
    assert (chat.request.logprobs, chat.request.top_logprobs) == (True, 4)
    legacy = parse_line(json.dumps({"url": "/v1/completions", "body": {"prompt": "Hi", "logprobs": 2}}), 2)
    assert (legacy.request.logprobs, legacy.request.top_logprobs) == (True, 2)
    off = parse_line(json.dumps({"url": "/v1/chat/completions", "body": {
        "messages": [{"role": "user", "content": "Hi"}], "logprobs": None, "top_logprobs": None}}), 3)
    assert off.error is None and not off.request.logprobs
    bad = parse_line(json.dumps({"url": "/v1/chat/completions", "body": {
        "messages": [{"role": "user", "content": "Hi"}], "top_logprobs": 4}}), 4)
    assert "top_logprobs" in bad.error
    bad = parse_line(json.dumps({"url": "/v1/completions", "body": {"prompt": "Hi", "top_logprobs": 4}}), 5)
    assert "body.top_logprobs" in bad.error


CHAT_LINE = json.dumps({"custom_id": "c", "method": "POST", "url": "/v1/chat/completions", "body": {
    "model": "gpt-4o-mini", "messages": [{"role": "user", "content": "Hi"}], "logprobs": True, "top_logprobs": 2}})
COMPLETION_LINE = json.dumps({"custom_id": "p", "method": "POST", "url": "/v1/completions", "body": {
    "model": "gpt-3.5-turbo-instruct", "prompt": "Hi", "logprobs": 2}})


def test_chat_body_validates_as_openai_chat_completion_with_logprobs():
    line = parse_line(CHAT_LINE, 4)
    record = ok_record(line, done_event(sample_result(logprobs=True)))
    body = validate_record(record)
    assert isinstance(body, ChatCompletion) and body.object == "chat.completion"
    assert record["custom_id"] == "c" and record["response"]["request_id"] == "kiviq-j1"
    assert body.model == "gpt-4o-mini"  # echoed from the request
    choice = body.choices[0]
    assert (choice.index, choice.message.content, choice.finish_reason) == (0, " aé", "length")
    content = choice.logprobs.content
    assert [(t.token, t.logprob, t.bytes) for t in content] == [(" a", -0.5, [32, 97]), ("é", -9999.0, [195, 169])]
    assert [(a.token, a.logprob, a.bytes) for a in content[0].top_logprobs] == [(" a", -0.5, [32, 97]),
                                                                             (" b", -1.5, [32, 98])]
    assert body.usage.model_dump(exclude_none=True) == {"prompt_tokens": 3, "completion_tokens": 2,
                                                        "total_tokens": 5}
    assert record["response"]["body"]["kiviq"]["line"] == 4
    assert record["response"]["body"]["kiviq"]["finish_reason"] == "length"


def test_completion_body_validates_as_openai_completion_with_logprobs():
    line = parse_line(COMPLETION_LINE, 2)
    body = validate_record(ok_record(line, done_event(sample_result(finish=FinishReason.stop, logprobs=True))))
    assert isinstance(body, Completion) and body.object == "text_completion"
    assert body.model == "gpt-3.5-turbo-instruct" and body.id == "cmpl-kiviq-j1"
    choice = body.choices[0]
    assert (choice.index, choice.text, choice.finish_reason) == (0, " aé", "stop")
    lp = choice.logprobs
    assert lp.tokens == [" a", "é"] and lp.token_logprobs == [-0.5, -9999.0]
    assert lp.top_logprobs == [{" a": -0.5, " b": -1.5}, {"x": -0.1, "é": -9999.0}]
    assert lp.text_offset == [0, 2]


def test_bodies_without_logprobs_and_default_model():
    plain_chat = parse_line('{"messages": [{"role": "user", "content": "q"}]}', 1)
    plain_prompt = parse_line('{"prompt": "q", "model": "my-model"}', 2)
    assert plain_prompt.error is None and plain_prompt.model == "my-model"  # plain lines may name a model too
    chat = ok_record(plain_chat, done_event(sample_result()))
    assert chat["response"]["body"]["choices"][0]["logprobs"] is None
    assert validate_record(chat).model == "kiviq"  # no model in the request (nor the result)
    assert validate_record(ok_record(plain_prompt, done_event(sample_result()))).model == "my-model"
    assert "body.model" in parse_line('{"url": "/v1/completions", "body": {"prompt": "x", "model": 3}}', 1).error


@pytest.mark.parametrize("kiviq_reason, openai_reason", [
    (FinishReason.stop, "stop"), (FinishReason.length, "length"),
    (FinishReason.cancelled, "length"), (FinishReason.timeout, "length"),
])
def test_finish_reason_mapping(kiviq_reason, openai_reason):
    for text in (CHAT_LINE, COMPLETION_LINE):
        record = ok_record(parse_line(text, 1), done_event(sample_result(finish=kiviq_reason)))
        assert validate_record(record).choices[0].finish_reason == openai_reason
        assert record["response"]["body"]["kiviq"]["finish_reason"] == kiviq_reason.value


def test_error_record_shape():
    record = error_record(parse_line('{"custom_id": "e", "prompt": 1}', 7), "line 7: prompt: bad", "invalid_request")
    assert validate_record(record) is None
    assert record["error"] == {"code": "invalid_request", "message": "line 7: prompt: bad", "line": 7}
    assert BatchError.model_validate(record["error"]).line == 7
    assert ok_record(parse_line(CHAT_LINE, 1), done_event(sample_result()))["id"] != record["id"]


def test_plain_lines_and_defaults():
    line = parse_line('{"prompt": "x"}', 9, {"max_tokens": 4, "temperature": 0.3})
    assert line.custom_id == "line-9" and line.request.max_tokens == 4 and line.request.temperature == 0.3
    line = parse_line('{"custom_id": "m", "messages": [{"role": "user", "content": "q"}], "max_tokens": 2}', 2,
                      {"max_tokens": 4})
    assert line.custom_id == "m" and line.request.max_tokens == 2  # the line wins over defaults


@pytest.mark.parametrize("text, needle, code", [
    ('{"prompt": "x",', "invalid JSON", "invalid_json"),
    ('["x"]', "expected a JSON object", "invalid_request"),
    ('{"prompt": "x", "colour": "red"}', "colour", "invalid_request"),
    ('{"prompt": "x", "max_tokens": 0}', "max_tokens", "invalid_request"),
    ('{"prompt": "x", "idempotency_key": "k"}', "idempotency_key", "invalid_request"),
    ('{"custom_id": 5, "prompt": "x"}', "custom_id", "invalid_request"),
    ('{"url": "/v1/completions", "body": {"prompt": "x", "presence_penalty": 1}}', "body.presence_penalty",
     "invalid_request"),
    ('{"url": "/v1/completions", "body": {"prompt": "x", "logprobs": 21}}', "top_logprobs", "invalid_request"),
    ('{"url": "/v1/completions", "body": {"prompt": "x", "n": 2}}', "body.n", "invalid_request"),
    ('{"url": "/v1/embeddings", "body": {"input": "x"}}', "url", "invalid_request"),
    ('{"method": "GET", "url": "/v1/completions", "body": {"prompt": "x"}}', "method", "invalid_request"),
    ('{"url": "/v1/completions", "body": {"messages": []}}', "body.messages", "invalid_request"),
    ('{"url": "/v1/chat/completions", "body": {"prompt": "x"}}', "body.prompt", "invalid_request"),
    ('{"url": "/v1/completions", "body": {"prompt": "x"}, "extra": 1}', "extra", "invalid_request"),
    ('{"url": "/v1/completions", "body": {"prompt": "x", "max_tokens": 3, "max_completion_tokens": 4}}',
     "max_completion_tokens", "invalid_request"),
])
def test_bad_lines_are_errors_naming_the_problem(text, needle, code):
    line = parse_line(text, 3)
    assert line.request is None and needle in line.error and line.error.startswith("line 3:")
    assert line.code == code


def test_idempotency_key_is_stable_and_valid():
    req = parse_line('{"prompt": "x", "max_tokens": 3}', 1).request
    k = idempotency_key("in.jsonl", "a", req)
    assert k == idempotency_key("in.jsonl", "a", req.model_copy(update={"idempotency_key": "zz"}))
    assert k != idempotency_key("in.jsonl", "b", req)
    assert k != idempotency_key("other.jsonl", "a", req)
    assert k != idempotency_key("in.jsonl", "a", req.model_copy(update={"max_tokens": 4}))
    assert Client(connection=fakeredis.FakeRedis()).submit(prompt="x", idempotency_key=k)  # a valid key


def test_read_done_repairs_a_truncated_last_line(tmp_path):
    ok = ok_record(parse_line('{"custom_id": "a", "prompt": "x"}', 1), done_event(sample_result()))
    failed = error_record(parse_line('{"custom_id": "f", "prompt": "x"}', 2), "m", "job_failed")
    dup = error_record(parse_line('{"custom_id": "a", "prompt": "y"}', 5), "m", "duplicate_custom_id")
    old_format = {"id": "job", "custom_id": "o", "line": 6, "response": {"status_code": 200, "body": {}},
                  "error": None}
    out = tmp_path / "out.jsonl"
    out.write_text("".join(json.dumps(r) + "\n" for r in (ok, failed, dup, old_format)) + '{"custom_id": "b", "li')
    state = read_done(str(out))
    assert state.ok_ids == {"a", "o"} and state.error_ids == {"f"} and state.dup_lines == {5}
    assert (state.ok, state.failed) == (2, 2) and state.done_ids == {"a", "o", "f"}
    assert out.read_text().endswith("}\n") and out.read_text().count("\n") == 4  # the partial line is gone


def test_drop_error_lines_rewrites_atomically(tmp_path, monkeypatch):
    ok = ok_record(parse_line('{"custom_id": "a", "prompt": "x"}', 1), done_event(sample_result()))
    failed = error_record(parse_line('{"custom_id": "f", "prompt": "x"}', 2), "m", "job_failed")
    out = tmp_path / "out.jsonl"
    out.write_text(json.dumps(ok) + "\n" + json.dumps(failed) + "\n")
    replaced = []
    real_replace = os.replace
    monkeypatch.setattr(os, "replace", lambda a, b: (replaced.append((a, b)), real_replace(a, b)))
    assert drop_error_lines(str(out)) == ["f"]
    assert [json.loads(s) for s in out.read_text().splitlines()] == [ok]
    (src, dst), = replaced
    assert os.path.dirname(src) == str(tmp_path) and dst == str(out)
    assert sorted(os.listdir(tmp_path)) == ["out.jsonl"]  # no temporary file left
    assert drop_error_lines(str(out)) == [] and not replaced[1:]  # nothing to drop: not rewritten


def test_progress_is_tqdm():
    import io

    s = BulkSummary(total=4, ok=1, failed=1, skipped=0, completion_tokens=40)
    stream = io.StringIO()
    p = Progress(s, enabled=True, stream=stream)
    p.skip()
    s.skipped += 1
    p.advance()
    p.advance()
    p.close()
    text = stream.getvalue()
    assert p.bar.total == 3 and p.bar.n == 2
    assert "bulk:" in text and "2/3" in text and "line/s" in text and "ok=1" in text and "tok/s=" in text
    quiet = io.StringIO()
    q = Progress(BulkSummary(total=2), enabled=False, stream=quiet)
    q.advance()
    q.close()
    assert quiet.getvalue() == ""


