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
    """Sampling state of one sequence.

    A seeded row's PRNG key is row ``at`` of ``keys``: after a step every seeded
    row of the batch points into the one array of keys that step split, so the
    next step uses that array as it is instead of stacking a key per row.
    """

    params: SamplingParams
    history: list[int]  # prompt + generated tokens (repetition penalty)
    keys: mx.array | None = None  # [N, 2] uint32 keys; None: unseeded
    at: int = 0

    @classmethod
    def create(cls, params: SamplingParams, prompt: list[int]) -> "RowState":
        keys = mx.random.key(params.seed)[None] if params.seed is not None else None
        return cls(params, list(prompt), keys)

    @property
    def key(self) -> mx.array | None:
        """This row's current PRNG key (None when unseeded)."""
        return None if self.keys is None else self.keys[self.at]

    @property
    def truncates(self) -> bool:
        """Whether top-k, top-p or min-p may cut this row's distribution."""
        p = self.params
        return not p.greedy and (p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0.0)


PENALTY_WINDOW = 20  # tokens of history a repetition penalty looks at (as mlx-lm)


def _penalize(logits: mx.array, rows: list[RowState]) -> mx.array:
    """CTRL-style repetition penalty (as mlx-lm's) for every row in one gather
    and one scatter: each row's distinct tokens among its last PENALTY_WINDOW,
    padded with its first one (a repeated index writes the same value)."""
    ids, factors = [], []
    for r in rows:
        penalty = r.params.repetition_penalty
        seen = sorted(set(r.history[-PENALTY_WINDOW:])) if penalty != 1.0 else []
        ids.append(seen or [0])
        factors.append(penalty if seen else 1.0)
    width = max(len(i) for i in ids)
    idx = mx.array([i + [i[0]] * (width - len(i)) for i in ids])
    factor = mx.array(factors, dtype=logits.dtype)[:, None]
    picked = mx.take_along_axis(logits, idx, axis=-1)
    return mx.put_along_axis(logits, idx, mx.where(picked < 0, picked * factor, picked / factor), axis=-1)


def _filter(logprobs: mx.array, top_k: mx.array, top_p: mx.array, min_p: mx.array) -> mx.array:
    """Mask (to -inf) tokens outside each row's top-k / top-p / min-p set.

    logprobs: [B, V] (already divided by temperature); params: [B] (top_k 0:
    no cut; top_p 1: the whole tail, also the part whose mass above it rounds
    to 1 in float32, so a row that does not truncate keeps every token).
    """
    order = mx.argsort(-logprobs, axis=-1)
    sorted_lp = mx.take_along_axis(logprobs, order, axis=-1)
    rank = mx.arange(logprobs.shape[-1])[None, :]
    probs = mx.softmax(sorted_lp, axis=-1)
    before = mx.cumsum(probs, axis=-1) - probs  # mass strictly above this token
    keep = rank == 0  # the most likely token always survives
    keep = keep | (((top_k[:, None] == 0) | (rank < top_k[:, None]))
                   & ((top_p[:, None] >= 1.0) | (before < top_p[:, None]))
                   & (probs >= min_p[:, None] * probs[:, :1]))
    masked_sorted = mx.where(keep, sorted_lp, -mx.inf)
    # Back to vocabulary order: a scatter through the permutation (no second sort).
    return mx.put_along_axis(mx.zeros_like(masked_sorted), order, masked_sorted, axis=-1)


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


@dataclass
class _Table:
    """A batch's per-row parameters on the device. ``values`` columns: temperature
    (1 for greedy rows), top_k, top_p, min_p, greedy (1 or 0). ``truncating``: the
    rows that truncate, when only some do (None: all or none)."""

    values: mx.array
    any_truncates: bool
    truncating: mx.array | None


class _RowTable:
    """The batch's ``_Table``, kept while the batch's rows (their SamplingParams
    objects) stay the same: a decode step then uploads nothing for them. The last
    two batches are kept (a step may also sample the sequences that finish their
    prefill)."""

    def __init__(self):
        self._kept: list[tuple[list[SamplingParams], _Table]] = []

    def __call__(self, rows: list[RowState]) -> _Table:
        params = [r.params for r in rows]
        for kept, table in self._kept:
            if len(kept) == len(params) and all(a is b for a, b in zip(params, kept)):
                return table
        values = mx.array([[p.temperature if p.temperature > 0 else 1.0, p.top_k, p.top_p, p.min_p,
                            float(p.greedy)] for p in params], dtype=mx.float32)
        truncating = [i for i, r in enumerate(rows) if r.truncates]
        table = _Table(values, bool(truncating),
                       mx.array(truncating) if 0 < len(truncating) < len(rows) else None)
        # The params are held with their table, so the identities above cannot be reused.
        self._kept = [(params, table)] + self._kept[:1]
        return table


_row_table = _RowTable()


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
        logits = _penalize(logits, rows)
    wants = [r.params.logprobs for r in rows]
    asked = [n for n in wants if n is not None]
    all_greedy = all(r.params.greedy for r in rows)
    greedy = mx.argmax(logits, axis=-1).astype(mx.int32)
    if all_greedy and not asked:
        return Sampled(greedy, wants)
    if all_greedy:
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        tokens = greedy
    else:
        table = _row_table(rows)
        logprobs = logits / table.values[:, 0:1]
        logprobs = logprobs - mx.logsumexp(logprobs, axis=-1, keepdims=True)
        tokens = _draw(logprobs, greedy, rows, table)
    if not asked:
        return Sampled(tokens, wants)
    return Sampled(tokens, wants, *gather_logprobs(logprobs, tokens, max(asked)))


def _draw(logprobs: mx.array, greedy: mx.array, rows: list[RowState], table: _Table) -> mx.array:
    """Sampled tokens for the non-greedy rows (greedy rows keep ``greedy``).

    Gumbel-max: argmax(logprobs + Gumbel noise) samples from softmax(logprobs).
    Only the rows that truncate sort their vocabulary (``_filter``).
    """
    v = table.values
    if table.truncating is not None:
        picked = table.truncating
        filtered = _filter(logprobs[picked], v[picked, 1], v[picked, 2], v[picked, 3])
        logprobs = mx.put_along_axis(logprobs, picked[:, None], filtered, axis=0)
    elif table.any_truncates:
        logprobs = _filter(logprobs, v[:, 1], v[:, 2], v[:, 3])
    drawn = mx.argmax(logprobs + _noise(rows, logprobs.shape[-1]), axis=-1).astype(mx.int32)
    return mx.where(v[:, 4] > 0, greedy, drawn)


def _noise(rows: list[RowState], vocab: int) -> mx.array:
    """[B, vocab] Gumbel noise: unseeded rows share one draw from the global
    generator; each seeded row draws from its own key, split once per token
    (the same bits as ``split`` and ``gumbel`` row by row, in two ops)."""
    seeded = [i for i, r in enumerate(rows) if r.keys is not None]
    unseeded = len(rows) - len(seeded)
    shared = mx.random.gumbel((unseeded, vocab)) if unseeded else None
    if not seeded:
        return shared
    split = mx.vmap(lambda key: mx.random.split(key))(_seeded_keys([rows[i] for i in seeded]))  # [S, 2, 2]
    keys = split[:, 0]
    for at, i in enumerate(seeded):
        rows[i].keys, rows[i].at = keys, at
    own = mx.vmap(lambda key: mx.random.gumbel((vocab,), key=key))(split[:, 1])
    if not unseeded:
        return own
    # Rows in batch order: the shared draws first, then the seeded rows'.
    position, n_shared, n_own = [], 0, unseeded
    for r in rows:
        if r.keys is None:
            position.append(n_shared)
            n_shared += 1
        else:
            position.append(n_own)
            n_own += 1
    return mx.concatenate([shared, own])[mx.array(position)]


def _seeded_keys(rows: list[RowState]) -> mx.array:
    """The rows' current keys as one [S, 2] array: the array they already share
    when nothing joined or left, else one gather over the arrays they point into."""
    first = rows[0].keys
    if first.shape[0] == len(rows) and all(r.keys is first and r.at == i for i, r in enumerate(rows)):
        return first
    arrays: dict[int, tuple[int, mx.array]] = {}
    offset = 0
    for r in rows:
        if id(r.keys) not in arrays:
            arrays[id(r.keys)] = (offset, r.keys)
            offset += r.keys.shape[0]
    stacked = [a for _, a in arrays.values()]
    pool = stacked[0] if len(stacked) == 1 else mx.concatenate(stacked)
    return pool[mx.array([arrays[id(r.keys)][0] + r.at for r in rows])]
