"""The engine's logprobs in the job contract's form (``jobs.models.TokenLogprob``)."""

from __future__ import annotations

from typing import Any

from kiviq.jobs.models import TokenLogprob, TopLogprob

LOGPROB_FLOOR = -9999.0  # OpenAI's stand-in for -inf (JSON has no infinities)


def _finite(lp: float) -> float:  # -inf (and NaN) would not survive JSON
    return lp if lp >= LOGPROB_FLOOR else LOGPROB_FLOOR


class LogprobConverter:
    """Turns a step's engine logprob entries into TokenLogprobs, each token with
    its text (decoded once per token id and kept)."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self._texts: dict[int, str] = {}

    def text(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self.tokenizer.decode([token_id])
        return text

    def __call__(self, entries: list) -> list[TokenLogprob]:
        return [TokenLogprob(token_id=e.token_id, token=self.text(e.token_id), logprob=_finite(e.logprob),
                             top_logprobs=[TopLogprob(token_id=t, token=self.text(t), logprob=_finite(lp))
                                           for t, lp in e.top])
                for e in entries]
