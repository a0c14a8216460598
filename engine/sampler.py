"""Per-request sampling for a whole batch in a few array ops.

Each row has its own temperature, top-k, top-p, min-p and repetition
penalty. A seeded request draws from its own key (split once per token), so
its text does not depend on what else is in the batch; unseeded rows share
one draw from the global generator.

Logprobs (built only when some row asks) come from the distribution the token
is drawn from before truncation: log_softmax(penalized logits / T), T = 1 for
greedy rows, before top-k / top-p / min-p. So a chosen token's logprob is
always finite and the alternatives are the model's, not only the survivors of
truncation. vLLM V1 reports by default the model's raw log_softmax (before
penalty and temperature); the two agree for greedy rows, and at T = 1 without
a repetition penalty.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from kiviq.engine.request import SamplingParams, TokenLogprob


@dataclass
class RowState:
    """Sampling state of one sequence."""

    params: SamplingParams
    key: mx.array | None  # PRNG key for seeded requests
    history: list[int]  # prompt + generated tokens (repetition penalty)

    @classmethod
    def create(cls, params: SamplingParams, prompt: list[int]) -> "RowState":
        key = mx.random.key(params.seed) if params.seed is not None else None
        return cls(params, key, list(prompt))


def apply_repetition_penalty(logits: mx.array, history: list[int], penalty: float, window: int = 20) -> mx.array:
    """CTRL-style penalty over the last ``window`` tokens (as mlx-lm does)."""
    if not history:
        return logits
    idx = mx.array(sorted(set(history[-window:])))
    picked = logits[idx]
    logits[idx] = mx.where(picked < 0, picked * penalty, picked / penalty)
    return logits


def _filter(logprobs: mx.array, top_k: mx.array, top_p: mx.array, min_p: mx.array) -> mx.array:
    """Mask (to -inf) tokens outside each row's top-k / top-p / min-p set.

    logprobs: [B, V] (already divided by temperature); params: [B].
    """
    order = mx.argsort(-logprobs, axis=-1)
    sorted_lp = mx.take_along_axis(logprobs, order, axis=-1)
    rank = mx.arange(logprobs.shape[-1])[None, :]
    probs = mx.softmax(sorted_lp, axis=-1)
    before = mx.cumsum(probs, axis=-1) - probs  # mass strictly above this token
    keep = rank == 0  # the most likely token always survives
    keep = keep | (((top_k[:, None] == 0) | (rank < top_k[:, None]))
                   & (before < top_p[:, None])
                   & (probs >= min_p[:, None] * probs[:, :1]))
    masked_sorted = mx.where(keep, sorted_lp, -mx.inf)
    # Scatter back to vocabulary order.
    inverse = mx.argsort(order, axis=-1)
    return mx.take_along_axis(masked_sorted, inverse, axis=-1)


@dataclass
class Sampled:
    """One step's draws for a batch (lazy until evaluated).

    Shapes: tokens [B]; chosen [B]; top_ids, top_logprobs [B, N] with N the
    largest count any row asked for (None when N is 0). ``chosen`` is None
    when no row asked for logprobs: then nothing beyond the draw was built.
    """

    tokens: mx.array
    wants: list[int | None]  # per row: top alternatives asked for, None: no logprobs
    chosen: mx.array | None = None
    top_ids: mx.array | None = None
    top_logprobs: mx.array | None = None

    def arrays(self) -> list[mx.array]:
        """Everything to evaluate, for the step's one ``mx.eval``."""
        return [a for a in (self.tokens, self.chosen, self.top_ids, self.top_logprobs) if a is not None]

    def row_logprobs(self, tokens: list[int]) -> list[TokenLogprob | None]:
        """Per-row logprobs of the (evaluated) draws, each row's top list cut
        to what it asked for; None for rows that did not ask."""
        if self.chosen is None:
            return [None] * len(self.wants)
        chosen = self.chosen.tolist()
        ids = self.top_ids.tolist() if self.top_ids is not None else None
        lps = self.top_logprobs.tolist() if self.top_logprobs is not None else None
        out = []
        for i, n in enumerate(self.wants):
            if n is None:
                out.append(None)
                continue
            top = list(zip(ids[i][:n], lps[i][:n])) if n else []
            out.append(TokenLogprob(tokens[i], chosen[i], top))
        return out


def gather_logprobs(logprobs: mx.array, tokens: mx.array, n: int) -> tuple[mx.array, mx.array | None, mx.array | None]:
    """The chosen tokens' logprobs and the ``n`` best per row, best first.

    Args:
        logprobs: [B, V] normalized log-probabilities.
        tokens: [B] the drawn tokens.
        n: alternatives per row (0: none).

    Returns:
        chosen [B], top_ids [B, n] int32 and top_logprobs [B, n] (None if n is 0).
    """
    chosen = mx.take_along_axis(logprobs, tokens.astype(mx.int32)[:, None], axis=-1)[:, 0]
    if n <= 0:
        return chosen, None, None
    # argpartition is O(V); only the n survivors are sorted.
    part = mx.argpartition(-logprobs, kth=n - 1, axis=-1)[:, :n]
    vals = mx.take_along_axis(logprobs, part, axis=-1)
    order = mx.argsort(-vals, axis=-1)
    return chosen, mx.take_along_axis(part, order, axis=-1).astype(mx.int32), mx.take_along_axis(vals, order, axis=-1)


def sample(logits: mx.array, rows: list[RowState]) -> Sampled:
    """Next token for every row, and logprobs for the rows that ask.

    Args:
        logits: [B, V] float logits of the last position.
        rows: per-row sampling state (keys advance; histories are not changed).

    Returns:
        A Sampled whose ``tokens`` are int32 [B] token ids.
    """
    logits = logits.astype(mx.float32)
    if any(r.params.repetition_penalty != 1.0 for r in rows):
        logits = mx.stack([
            apply_repetition_penalty(logits[i], r.history, r.params.repetition_penalty)
            if r.params.repetition_penalty != 1.0 else logits[i]
            for i, r in enumerate(rows)
        ])
    wants = [r.params.logprobs for r in rows]
    asked = [n for n in wants if n is not None]
    all_greedy = all(r.params.greedy for r in rows)
    greedy = mx.argmax(logits, axis=-1).astype(mx.int32)
    if all_greedy and not asked:
        return Sampled(greedy, wants)
    if all_greedy:
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    else:
        temps = mx.array([r.params.temperature if r.params.temperature > 0 else 1.0 for r in rows])[:, None]
        logprobs = logits / temps
        logprobs = logprobs - mx.logsumexp(logprobs, axis=-1, keepdims=True)
    tokens = greedy if all_greedy else _draw(logits, logprobs, greedy, rows)
    if not asked:
        return Sampled(tokens, wants)
    return Sampled(tokens, wants, *gather_logprobs(logprobs, tokens, max(asked)))


def _draw(logits: mx.array, logprobs: mx.array, greedy: mx.array, rows: list[RowState]) -> mx.array:
    """Sampled tokens for the non-greedy rows (greedy rows keep ``greedy``)."""
    logprobs = _filter(
        logprobs,
        mx.array([r.params.top_k for r in rows]),
        mx.array([r.params.top_p for r in rows]),
        mx.array([r.params.min_p for r in rows]),
    )
    noise = []
    unseeded = sum(r.key is None for r in rows)
    shared = mx.random.gumbel((unseeded, logits.shape[-1])) if unseeded else None
    n_shared = 0
    for r in rows:
        if r.key is None:
            noise.append(shared[n_shared])
            n_shared += 1
        else:
            r.key, sub = mx.random.split(r.key)
            noise.append(mx.random.gumbel(logits.shape[-1:], key=sub))
    # Gumbel-max: argmax(logprobs + Gumbel noise) samples from softmax(logprobs).
    drawn = mx.argmax(logprobs + mx.stack(noise), axis=-1).astype(mx.int32)
    is_greedy = mx.array([r.params.greedy for r in rows])
    return mx.where(is_greedy, greedy, drawn)
