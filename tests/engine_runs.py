"""Drive an engine to completion the way the worker does (shared by the CPU
and GPU engine tests)."""

from __future__ import annotations


def run_engine(engine, requests, join_every: int = 0) -> dict[str, list[int]]:
    """Feed requests (one every ``join_every`` steps, or all at once) until
    every one has ended; returns each request's generated token ids.

    Fails the calling test on any error event.
    """
    out = {r.request_id: [] for r in requests}
    pending, step = list(requests), 0
    while pending or engine.has_work():
        while pending and (join_every == 0 or step % join_every == 0):
            engine.add(pending.pop(0))
            if join_every:
                break
        for ev in engine.step():
            assert ev.finish_reason != "error", ev.error
            out[ev.request_id] += ev.token_ids
        step += 1
    return out


class NullDetokenizer:
    """Random weights have no text: the engines only need token ids."""

    last_segment = ""

    def add_token(self, token):
        pass

    def finalize(self):
        pass


class IdTokenizer:
    """A tokenizer stand-in for runs on token ids alone (random-weight models)."""

    eos_token_ids: set = set()

    @property
    def detokenizer(self):
        return NullDetokenizer()
