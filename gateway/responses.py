"""Response bodies and stream chunks in OpenAI's shapes, built from kiviq's
results and stream events (the non-streamed bodies are bulk's, so a Batch
API output line and an HTTP response are the same object)."""

from __future__ import annotations

import json
from typing import Any

from kiviq.client.bulk_format import FINISH_REASONS, BulkLine, completion_body
from kiviq.jobs.models import FinishReason, GenerateRequest, GenerationResult, TokenLogprob


def finish_reason(reason: FinishReason) -> str:
    return FINISH_REASONS.get(reason, "stop")


def response_body(request: GenerateRequest, result: GenerationResult, model: str, created: int) -> dict[str, Any]:
    """The ``chat.completion`` / ``text_completion`` object of a finished job."""
    body = completion_body(BulkLine(0, "", request=request, model=model), result, created=created)
    body["kiviq"].pop("line", None)
    return body


def _token_bytes(token: str) -> list[int]:
    return list(token.encode("utf-8"))


def chunk_logprobs(chat: bool, logprobs: list[TokenLogprob]) -> dict[str, Any]:
    """A chunk's ``logprobs``: chat's ``{content: [...]}`` or legacy completions' parallel lists."""
    if chat:
        return {"content": [{"token": t.token, "logprob": t.logprob, "bytes": _token_bytes(t.token),
                             "top_logprobs": [{"token": a.token, "logprob": a.logprob,
                                               "bytes": _token_bytes(a.token)} for a in t.top_logprobs]}
                            for t in logprobs], "refusal": None}
    return {"tokens": [t.token for t in logprobs], "token_logprobs": [t.logprob for t in logprobs],
            "top_logprobs": [{a.token: a.logprob for a in t.top_logprobs} for t in logprobs],
            "text_offset": []}


class ChunkWriter:
    """Server-sent-event chunks of one streamed completion."""

    def __init__(self, chat: bool, completion_id: str, model: str, created: int, include_usage: bool):
        self.chat = chat
        self.base = {"id": completion_id, "object": "chat.completion.chunk" if chat else "text_completion",
                     "created": created, "model": model}
        self.include_usage = include_usage
        self.text_offset = 0

    def _choice(self, text: str | None, reason: str | None, logprobs: list[TokenLogprob] | None,
                role: bool = False) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0}
        if self.chat:
            delta: dict[str, Any] = {}
            if role:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            choice["delta"] = delta
        else:
            choice["text"] = text or ""
        lp = None
        if logprobs:
            lp = chunk_logprobs(self.chat, logprobs)
            if not self.chat:
                offsets = []
                for t in logprobs:
                    offsets.append(self.text_offset)
                    self.text_offset += len(t.token)
                lp["text_offset"] = offsets
        choice["logprobs"] = lp
        choice["finish_reason"] = reason
        return choice

    def _sse(self, choices: list[dict[str, Any]], usage: Any = None, with_usage_key: bool = True) -> str:
        chunk = {**self.base, "choices": choices}
        if self.include_usage and with_usage_key:
            chunk["usage"] = usage
        return "data: " + json.dumps(chunk, ensure_ascii=False) + "\n\n"

    def first(self) -> str:
        """Chat's opening chunk (the assistant role); '' for completions."""
        return self._sse([self._choice("", None, None, role=True)]) if self.chat else ""

    def delta(self, text: str, logprobs: list[TokenLogprob] | None) -> str:
        return self._sse([self._choice(text, None, logprobs)])

    def end(self, result: GenerationResult) -> str:
        """The finish_reason chunk, the usage chunk if asked for, and ``[DONE]``."""
        out = self._sse([self._choice(None if self.chat else "", finish_reason(result.finish_reason), None)])
        if self.include_usage:
            u = result.usage
            out += self._sse([], {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
                                  "total_tokens": u.total_tokens})
        return out + "data: [DONE]\n\n"

    @staticmethod
    def error(body: dict[str, Any]) -> str:
        """An error after the stream began (the status line has gone): one
        ``data:`` event with the error object, then ``[DONE]``."""
        return "data: " + json.dumps(body) + "\n\ndata: [DONE]\n\n"
