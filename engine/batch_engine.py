"""The continuous-batching engine: sequences join and leave at every step,
and one forward decodes all running sequences over the paged KIVI store.

One step is three moves (STYLE.md): the scheduler plans, the model runner
runs, the engine turns sampled tokens into events.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable

import mlx.core as mx
import mlx.nn as nn

from kiviq.engine.detokenizer import make_detokenizer, text_reader
from kiviq.engine.kv_store import KiviStore
from kiviq.engine.model_runner import ModelRunner
from kiviq.engine.request import Request, StepEvent, TokenLogprob
from kiviq.engine.sampler import RowState, Sampled, sample
from kiviq.engine.scheduler import Scheduler, pack_first_chunks
from kiviq.engine.sequence import Sequence
from kiviq.engine.stop import StopMatcher, final_text

log = logging.getLogger("kiviq.engine")


@dataclass
class _Runtime:
    detokenizer: Any
    stopper: StopMatcher
    row: RowState
    text_of: Callable[[int], str]  # the detokenizer's text_reader


def _same(a: list[Sequence], b: list[Sequence]) -> bool:
    """The same sequence objects in the same order."""
    return len(a) == len(b) and all(x is y for x, y in zip(a, b))


class Engine:
    """Batch generation over a KiviStore.

    Args:
        model: an mlx-lm model (its attention is routed to the store).
        tokenizer: its TokenizerWrapper.
        store: the KV store (its slots bound the sequences held at once).
        max_batch_tokens: tokens per step, decode plus prefill chunks.
        prefill_while_decoding: prompt tokens per step at most while sequences
            decode (engine.scheduler.Scheduler); None: no cap.
        reserve_tokens: generation room required to admit a request.
        pipeline: overlap steady decode steps (see below).
        compile_decode: replay decode steps through mx.compile
            (engine.compiled_decode); same tokens, less host work per step.

    Both are off here, where every option is explicit; ``engine.build_engine``
    (the worker's builder) turns pipelining on, and compiling on a GPU.
    """

    def __init__(self, model: nn.Module, tokenizer: Any, store: KiviStore, *,
                 max_batch_tokens: int = 1024, reserve_tokens: int = 64, pipeline: bool = False,
                 compile_decode: bool = False, prefill_while_decoding: int | None = None):
        self.model = model
        self.config = None  # the EngineConfig it was built from, if build_engine built it
        # Optional: steady decoding overlaps host and device (step n+1's graph is
        # built on step n's sampled tokens, still on the device, and step n's events
        # are emitted while it runs, as mlx-lm's generate_step does for one request).
        self.pipeline = pipeline
        self._inflight: tuple[list[Sequence], Sampled] | None = None
        self.tokenizer = tokenizer
        self._eos = tokenizer.eos_token_ids  # the tokenizer's own set (mlx-lm's add_eos_token adds to it)
        self.kv_store = store
        self.runner = ModelRunner(model, store, compile_decode=compile_decode)
        self.scheduler = Scheduler(store.blocks, max_batch_tokens, reserve_tokens, prefill_while_decoding,
                                   chunk_multiple=self.runner.prefill_chunk_multiple)
        self._seqs: dict[str, Sequence] = {}
        self._arrivals = itertools.count()
        self.stats = {"decode_tokens": 0, "prefill_tokens": 0, "preemptions": 0, "steps": 0,
                      "pipelined_steps": 0}

    @property
    def capacity(self) -> int:
        """Sequences the engine can hold at once."""
        return self.kv_store.blocks.num_slots

    @property
    def num_active(self) -> int:
        return len(self._seqs)

    def has_work(self) -> bool:
        return bool(self._seqs)

    def add(self, request: Request) -> None:
        if request.request_id in self._seqs:
            raise ValueError(f"request {request.request_id!r} is already in the engine")
        seq = Sequence(request, next(self._arrivals))
        detokenizer = make_detokenizer(self.tokenizer)
        seq.runtime = _Runtime(detokenizer, StopMatcher(request.stop),
                               RowState.create(request.sampling, request.prompt_tokens), text_reader(detokenizer))
        self._seqs[request.request_id] = seq
        self.scheduler.add(seq)

    def abort(self, request_id: str) -> bool:
        """Drop a request now; its KV blocks are free when this returns. A draw
        of a pipelined step still in flight for it is discarded."""
        seq = self._seqs.get(request_id)
        if seq is None:
            return False
        self._drop(seq)
        return True

    def step(self) -> list[StepEvent]:
        """Run one scheduling step; returns the events it produced.

        With pipelining, a decode step's events come out one step later (the
        next call, or the first call that is not a steady continuation).
        """
        events = self._land() if self._inflight is not None and not self._steady() else []
        events += self._expire()
        plan = self.scheduler.schedule()
        self.stats["steps"] += 1
        for seq in plan.preempt:
            self._release(seq)
            self.stats["preemptions"] += 1
            log.info("preempted %s (%d tokens) to free KV memory", seq.request_id, seq.num_tokens)
        for seq, reason in plan.fail:
            events.append(self._end(seq, [], "", "error", reason))
        for seq in plan.admit:
            seq.kv = self.kv_store.blocks.allocate()
        if plan.decode:
            events += self._decode(plan.decode)
        # First chunks of new sequences share one packed forward, attending in groups
        # of similar lengths; a later chunk of a long prompt attends to its past, alone.
        first = [(s, n) for s, n in plan.prefill if s.prefilled == 0]
        later = [(s, n) for s, n in plan.prefill if s.prefilled > 0]
        if first:
            events += self._prefill_first(first, pack_first_chunks(
                [n for _, n in first], self.scheduler.max_batch_tokens, multiple=self.runner.prefill_width_multiple))
        for seq, n in later:
            events += self._prefill(seq, n)
        return events

    # ---- phases ----------------------------------------------------------

    def _decode(self, seqs: list[Sequence]) -> list[StepEvent]:
        prev, events = self._inflight, []
        if prev is not None and not _same(prev[0], seqs):
            events, prev = self._land(), None
        self._inflight = None
        try:
            # In steady state the inputs are the previous step's draws, still lazy.
            inputs = prev[1].tokens if prev is not None else [s.generated[-1] for s in seqs]
            logits = self.runner.decode([s.kv for s in seqs], inputs)
            sampled = sample(logits, [s.runtime.row for s in seqs])
            if self.pipeline and self._can_pipeline(seqs):
                self.runner.launch(*sampled.arrays())
                self._inflight = (seqs, sampled)
                self.stats["pipelined_steps"] += 1
            else:
                self.runner.settle(*sampled.arrays())
        except Exception as e:  # the batch cannot tell whose fault: all end
            log.exception("decode step failed")
            self._inflight = None
            if prev is not None:
                events += self._emit_sampled(*prev)
            return events + [self._end(s, [], "", "error", f"{type(e).__name__}: {e}")
                             for s in seqs if self._seqs.get(s.request_id) is s]
        if prev is not None:  # the device runs this step while the last one is emitted
            events += self._emit_sampled(*prev)
        if self._inflight is None:
            events += self._emit_sampled(seqs, sampled)
        return events

    def _can_pipeline(self, seqs: list[Sequence]) -> bool:
        """Whether this step may stay in flight while the next one is built.

        Not with a repetition penalty (the next draw needs this token in the
        history on the host), and not near the end of KV memory (the scheduler
        counts tokens one step late while a step is in flight, so two steps'
        worth of new blocks must be free).
        """
        return (all(s.runtime.row.params.repetition_penalty == 1.0 for s in seqs)
                and self.kv_store.blocks.free_blocks >= 2 * self.kv_store.config.flush_blocks * len(seqs))

    def _steady(self) -> bool:
        """The next step decodes exactly the in-flight sequences and nothing
        else: nobody waits or prefills, and memory cannot force a preemption."""
        seqs = self._inflight[0]
        sched = self.scheduler
        return (not sched.waiting and not sched.prefilling and _same(sched.running, seqs)
                and self._can_pipeline(seqs))

    def _land(self) -> list[StepEvent]:
        """Emit the in-flight decode step (waits for the device)."""
        seqs, sampled = self._inflight
        self._inflight = None
        return self._emit_sampled(seqs, sampled)

    def _emit_sampled(self, seqs: list[Sequence], sampled: Sampled) -> list[StepEvent]:
        """Events of one decode step's draws; rows of sequences that ended or
        were aborted meanwhile (a draw made after their end) are dropped."""
        tokens = sampled.tokens.tolist()
        live, emit = self._seqs, self._emit
        # Per token, on the engine's thread every step (~4 us each at B = 128): the
        # request's id read directly, not through Sequence's property.
        events = [emit(s, t, lp) for s, t, lp in zip(seqs, tokens, sampled.row_logprobs(tokens))
                  if live.get(s.request.request_id) is s]
        self.stats["decode_tokens"] += len(events)
        return events

    def _prefill(self, seq: Sequence, n: int) -> list[StepEvent]:
        chunk = seq.context[seq.prefilled: seq.prefilled + n]
        try:
            logits = self.runner.prefill(seq.kv, chunk)
            seq.prefilled += n
            self.stats["prefill_tokens"] += n  # every chunk, not only the last
            if seq.prefilled < seq.num_tokens:
                self.runner.settle()
                return []
            sampled = sample(logits[None], [seq.runtime.row])
            self.runner.settle(*sampled.arrays())
        except Exception as e:  # a sequence that fails in its own prefill fails alone
            log.exception("prefill of %s failed", seq.request_id)
            return [self._end(seq, [], "", "error", f"{type(e).__name__}: {e}")]
        self.scheduler.prefill_done(seq)
        tokens = sampled.tokens.tolist()
        return [self._emit(seq, tokens[0], sampled.row_logprobs(tokens)[0])]

    def _prefill_first(self, items: list[tuple[Sequence, int]],
                       groups: list[list[int]] | None = None) -> list[StepEvent]:
        """First chunks of new sequences in one forward (attending in ``groups``);
        those whose chunk is the whole context draw their first token."""
        seqs = [s for s, _ in items]
        try:
            logits = self.runner.prefill_first([s.kv for s in seqs], [s.context[:n] for s, n in items], groups)
            done = [i for i, (s, n) in enumerate(items) if n == s.num_tokens]
            sampled = None
            if done:
                rows = logits if len(done) == len(items) else logits[mx.array(done)]
                sampled = sample(rows, [seqs[i].runtime.row for i in done])
            self.runner.settle(*(sampled.arrays() if sampled is not None else ()))
        except Exception as e:
            if len(items) == 1:  # a sequence that fails in its own prefill fails alone
                log.exception("prefill of %s failed", seqs[0].request_id)
                return [self._end(seqs[0], [], "", "error", f"{type(e).__name__}: {e}")]
            # Cannot tell whose fault: retry each alone.
            log.warning("batched prefill failed (%s); prefilling one by one", e)
            events = []
            for s, n in items:
                self._release(s)
                s.kv = self.kv_store.blocks.allocate()
                s.prefilled = 0
                events += self._prefill_first([(s, n)])
            return events
        for s, n in items:
            s.prefilled = n
            self.stats["prefill_tokens"] += n
        if sampled is None:
            return []
        events = []
        tokens = sampled.tokens.tolist()
        for i, token, lp in zip(done, tokens, sampled.row_logprobs(tokens)):
            self.scheduler.prefill_done(seqs[i])
            events.append(self._emit(seqs[i], token, lp))
        return events

    # ---- tokens -> events -------------------------------------------------

    def _emit(self, seq: Sequence, token: int, logprob: TokenLogprob | None = None) -> StepEvent:
        # Every generated token passes here on the engine's thread (~4 us each at B =
        # 128): one call into the detokenizer, the stop matcher only where the request
        # has stop strings, the event built positionally.
        if token in self._eos:
            return self._finish(seq, [], "stop")  # EOS is not emitted, nor its logprob
        rt, req, generated = seq.runtime, seq.request, seq.generated
        generated.append(token)
        rt.row.history.append(token)
        stopper = rt.stopper
        if stopper.stop:
            text, stopped = stopper.push(rt.text_of(token))
        else:
            text, stopped = rt.text_of(token), False
        if stopped:
            event = self._end(seq, [token], text, "stop")
        elif len(generated) >= req.max_tokens:
            event = self._finish(seq, [token], "length", text)
        else:
            event = StepEvent(req.request_id, [token], text, None, None, len(req.prompt_tokens))
        if logprob is not None:
            event.logprobs = [logprob]
        return event

    def _finish(self, seq: Sequence, token_ids: list[int], reason: str, text: str = "") -> StepEvent:
        """End with whatever text the detokenizer and stop matcher still hold."""
        tail, stopped = final_text(seq.runtime.detokenizer, seq.runtime.stopper)
        return self._end(seq, token_ids, text + tail, "stop" if stopped else reason)

    def _end(self, seq: Sequence, token_ids: list[int], text: str, reason: str,
             error: str | None = None) -> StepEvent:
        self._drop(seq)
        return StepEvent(seq.request_id, token_ids, text, reason, error,
                         prompt_tokens=len(seq.request.prompt_tokens))

    def _expire(self) -> list[StepEvent]:
        now = time.monotonic()
        late = [s for s in self._seqs.values() if s.request.deadline is not None and now >= s.request.deadline]
        return [self._finish(s, [], "timeout") for s in late]

    def _drop(self, seq: Sequence) -> None:
        self.scheduler.remove(seq)
        self._release(seq)
        self._seqs.pop(seq.request_id, None)

    def _release(self, seq: Sequence) -> None:
        if seq.kv is not None:
            self.kv_store.blocks.free(seq.kv)
            seq.kv = None
