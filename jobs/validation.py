"""Turn pydantic's errors into one message that names each bad field."""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from kiviq.jobs.models import GenerateRequest


class InvalidRequest(ValueError):
    """A request failed validation; ``fields`` lists the offending field names."""

    def __init__(self, message: str, fields: list[str]):
        super().__init__(message)
        self.fields = fields


def describe(error: ValidationError) -> tuple[str, list[str]]:
    """Render a ValidationError as 'field: problem; field: problem'."""
    parts, fields = [], []
    for item in error.errors():
        field = ".".join(str(p) for p in item["loc"]) or "request"
        fields.append(field)
        parts.append(f"{field}: {item['msg']}")
    return "; ".join(parts), fields


def validate_request(payload: Any) -> GenerateRequest:
    """Validate a dict (or a GenerateRequest) as a generation request.

    Raises:
        InvalidRequest: with a message naming every invalid field.
    """
    if isinstance(payload, GenerateRequest):
        return payload
    if not isinstance(payload, dict):
        raise InvalidRequest(
            f"request: expected a JSON object, got {type(payload).__name__}", ["request"]
        )
    try:
        return GenerateRequest.model_validate(payload)
    except ValidationError as e:
        message, fields = describe(e)
        raise InvalidRequest(f"invalid generation request: {message}", fields) from None
