"""Per-request sampling for a whole batch in a few array ops.

Each row has its own temperature, top-k, top-p, min-p and repetition
penalty. A seeded request draws from its own key (split once per token), so
its text does not depend on what else is in the batch; unseeded rows share
one draw from the global generator.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from engine.request import SamplingParams


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


def sample(logits: mx.array, rows: list[RowState]) -> mx.array:
    """Next token for every row.

    Args:
        logits: [B, V] float logits of the last position.
        rows: per-row sampling state (keys advance; histories are not changed).

    Returns:
        int32 [B] token ids.
    """
    logits = logits.astype(mx.float32)
    if any(r.params.repetition_penalty != 1.0 for r in rows):
        logits = mx.stack([
            apply_repetition_penalty(logits[i], r.history, r.params.repetition_penalty)
            if r.params.repetition_penalty != 1.0 else logits[i]
            for i, r in enumerate(rows)
        ])
    greedy = mx.argmax(logits, axis=-1).astype(mx.int32)
    if all(r.params.greedy for r in rows):
        return greedy
    temps = mx.array([r.params.temperature if r.params.temperature > 0 else 1.0 for r in rows])[:, None]
    logprobs = logits / temps
    logprobs = logprobs - mx.logsumexp(logprobs, axis=-1, keepdims=True)
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
