"""Plain-Python request and event types shared by the engine's parts.

The engine never sees pydantic models or Redis: the worker translates a
validated job into a ``Request`` and turns ``StepEvent``s back into stream
events.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    logprobs: int | None = None  # None: no logprobs; N: the chosen token's and the N most likely

    def __post_init__(self):
        if self.logprobs is not None and self.logprobs < 0:
            raise ValueError("logprobs must be None or >= 0")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(slots=True)
class Request:
    """One sequence to generate.

    Args:
        request_id: caller's id (the job id); unique among active requests.
        prompt_tokens: token ids of the rendered prompt.
        max_tokens: most new tokens to generate.
        sampling: sampling parameters.
        stop: strings that end generation; the matched text is not emitted.
        deadline: ``time.monotonic()`` value after which the request ends with
            finish reason ``timeout`` (None: no deadline).
    """

    request_id: str
    prompt_tokens: list[int]
    max_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: list[str] = field(default_factory=list)
    deadline: float | None = None

    def __post_init__(self):
        if not self.prompt_tokens:
            raise ValueError("prompt_tokens must not be empty")
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")


@dataclass(slots=True)
class TokenLogprob:
    """A generated token's logprob and the most likely alternatives
    (``top``: (token id, logprob) pairs, best first; see engine.sampler)."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass(slots=True)
class StepEvent:
    """What one engine step produced for one request.

    ``finish_reason`` is set on the request's last event ("stop", "length",
    "timeout", "cancelled" or "error"); ``error`` carries the reason for
    "error". ``logprobs`` is aligned with ``token_ids`` when the request asked
    for logprobs, else None.
    """

    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    error: str | None = None
    prompt_tokens: int = 0
    logprobs: list[TokenLogprob] | None = None
