"""Turn a validated job request into an engine request: render, tokenize,
check the context length."""

from __future__ import annotations

import time
from typing import Any

from kiviq.engine.request import Request, SamplingParams
from kiviq.jobs.models import GenerateRequest


class PromptTooLong(ValueError):
    """The prompt does not fit the model's context window."""


def encode_prompt(tokenizer: Any, request: GenerateRequest) -> list[int]:
    """Token ids for a request, encoded exactly as mlx-lm's generate does."""
    if request.messages is not None:
        messages = [m.model_dump() for m in request.messages]
        # Render then encode without extra specials: the template already adds them.
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return list(tokenizer.encode(text, add_special_tokens=False))
    prompt = request.prompt
    bos = tokenizer.bos_token
    add_special = bos is None or not prompt.startswith(bos)
    return list(tokenizer.encode(prompt, add_special_tokens=add_special))


def build_request(job_id: str, request: GenerateRequest, tokenizer: Any, max_context: int) -> Request:
    """Build the engine request for a job.

    Raises:
        PromptTooLong: the prompt alone fills the context window.
    """
    tokens = encode_prompt(tokenizer, request)
    if len(tokens) >= max_context:
        raise PromptTooLong(
            f"prompt: {len(tokens)} tokens does not fit the model's context of {max_context} tokens "
            f"(it must leave room for at least one new token)"
        )
    s = request
    return Request(
        request_id=job_id,
        prompt_tokens=tokens,
        # Generation past the context window is not defined: cut it to fit.
        max_tokens=min(s.max_tokens, max_context - len(tokens)),
        sampling=SamplingParams(s.temperature, s.top_p, s.top_k, s.min_p, s.repetition_penalty, s.seed,
                                logprobs=s.top_logprobs if s.logprobs else None),
        stop=list(s.stop),
        deadline=None if s.timeout_s is None else time.monotonic() + s.timeout_s,
    )
