"""Request, result and stream-event models: the JSON contract between
clients, Redis and the worker.

Everything that crosses Redis is one of these models dumped to JSON; the
worker re-validates what it reads, so a hand-written or stale job fails with
the same field-named message a client would have seen at submit.
"""

from __future__ import annotations

from enum import Enum
from typing import Any, Literal, NamedTuple

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from kiviq.jobs.keys import Priority

MAX_PROMPT_CHARS = 1_000_000  # payload bound: keeps one job from filling Redis
MAX_NEW_TOKENS = 32_768
MAX_STOP_STRINGS = 16
MAX_TOP_LOGPROBS = 20  # OpenAI's limit


class FinishReason(str, Enum):
    stop = "stop"  # EOS token or a stop string
    length = "length"  # max_tokens or the model's context reached
    cancelled = "cancelled"
    timeout = "timeout"
    error = "error"


class EventType(str, Enum):
    token = "token"
    done = "done"
    error = "error"
    restarted = "restarted"  # a requeued job starts over: drop text seen so far


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "user", "assistant", "tool"]
    content: str = Field(max_length=MAX_PROMPT_CHARS)


class GenerateRequest(BaseModel):
    """One generation job as a client submits it.

    Exactly one of ``prompt`` (raw completion) or ``messages`` (chat, rendered
    with the model's chat template on the worker) must be given.
    """

    model_config = ConfigDict(extra="forbid")

    prompt: str | None = Field(default=None, min_length=1, max_length=MAX_PROMPT_CHARS)
    messages: list[ChatMessage] | None = Field(default=None, min_length=1, max_length=1024)
    max_tokens: int = Field(default=256, ge=1, le=MAX_NEW_TOKENS)
    temperature: float = Field(default=0.0, ge=0.0, le=100.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0)
    min_p: float = Field(default=0.0, ge=0.0, lt=1.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=10.0)
    stop: list[str] = Field(default_factory=list, max_length=MAX_STOP_STRINGS)
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    logprobs: bool = False  # each generated token's logprob in events and the result
    top_logprobs: int = Field(default=0, ge=0, le=MAX_TOP_LOGPROBS)  # with logprobs: the N most likely tokens too
    priority: Priority = Priority.default
    timeout_s: float | None = Field(default=None, gt=0.0, le=7 * 24 * 3600)
    idempotency_key: str | None = Field(
        default=None, min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_-]+$"
    )

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_as_list(cls, value):
        return [value] if isinstance(value, str) else value

    @field_validator("stop")
    @classmethod
    def _stop_strings_non_empty(cls, value: list[str]) -> list[str]:
        for s in value:
            if not s or len(s) > 256:
                raise ValueError("each stop string must have 1 to 256 characters")
        return value

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_needs_logprobs(cls, value: int, info: ValidationInfo) -> int:
        if value and not info.data.get("logprobs"):
            raise ValueError("requires logprobs=true")
        return value

    @model_validator(mode="after")
    def _prompt_xor_messages(self) -> "GenerateRequest":
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of 'prompt' or 'messages'")
        return self

    def job_args(self, **dump_options: Any) -> dict[str, Any]:
        """The request as JSON-ready job data. Logprob fields appear only when
        asked for, so other jobs are exactly as before they existed (workers
        that predate them accept them; bulk idempotency keys do not move)."""
        exclude = set(dump_options.pop("exclude", None) or ())
        if not self.logprobs:
            exclude |= {"logprobs", "top_logprobs"}
        return self.model_dump(mode="json", exclude=exclude, **dump_options)


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


class Timing(BaseModel):
    queue_s: float = 0.0  # enqueue -> admitted by the worker
    ttft_s: float = 0.0  # admitted -> first token
    total_s: float = 0.0  # admitted -> finished
    decode_tokens_per_s: float = 0.0


class TopLogprob(BaseModel):
    token_id: int
    token: str  # the token's text on its own (a partial UTF-8 character shows as U+FFFD)
    logprob: float


class TokenLogprob(TopLogprob):
    """One generated token (OpenAI's ``logprobs.content`` item, plus ids).
    Logprobs are log_softmax(logits / temperature) before top-k/top-p/min-p
    (temperature 1 for greedy requests); -9999.0 stands for -inf."""

    top_logprobs: list[TopLogprob] = Field(default_factory=list)  # best first


class GenerationResult(BaseModel):
    job_id: str
    text: str
    token_ids: list[int]
    finish_reason: FinishReason
    usage: Usage
    timing: Timing = Field(default_factory=Timing)
    logprobs: list[TokenLogprob] | None = None  # aligned with token_ids; None unless requested


class StreamEvent(BaseModel):
    """One event on a job's stream; ``seq`` counts from 0 with no gaps."""

    job_id: str
    seq: int = Field(ge=0)
    type: EventType
    text: str = ""
    token_ids: list[int] = Field(default_factory=list)
    finish_reason: FinishReason | None = None
    error: str | None = None
    result: GenerationResult | None = None
    logprobs: list[TokenLogprob] | None = None  # token events of requests that asked; aligned with token_ids


class TokenEvent(NamedTuple):
    """A token event as the worker's engine thread hands it over: a tuple costs
    ~0.3 us to make where a validated StreamEvent costs ~1.7 (a decode step makes
    one per running job); ``EventPublisher`` writes it as its StreamEvent's JSON on
    the publishing thread."""

    job_id: str
    seq: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None

    def stream_event(self) -> StreamEvent:
        return StreamEvent(job_id=self.job_id, seq=self.seq, type=EventType.token, text=self.text,
                           token_ids=self.token_ids, logprobs=self.logprobs)
