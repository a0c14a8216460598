"""Request models of the OpenAI endpoints, and their mapping onto kiviq's
``GenerateRequest``.

The models mirror OpenAI's request bodies (unknown fields are rejected, so a
typo or an unsupported option never passes silently). After the OpenAI-level
checks, the body goes through the same mapping ``kiviq bulk`` uses for Batch
API lines (``client.bulk_format.openai_body_fields``) and kiviq's own request
validation, so a request means the same thing on every path.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from kiviq.client.bulk_format import CHAT_URL, LineError, openai_body_fields
from kiviq.gateway.errors import APIError
from kiviq.jobs.keys import Priority
from kiviq.jobs.models import GenerateRequest
from kiviq.jobs.validation import InvalidRequest, describe, validate_request

# Fields the gateway reads itself and does not hand to the job.
GATEWAY_FIELDS = {"stream", "stream_options", "user", "presence_penalty", "frequency_penalty"}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: bool | None = None


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart]
    name: str | None = None  # accepted, not used


class _Common(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    user: str | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    # kiviq's own (as vLLM accepts top_k & co.)
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    priority: Priority | None = None
    timeout_s: float | None = None

    @field_validator("n")
    @classmethod
    def _only_one_choice(cls, value: int | None) -> int | None:
        if value is not None and value != 1:
            raise ValueError("only n=1 is supported")
        return value

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalties(cls, value: float | None) -> float | None:
        if value:
            raise ValueError("not supported (only 0); kiviq has repetition_penalty")
        return value


class ChatCompletionRequest(_Common):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None


class CompletionRequest(_Common):
    prompt: str | list[str]
    logprobs: int | None = None  # legacy completions: the number of alternatives
    echo: bool | None = None
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, value: str | list[str]) -> str | list[str]:
        if isinstance(value, list) and len(value) != 1:
            raise ValueError("exactly one prompt is supported")
        return value

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, value: bool | None) -> bool | None:
        if value:
            raise ValueError("echo=true is not supported")
        return value

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, value: str | None) -> str | None:
        if value is not None:
            raise ValueError("not supported")
        return value


def _first_field(fields: list[str]) -> str | None:
    return fields[0] if fields else None


def parse_request(url: str, body: Any) -> tuple[_Common, GenerateRequest]:
    """Validate a request body of ``url`` (chat or completions).

    Returns:
        (the OpenAI-level model, the kiviq request to enqueue).

    Raises:
        APIError: 400, its message naming every bad field, ``param`` the first.
    """
    if not isinstance(body, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    model_cls = ChatCompletionRequest if url == CHAT_URL else CompletionRequest
    try:
        parsed = model_cls.model_validate(body)
    except ValidationError as e:
        message, fields = describe(e)
        raise APIError(400, message, param=_first_field(fields), code="invalid_value") from None
    given = parsed.model_dump(mode="json", exclude_unset=True, exclude_none=True)
    openai = {k: v for k, v in given.items() if k not in GATEWAY_FIELDS and k not in ("echo", "suffix")}
    for message in openai.get("messages", []):
        message.pop("name", None)
    try:
        fields = openai_body_fields(url, openai)
        request = validate_request(fields)
    except LineError as e:
        message = str(e).replace("body.", "")
        raise APIError(400, message, param=message.split(":")[0], code="invalid_value") from None
    except InvalidRequest as e:
        message = str(e).removeprefix("invalid generation request: ")
        raise APIError(400, message, param=_first_field(e.fields), code="invalid_value") from None
    return parsed, request

