"""The serial engine: one sequence at a time, exactly as mlx-lm generates.

Requests wait in FIFO order. Its step mirrors mlx-lm's ``generate_step``
(same prefill chunking, logits processing and sampling), so with mlx-lm's
fp16 cache its tokens equal mlx-lm's exactly: it serves ``--kv-bits 16`` and
is the oracle the batching engine is tested against. Unlike
``generate_step`` it never builds step t+1 before step t is evaluated, so a
KIVI pool is never written while a pending read still holds it (which would
copy the pool). Same interface as ``engine.batch_engine.Engine``.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.sample_utils import make_logits_processors, make_sampler

from kiviq.engine.detokenizer import make_detokenizer
from kiviq.engine.request import Request, StepEvent, TokenLogprob
from kiviq.engine.sampler import Sampled, gather_logprobs
from kiviq.engine.stop import StopMatcher, final_text

CacheFactory = Callable[[nn.Module], list[Any]]


@dataclass
class _Running:
    request: Request
    cache: list[Any]
    sampler: Callable[[mx.array], mx.array]
    processors: list[Callable[[mx.array, mx.array], mx.array]]
    detokenizer: Any
    stopper: StopMatcher
    history: mx.array  # prompt + generated tokens (for logits processors)
    next_input: mx.array  # tokens to feed at the next step
    generated: list[int] = field(default_factory=list)


class SerialEngine:
    """Runs generation requests on one loaded model.

    Args:
        model: an mlx-lm model.
        tokenizer: its mlx-lm TokenizerWrapper.
        make_cache: builds a fresh per-request cache list for the model
            (default: mlx-lm's ``make_prompt_cache``).
        prefill_step_size: prompt tokens per prefill chunk.
    """

    def __init__(self, model: nn.Module, tokenizer: Any, make_cache: CacheFactory | None = None,
                 prefill_step_size: int = 2048):
        self.model = model
        self.tokenizer = tokenizer
        self.make_cache = make_cache or make_prompt_cache
        self.prefill_step_size = prefill_step_size
        self.kv_store: Any = None  # the KiviStore behind make_cache, if any
        self._waiting: deque[Request] = deque()
        self._running: _Running | None = None

    @property
    def capacity(self) -> int:
        """One sequence at a time: the rest wait in Redis, not here."""
        return 1

    @property
    def num_active(self) -> int:
        """Requests admitted and not yet finished (waiting or running)."""
        return len(self._waiting) + (self._running is not None)

    def has_work(self) -> bool:
        return self.num_active > 0

    def add(self, request: Request) -> None:
        """Admit a request; it starts when the requests before it finish."""
        self._waiting.append(request)

    def abort(self, request_id: str) -> bool:
        """Drop a request now, freeing its cache. Returns False if unknown."""
        if self._running and self._running.request.request_id == request_id:
            self._release(self._running)
            return True
        for r in self._waiting:
            if r.request_id == request_id:
                self._waiting.remove(r)
                return True
        return False

    def step(self) -> list[StepEvent]:
        """Generate one token for the running request (starting one if idle).

        A request that raises ends alone with finish reason ``error``.
        """
        events = self._expire_waiting()
        if self._running is None and self._waiting:
            self._running = self._start(self._waiting.popleft())
        run = self._running
        if run is None:
            return events
        try:
            event = self._advance(run)
        except Exception as e:  # a poison request must not take the engine down
            event = StepEvent(run.request.request_id, [], "", "error", f"{type(e).__name__}: {e}")
        event.prompt_tokens = len(run.request.prompt_tokens)
        if event.finish_reason is not None:
            self._release(run)
        events.append(event)
        return events

    def _expire_waiting(self) -> list[StepEvent]:
        now = time.monotonic()
        expired = [r for r in self._waiting if r.deadline is not None and now >= r.deadline]
        for r in expired:
            self._waiting.remove(r)
        return [StepEvent(r.request_id, [], "", "timeout", prompt_tokens=len(r.prompt_tokens)) for r in expired]

    def _release(self, run: _Running) -> None:
        release = getattr(run.cache, "release", None)
        if release is not None:
            release()  # KV blocks go back to the store at once
        self._running = None

    def _start(self, request: Request) -> _Running:
        s = request.sampling
        if s.seed is not None:
            mx.random.seed(s.seed)  # one sequence at a time: the global key is ours
        penalty = s.repetition_penalty if s.repetition_penalty != 1.0 else None
        prompt = mx.array(request.prompt_tokens)
        run = _Running(
            request=request,
            cache=self.make_cache(self.model),
            sampler=make_sampler(temp=s.temperature, top_p=s.top_p, min_p=s.min_p, top_k=s.top_k),
            processors=make_logits_processors(repetition_penalty=penalty),
            detokenizer=make_detokenizer(self.tokenizer),
            stopper=StopMatcher(request.stop),
            history=prompt[:0],
            next_input=prompt,
        )
        self._prefill(run)
        return run

    def _prefill(self, run: _Running) -> None:
        """Feed all prompt tokens but the last in chunks (as mlx-lm does)."""
        prompt = run.next_input
        while prompt.size > 1:
            chunk = prompt[: min(self.prefill_step_size, prompt.size - 1)]
            self.model(chunk[None], cache=run.cache)
            mx.eval([c.state for c in run.cache])
            if run.processors:
                run.history = mx.concatenate([run.history, chunk])
            prompt = prompt[chunk.size :]
        run.next_input = prompt

    def _sample(self, run: _Running) -> tuple[int, TokenLogprob | None]:
        """One forward on ``next_input``; returns the sampled token and, if
        the request asks, its logprobs (defined as in engine.sampler)."""
        tokens = run.next_input
        logits = self.model(tokens[None], cache=run.cache)[:, -1, :]
        if run.processors:
            run.history = mx.concatenate([run.history, tokens])
        for processor in run.processors:
            logits = processor(run.history, logits)
        logprobs = logits - mx.logsumexp(logits, keepdims=True)
        token = run.sampler(logprobs)
        s = run.request.sampling
        if s.logprobs is None:
            mx.eval(token)
            run.next_input = token.reshape(1)
            return int(token.item()), None
        # As the batch engine reports them: float32, at the request's temperature
        # (mlx-lm's own logprobs above are in the model's dtype, at T = 1).
        scaled = logits.astype(mx.float32) / (1.0 if s.greedy else s.temperature)
        scaled = scaled - mx.logsumexp(scaled, axis=-1, keepdims=True)
        token = token.reshape(1)
        sampled = Sampled(token, [s.logprobs], *gather_logprobs(scaled, token, s.logprobs))
        mx.eval(*sampled.arrays())
        run.next_input = token
        tokens = token.tolist()
        return tokens[0], sampled.row_logprobs(tokens)[0]

    def _advance(self, run: _Running) -> StepEvent:
        req = run.request
        if req.deadline is not None and time.monotonic() >= req.deadline:
            return self._finish(run, [], "timeout")
        token, logprob = self._sample(run)
        if token in self.tokenizer.eos_token_ids:
            return self._finish(run, [], "stop")
        run.generated.append(token)
        run.detokenizer.add_token(token)
        text, stopped = run.stopper.push(run.detokenizer.last_segment)
        if stopped:
            event = StepEvent(req.request_id, [token], text, "stop")
        elif len(run.generated) >= req.max_tokens:
            event = self._finish(run, [token], "length", text)
        else:
            event = StepEvent(req.request_id, [token], text)
        if logprob is not None:
            event.logprobs = [logprob]
        return event

    def _finish(self, run: _Running, token_ids: list[int], reason: str, text: str = "") -> StepEvent:
        tail, stopped = final_text(run.detokenizer, run.stopper)
        return StepEvent(run.request.request_id, token_ids, text + tail, "stop" if stopped else reason)
