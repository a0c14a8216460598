"""Job contract: pydantic models and Redis names. Never imports mlx."""

from kiviq.jobs.keys import Priority, event_channel, queue_name, queue_names, replay_log
from kiviq.jobs.models import (
    ChatMessage,
    EventType,
    FinishReason,
    GenerateRequest,
    GenerationResult,
    StreamEvent,
    Timing,
    TokenLogprob,
    TopLogprob,
    Usage,
)
from kiviq.jobs.validation import InvalidRequest, validate_request

__all__ = [
    "ChatMessage",
    "EventType",
    "FinishReason",
    "GenerateRequest",
    "GenerationResult",
    "InvalidRequest",
    "Priority",
    "StreamEvent",
    "Timing",
    "TokenLogprob",
    "TopLogprob",
    "Usage",
    "event_channel",
    "queue_name",
    "queue_names",
    "replay_log",
    "validate_request",
]
