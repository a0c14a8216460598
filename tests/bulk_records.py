"""Bulk output records as the tests read them: OpenAI's batch output line type, a
validator of one output line, and a sample result / done event (shared by
test_bulk_format.py and test_bulk.py)."""

from __future__ import annotations

import json
from pathlib import Path

from openai.types import Completion
from openai.types.batch_error import BatchError
from openai.types.chat import ChatCompletion
from pydantic import BaseModel, ConfigDict

from kiviq.jobs.models import (EventType, FinishReason, GenerationResult, StreamEvent, TokenLogprob, TopLogprob,
                               Usage)

try:  # OpenAI's batch output line type, where this openai version has one (3.57 does not)
    from openai.types import BatchRequestOutput
except ImportError:
    class _Response(BaseModel):
        model_config = ConfigDict(extra="forbid")
        status_code: int
        request_id: str
        body: dict

    class BatchRequestOutput(BaseModel):
        """OpenAI's documented batch output line (platform.openai.com/docs/api-reference/batch/request-output)."""

        model_config = ConfigDict(extra="forbid")
        id: str
        custom_id: str
        response: _Response | None
        error: BatchError | None


def validate_record(record: dict) -> ChatCompletion | Completion | None:
    """Validate one output line as OpenAI batch output, its body as a
    ChatCompletion / Completion; returns the body (None for error lines)."""
    line = BatchRequestOutput.model_validate(record)
    assert record["id"].startswith("batch_req_") and len(record["id"]) > len("batch_req_")
    assert (record["response"] is None) != (record["error"] is None)
    if record["error"] is not None:
        assert set(record["error"]) == {"code", "message", "line"}
        return None
    assert record["response"]["status_code"] == 200 and line.response.request_id
    body = record["response"]["body"]
    assert set(body) == {"id", "object", "created", "model", "choices", "usage", "kiviq"}  # one extra key
    assert isinstance(body["created"], int) and len(body["choices"]) == 1
    if body["object"] == "chat.completion":
        parsed = ChatCompletion.model_validate(body)
        assert body["id"] == "chatcmpl-" + record["response"]["request_id"]
        assert parsed.choices[0].message.role == "assistant" and "text" not in body["choices"][0]
    else:
        assert body["object"] == "text_completion"
        parsed = Completion.model_validate(body)
        assert body["id"] == "cmpl-" + record["response"]["request_id"]
        assert "message" not in body["choices"][0]
    assert parsed.usage.total_tokens == parsed.usage.prompt_tokens + parsed.usage.completion_tokens
    return parsed


def text_of(record: dict) -> str:
    choice = record["response"]["body"]["choices"][0]
    return choice["message"]["content"] if "message" in choice else choice["text"]


def line_of(record: dict) -> int:
    return record["error"]["line"] if record["error"] else record["response"]["body"]["kiviq"]["line"]


def write_jsonl(path: Path, lines: list) -> Path:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


def read_out(path: Path) -> list[dict]:
    return [json.loads(s) for s in path.read_text().splitlines()]


def sample_result(finish=FinishReason.length, logprobs=False) -> GenerationResult:
    result = GenerationResult(job_id="kiviq-j1", text=" aé", token_ids=[7, 8], finish_reason=finish,
                              usage=Usage(prompt_tokens=3, completion_tokens=2))
    if logprobs:
        result.logprobs = [
            TokenLogprob(token_id=7, token=" a", logprob=-0.5, top_logprobs=[
                TopLogprob(token_id=7, token=" a", logprob=-0.5), TopLogprob(token_id=9, token=" b", logprob=-1.5)]),
            TokenLogprob(token_id=8, token="é", logprob=-9999.0, top_logprobs=[
                TopLogprob(token_id=3, token="x", logprob=-0.1), TopLogprob(token_id=8, token="é", logprob=-9999.0)]),
        ]
    return result


def done_event(result: GenerationResult) -> StreamEvent:
    return StreamEvent(job_id=result.job_id, seq=2, type=EventType.done, result=result,
                       finish_reason=result.finish_reason)
