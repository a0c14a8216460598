"""The bulk file formats: input lines (OpenAI Batch API requests or plain
kiviq requests) to validated requests, and results to output records.
Pure functions over text and files; ``kiviq.client.bulk`` runs them.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from kiviq.jobs.models import GenerateRequest, StreamEvent
from kiviq.jobs.validation import InvalidRequest, validate_request

COMPLETIONS_URL = "/v1/completions"
CHAT_URL = "/v1/chat/completions"
OPENAI_LINE_KEYS = {"custom_id", "method", "url", "body"}
# OpenAI body fields kiviq maps (model is ignored; n must be 1). Logprobs: chat
# takes ``logprobs: bool`` + ``top_logprobs: N``, completions ``logprobs: N``.
OPENAI_BODY_FIELDS = {"prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p",
                      "stop", "seed", "model", "n", "logprobs", "top_logprobs"}
# kiviq's own sampling/scheduling fields, accepted in an OpenAI body too
# (as vLLM accepts top_k etc.).
KIVIQ_BODY_FIELDS = {"top_k", "min_p", "repetition_penalty", "priority", "timeout_s"}
# What --max-tokens & co. (``defaults``) may set.
DEFAULT_FIELDS = set(GenerateRequest.model_fields) - {"prompt", "messages", "idempotency_key"}



class LineError(ValueError):
    """One input line cannot become a request; ``code`` classifies why."""

    def __init__(self, message: str, code: str = "invalid_request"):
        super().__init__(message)
        self.code = code


@dataclass
class BulkLine:
    """One parsed input line: a request, or the error to write for it."""

    line_no: int
    custom_id: str
    request: GenerateRequest | None = None
    error: str | None = None
    code: str | None = None


# ---- parsing (pure) ------------------------------------------------------


def _openai_messages(messages: Any) -> Any:
    """OpenAI chat messages -> kiviq's: text content parts joined, role
    ``developer`` read as ``system``. Anything else is left to validation."""
    if not isinstance(messages, list):
        return messages
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            out.append(message)
            continue
        message = dict(message)
        if message.get("role") == "developer":
            message["role"] = "system"
        content = message.get("content")
        if isinstance(content, list):
            texts = []
            for part in content:
                if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                    raise LineError(f"body.messages.{i}.content: only text content parts are supported")
                texts.append(part["text"])
            message["content"] = "".join(texts)
        out.append(message)
    return out


def openai_body_fields(url: Any, body: Any) -> dict[str, Any]:
    """Map an OpenAI Batch request body to kiviq request fields.

    Raises:
        LineError: naming the offending ``url`` or ``body.<field>``.
    """
    if url not in (COMPLETIONS_URL, CHAT_URL):
        raise LineError(f"url: must be {COMPLETIONS_URL!r} or {CHAT_URL!r}, got {url!r}")
    if not isinstance(body, dict):
        raise LineError("body: must be a JSON object")
    unknown = sorted(set(body) - OPENAI_BODY_FIELDS - KIVIQ_BODY_FIELDS)
    if unknown:
        raise LineError("; ".join(f"body.{k}: not supported" for k in unknown))
    fields = {k: v for k, v in body.items() if k not in ("model", "n", "max_completion_tokens")}
    for k in ("logprobs", "top_logprobs"):
        if k in fields and fields[k] is None:  # OpenAI's explicit "off"
            del fields[k]
    if "n" in body and body["n"] != 1:
        raise LineError("body.n: only n=1 is supported")
    if "max_completion_tokens" in body:
        if "max_tokens" in body and body["max_tokens"] != body["max_completion_tokens"]:
            raise LineError("body.max_completion_tokens: conflicts with body.max_tokens")
        fields["max_tokens"] = body["max_completion_tokens"]
    if url == COMPLETIONS_URL:
        if "messages" in body:
            raise LineError(f"body.messages: not valid for {COMPLETIONS_URL} (use {CHAT_URL})")
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            fields["prompt"] = prompt[0]  # OpenAI also takes a one-prompt list
        if "prompt" not in body:
            raise LineError(f"body.prompt: required for {COMPLETIONS_URL}")
        if "top_logprobs" in body:
            raise LineError(f"body.top_logprobs: not valid for {COMPLETIONS_URL} (its logprobs is the count)")
        count = fields.get("logprobs")
        if isinstance(count, int) and not isinstance(count, bool):  # legacy completions: logprobs=N
            fields["logprobs"], fields["top_logprobs"] = True, count
    else:
        if "prompt" in body:
            raise LineError(f"body.prompt: not valid for {CHAT_URL} (use {COMPLETIONS_URL})")
        if "messages" not in body:
            raise LineError(f"body.messages: required for {CHAT_URL}")
        fields["messages"] = _openai_messages(body["messages"])
    return fields


def parse_line(text: str, line_no: int, defaults: dict[str, Any] | None = None) -> BulkLine:
    """Parse one input line (OpenAI Batch or plain format) into a request.

    Never raises: a bad line comes back with ``error`` and ``code`` set
    (``invalid_json`` or ``invalid_request``), its ``custom_id`` being the
    line's own when readable, else ``line-<n>``.
    """
    custom_id = f"line-{line_no}"
    try:
        obj = json.loads(text)
    except ValueError as e:
        return BulkLine(line_no, custom_id, error=f"line {line_no}: invalid JSON: {e}", code="invalid_json")
    try:
        if not isinstance(obj, dict):
            raise LineError(f"expected a JSON object, got {type(obj).__name__}")
        if "custom_id" in obj:
            cid = obj["custom_id"]
            if not isinstance(cid, str) or not cid:
                raise LineError("custom_id: must be a non-empty string")
            custom_id = cid
        if {"body", "url", "method"} & set(obj):
            unknown = sorted(set(obj) - OPENAI_LINE_KEYS)
            if unknown:
                raise LineError("; ".join(f"{k}: unknown field of a batch request line" for k in unknown))
            if obj.get("method", "POST") != "POST":
                raise LineError(f"method: must be 'POST', got {obj.get('method')!r}")
            if "body" not in obj:
                raise LineError("body: required")
            fields = openai_body_fields(obj.get("url"), obj["body"])
        else:
            fields = {k: v for k, v in obj.items() if k != "custom_id"}
            if "idempotency_key" in fields:
                raise LineError("idempotency_key: set by bulk from the custom_id; remove it")
        request = validate_request({**(defaults or {}), **fields})
    except (LineError, InvalidRequest) as e:
        return BulkLine(line_no, custom_id, error=f"line {line_no}: {e}", code=getattr(e, "code", "invalid_request"))
    return BulkLine(line_no, custom_id, request=request)


def check_defaults(defaults: dict[str, Any] | None) -> dict[str, Any]:
    """Validate the defaults every line starts from.

    Raises:
        InvalidRequest: an unknown or invalid default (named).
    """
    defaults = {k: v for k, v in (defaults or {}).items() if v is not None}
    unknown = sorted(set(defaults) - DEFAULT_FIELDS)
    if unknown:
        raise InvalidRequest(f"defaults: cannot set {', '.join(unknown)}", unknown)
    validate_request({**defaults, "prompt": "x"})
    return defaults


def idempotency_key(in_path: str, custom_id: str, request: GenerateRequest) -> str:
    """The key of a line's job: the same input file, custom_id and request
    (after defaults) give the same job, so a rerun finds it."""
    ident = json.dumps([os.path.realpath(in_path), custom_id,
                        request.job_args(exclude={"idempotency_key"})], sort_keys=True)
    return "bulk-" + hashlib.sha256(ident.encode()).hexdigest()[:40]


# ---- output records ------------------------------------------------------


def ok_record(line: BulkLine, event: StreamEvent) -> dict[str, Any]:
    result = event.result
    usage = result.usage
    record = {
        "id": event.job_id, "custom_id": line.custom_id, "line": line.line_no,
        "response": {"status_code": 200, "body": {
            "text": result.text,
            "finish_reason": result.finish_reason.value,
            "usage": {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
                      "total_tokens": usage.total_tokens},
        }},
        "error": None,
    }
    if result.logprobs is not None:  # OpenAI chat's shape: {"content": [{token, logprob, top_logprobs}, ...]}
        record["response"]["body"]["logprobs"] = {"content": [t.model_dump(mode="json") for t in result.logprobs]}
    return record


def error_record(line: BulkLine, message: str, code: str, job_id: str | None = None) -> dict[str, Any]:
    return {"id": job_id, "custom_id": line.custom_id, "line": line.line_no, "response": None,
            "error": {"code": code, "message": message}}


def read_done(out_path: str) -> tuple[set[str], set[int]]:
    """custom_ids (and, for duplicate-id errors, line numbers) already in the
    output file. A truncated last line (a run killed mid-write) is cut off
    the file; other unreadable lines are ignored.
    """
    ids: set[str] = set()
    dup_lines: set[int] = set()
    if not os.path.exists(out_path):
        return ids, dup_lines
    with open(out_path, "rb+") as f:
        data = f.read()
        if data and not data.endswith(b"\n"):
            keep = data.rfind(b"\n") + 1
            f.truncate(keep)
            data = data[:keep]
    for raw in data.splitlines():
        try:
            record = json.loads(raw)
            cid = record["custom_id"]
        except (ValueError, KeyError, TypeError):
            continue
        error = record.get("error") or {}
        if isinstance(error, dict) and error.get("code") == "duplicate_custom_id":
            dup_lines.add(int(record.get("line", 0)))
        else:
            ids.add(cid)
    return ids, dup_lines


def count_lines(in_path: str) -> int:
    """Non-blank lines of the input (the progress bar's total)."""
    with open(in_path, "rb") as f:
        return sum(1 for raw in f if raw.strip())


def iter_input(in_path: str) -> Iterator[tuple[int, str | None]]:
    """(1-based line number, text) of non-blank lines; text None if not UTF-8."""
    with open(in_path, "rb") as f:
        for n, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            try:
                yield n, raw.decode("utf-8")
            except UnicodeDecodeError:
                yield n, None


# ---- progress ------------------------------------------------------------
