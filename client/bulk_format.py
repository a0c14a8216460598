"""The bulk file formats: input lines (OpenAI Batch API requests or plain
kiviq requests) to validated requests, and results to output records.
Pure functions over text and files; ``kiviq.client.bulk`` runs them.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from kiviq.jobs.models import FinishReason, GenerateRequest, GenerationResult, StreamEvent
from kiviq.jobs.validation import InvalidRequest, validate_request

COMPLETIONS_URL = "/v1/completions"
CHAT_URL = "/v1/chat/completions"
OPENAI_LINE_KEYS = {"custom_id", "method", "url", "body"}
# OpenAI body fields kiviq maps (model is echoed in the output; n must be 1). Logprobs: chat
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
    model: str | None = None  # the request's ``model``, echoed in the output body


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
    model = None
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
            model = obj["body"].get("model")
        else:
            fields = {k: v for k, v in obj.items() if k not in ("custom_id", "model")}
            model = obj.get("model")
            if "idempotency_key" in fields:
                raise LineError("idempotency_key: set by bulk from the custom_id; remove it")
        if model is not None and not isinstance(model, str):
            raise LineError(("body.model" if "body" in obj else "model") + ": must be a string")
        request = validate_request({**(defaults or {}), **fields})
    except (LineError, InvalidRequest) as e:
        return BulkLine(line_no, custom_id, error=f"line {line_no}: {e}", code=getattr(e, "code", "invalid_request"))
    return BulkLine(line_no, custom_id, request=request, model=model)


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
#
# One line per input line, in OpenAI's batch output format:
#   {"id": "batch_req_<hex>", "custom_id": ..., "error": null,
#    "response": {"status_code": 200, "request_id": "<kiviq job id>", "body": <completion>}}
#   {"id": "batch_req_<hex>", "custom_id": ..., "response": null,
#    "error": {"code": ..., "message": ..., "line": <input line>}}
# The body is a ``chat.completion`` (messages) or ``text_completion`` (prompt)
# object; kiviq's own fields sit under its one extra key ``kiviq``.

EXTRA_KEY = "kiviq"
DEFAULT_MODEL = "kiviq"  # the body's ``model`` when neither the request nor the result names one
# kiviq finish reason -> OpenAI's. A cancelled or timed-out job ended early with
# partial text: "length" (cut short), the original kept in body["kiviq"]["finish_reason"].
FINISH_REASONS = {FinishReason.stop: "stop", FinishReason.length: "length",
                  FinishReason.cancelled: "length", FinishReason.timeout: "length"}


def batch_request_id() -> str:
    return "batch_req_" + uuid.uuid4().hex


def _token_bytes(token: str) -> list[int]:
    return list(token.encode("utf-8"))


def chat_logprobs(result: GenerationResult) -> dict[str, Any]:
    """OpenAI chat's ``choices[0].logprobs``: {content: [{token, logprob, bytes, top_logprobs}]}."""
    return {"content": [
        {"token": t.token, "logprob": t.logprob, "bytes": _token_bytes(t.token),
         "top_logprobs": [{"token": a.token, "logprob": a.logprob, "bytes": _token_bytes(a.token)}
                          for a in t.top_logprobs]}
        for t in result.logprobs or []], "refusal": None}


def completion_logprobs(result: GenerationResult) -> dict[str, Any]:
    """Legacy completions' ``choices[0].logprobs``: parallel lists; ``text_offset``
    is each token's character offset in the generated text (tokens' texts summed)."""
    tokens, offsets, offset = [], [], 0
    for t in result.logprobs or []:
        tokens.append(t.token)
        offsets.append(offset)
        offset += len(t.token)
    return {"tokens": tokens, "token_logprobs": [t.logprob for t in result.logprobs or []],
            "top_logprobs": [{a.token: a.logprob for a in t.top_logprobs} for t in result.logprobs or []],
            "text_offset": offsets}


def completion_body(line: BulkLine, result: GenerationResult, created: int | None = None) -> dict[str, Any]:
    """The OpenAI ``chat.completion`` / ``text_completion`` object of a result."""
    chat = line.request is not None and line.request.messages is not None
    model = line.model or getattr(result, "model", None) or DEFAULT_MODEL
    choice: dict[str, Any] = {"index": 0, "finish_reason": FINISH_REASONS.get(result.finish_reason, "stop")}
    if chat:
        choice["message"] = {"role": "assistant", "content": result.text, "refusal": None}
    else:
        choice["text"] = result.text
    if result.logprobs is not None:
        choice["logprobs"] = chat_logprobs(result) if chat else completion_logprobs(result)
    else:
        choice["logprobs"] = None
    usage = result.usage
    return {
        "id": ("chatcmpl-" if chat else "cmpl-") + result.job_id,
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()) if created is None else created,
        "model": model,
        "choices": [choice],
        "usage": {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
                  "total_tokens": usage.total_tokens},
        EXTRA_KEY: {"line": line.line_no, "finish_reason": result.finish_reason.value,
                    "timing": result.timing.model_dump(mode="json")},
    }


def ok_record(line: BulkLine, event: StreamEvent) -> dict[str, Any]:
    return {"id": batch_request_id(), "custom_id": line.custom_id,
            "response": {"status_code": 200, "request_id": event.job_id,
                         "body": completion_body(line, event.result)},
            "error": None}


def error_record(line: BulkLine, message: str, code: str) -> dict[str, Any]:
    return {"id": batch_request_id(), "custom_id": line.custom_id, "response": None,
            "error": {"code": code, "message": message, "line": line.line_no}}


def _record_line(record: dict[str, Any]) -> int:
    """A record's input line number (error.line, body.kiviq.line, or the
    pre-OpenAI-format top-level ``line``); 0 if it has none."""
    error = record.get("error")
    if isinstance(error, dict) and isinstance(error.get("line"), int):
        return error["line"]
    body = (record.get("response") or {}).get("body") if isinstance(record.get("response"), dict) else None
    extra = body.get(EXTRA_KEY) if isinstance(body, dict) else None
    if isinstance(extra, dict) and isinstance(extra.get("line"), int):
        return extra["line"]
    line = record.get("line")
    return line if isinstance(line, int) else 0


@dataclass
class OutState:
    """What the output file already holds. ``ok_ids`` / ``error_ids``: custom_ids
    of result and error lines; ``dup_lines``: input line numbers of
    duplicate-custom_id errors; ``ok`` / ``failed``: its line counts."""

    ok_ids: set[str] = field(default_factory=set)
    error_ids: set[str] = field(default_factory=set)
    dup_lines: set[int] = field(default_factory=set)
    ok: int = 0
    failed: int = 0

    @property
    def done_ids(self) -> set[str]:
        return self.ok_ids | self.error_ids


def _read_records(out_path: str) -> list[tuple[bytes, dict[str, Any] | None]]:
    """(raw line, parsed record or None) of the output file. A truncated last
    line (a run killed mid-write) is cut off the file."""
    if not os.path.exists(out_path):
        return []
    with open(out_path, "rb+") as f:
        data = f.read()
        if data and not data.endswith(b"\n"):
            keep = data.rfind(b"\n") + 1
            f.truncate(keep)
            data = data[:keep]
    out = []
    for raw in data.splitlines():
        try:
            record = json.loads(raw)
            if not isinstance(record, dict) or not isinstance(record.get("custom_id"), str):
                record = None
        except ValueError:
            record = None
        out.append((raw, record))
    return out


def read_done(out_path: str) -> OutState:
    """The state of the output file (see OutState); unreadable lines are ignored."""
    state = OutState()
    for _raw, record in _read_records(out_path):
        if record is None:
            continue
        error = record.get("error")
        if error:
            state.failed += 1
            if isinstance(error, dict) and error.get("code") == "duplicate_custom_id":
                state.dup_lines.add(_record_line(record))
            else:
                state.error_ids.add(record["custom_id"])
        else:
            state.ok += 1
            state.ok_ids.add(record["custom_id"])
    return state


def drop_error_lines(out_path: str) -> list[str]:
    """Remove every error line from the output file (for a rerun of failed
    lines), atomically: a temporary file in the same directory replaces it.
    Returns the removed lines' custom_ids."""
    records = _read_records(out_path)
    keep = [raw for raw, record in records if record is None or not record.get("error")]
    dropped = [record["custom_id"] for _raw, record in records if record is not None and record.get("error")]
    if not dropped:
        return dropped
    directory = os.path.dirname(os.path.abspath(out_path))
    fd, tmp = tempfile.mkstemp(prefix=".kiviq-bulk-", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(b"".join(raw + b"\n" for raw in keep))
            f.flush()
            os.fsync(f.fileno())
        try:
            os.chmod(tmp, os.stat(out_path).st_mode & 0o7777)
        except OSError:
            pass
        os.replace(tmp, out_path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return dropped


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
