"""Who prefills, who decodes, who waits: the batching engine's policy.

Pure Python: it sees sequences and an allocator's counts, never tensors.
Each step every running sequence decodes one token; the rest of the step's
token budget goes to prefill chunks, first for sequences already
prefilling, then for newly admitted ones. While sequences decode, the prefill
share of a step can be capped (``prefill_while_decoding``): a step that
prefills N tokens makes every running sequence wait for those N tokens. A
sequence is admitted only when the store can hold its whole context plus a
reserve; when running sequences outgrow the store, the newest is preempted
(its blocks freed, its tokens recomputed later) rather than anything failing
or overcommitting.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

from kiviq.engine.sequence import Sequence, Status

# The share of a step's prefill budget left unused rather than split a prompt that
# fits the next step whole: a split costs two new shapes on a GPU (a partial first
# chunk, and a later chunk over its quantized past) and two passes over that prompt.
SPLIT_WASTE = 0.125


class Allocator(Protocol):
    free_blocks: int
    free_slots: int

    def blocks_needed(self, num_tokens: int) -> int: ...

    def blocks_held(self, seq: Sequence) -> int: ...


@dataclass
class Plan:
    """What one engine step runs."""

    decode: list[Sequence] = field(default_factory=list)
    prefill: list[tuple[Sequence, int]] = field(default_factory=list)  # (sequence, tokens to feed)
    admit: list[Sequence] = field(default_factory=list)  # need a KV slot before their prefill
    preempt: list[Sequence] = field(default_factory=list)  # must release their KV first
    fail: list[tuple[Sequence, str]] = field(default_factory=list)  # cannot be served

    def empty(self) -> bool:
        return not (self.decode or self.prefill)


class Scheduler:
    """Args:
        allocator: the KV store's block manager (engine.block_manager.BlockManager).
        max_batch_tokens: tokens fed to the model per step (decode + prefill).
        reserve_tokens: room for generation required at admission.
        prefill_while_decoding: prompt tokens a step prefills at most while
            sequences decode (their inter-token latency during a burst of long
            prompts); None: what max_batch_tokens leaves.
        chunk_multiple: a prompt split across steps is cut after a multiple of
            this many tokens (where the budget allows one), so that its later
            chunks' pasts, and with them their attention shapes, repeat
            (engine.model_runner.PREFILL_CHUNK_MULTIPLE).
    """

    def __init__(self, allocator: Allocator, max_batch_tokens: int = 1024, reserve_tokens: int = 64,
                 prefill_while_decoding: int | None = None, chunk_multiple: int = 1):
        self.allocator = allocator
        self.chunk_multiple = chunk_multiple
        self.max_batch_tokens = max_batch_tokens
        self.reserve_tokens = reserve_tokens
        self.prefill_while_decoding = prefill_while_decoding
        self.waiting: deque[Sequence] = deque()
        self.prefilling: list[Sequence] = []
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        seq.status = Status.WAITING
        self.waiting.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Forget a sequence (finished or aborted); the engine frees its KV."""
        for group in (self.prefilling, self.running):
            if seq in group:
                group.remove(seq)
        if seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = Status.FINISHED

    def __len__(self) -> int:
        return len(self.waiting) + len(self.prefilling) + len(self.running)

    def _blocks_to_grow(self) -> int:
        """New blocks the running sequences need for their next token, plus what the
        prefilling ones still need for their contexts: one pass over each."""
        a = self.allocator
        # A running sequence holds all its tokens but the newest, which the next
        # decode step commits.
        return sum(max(0, a.blocks_needed(s.num_tokens) - a.blocks_held(s))
                   for group in (self.running, self.prefilling) for s in group)

    def schedule(self) -> Plan:
        plan = Plan()
        a = self.allocator
        # Running sequences grow by one token; preempt the newest until they fit.
        # The blocks still needed are counted once per step (a pass over every
        # sequence) and again only after a preemption changed them.
        needed = self._blocks_to_grow()
        while self.running and needed > a.free_blocks:
            victims = self.running + self.prefilling
            victim = max(victims, key=lambda s: s.arrival)
            if len(victims) == 1:  # alone and still out of room: it can never finish
                self.remove(victim)
                plan.fail.append((victim, "KV memory exhausted: the sequence outgrew the whole KV store"))
                needed = self._blocks_to_grow()
                break
            self._preempt(victim, plan)
            needed = self._blocks_to_grow()
        plan.decode = list(self.running)
        budget = self.max_batch_tokens - len(plan.decode)
        if plan.decode and self.prefill_while_decoding is not None:
            budget = min(budget, self.prefill_while_decoding)
        free_blocks = a.free_blocks - needed
        free_slots = a.free_slots
        # Admit in arrival order while the context plus a reserve fits; a
        # sequence alone in the engine only needs its context to fit.
        while self.waiting and free_slots > 0:
            seq = self.waiting[0]
            alone = not (self.running or self.prefilling)
            fits_alone = a.blocks_needed(seq.num_tokens) <= free_blocks
            if alone and not fits_alone:
                self.waiting.popleft()
                seq.status = Status.FINISHED
                plan.fail.append((seq, f"KV memory: {seq.num_tokens} context tokens do not fit the KV store"))
                continue
            if not alone and a.blocks_needed(seq.num_tokens + self.reserve_tokens) > free_blocks:
                break  # wait for memory to free up
            self.waiting.popleft()
            seq.status = Status.PREFILLING
            seq.prefilled = 0
            self.prefilling.append(seq)
            plan.admit.append(seq)
            free_blocks -= a.blocks_needed(seq.num_tokens)
            free_slots -= 1
        step_budget = budget
        for seq in self.prefilling:
            if budget <= 0:
                break
            left = seq.num_tokens - seq.prefilled
            n = min(budget, left)
            if n < left:  # a split: it ends on a multiple, and ends the step's prefill
                if plan.prefill and left <= step_budget and budget <= step_budget * SPLIT_WASTE:
                    break  # a few tokens unused beat a split prompt's two new shapes
                if n >= self.chunk_multiple:
                    n -= n % self.chunk_multiple
                elif plan.prefill:  # what others left is less than a multiple: next step
                    break
                plan.prefill.append((seq, n))
                break
            plan.prefill.append((seq, n))
            budget -= n
        return plan

    def _preempt(self, seq: Sequence, plan: Plan) -> None:
        if seq in self.running:
            self.running.remove(seq)
        if seq in self.prefilling:
            self.prefilling.remove(seq)
        seq.status = Status.WAITING
        seq.prefilled = 0
        seq.preemptions += 1
        self.waiting.appendleft(seq)
        plan.preempt.append(seq)

    def prefill_done(self, seq: Sequence) -> None:
        """The sequence's whole context is in the store: it decodes from now on."""
        self.prefilling.remove(seq)
        seq.status = Status.RUNNING
        self.running.append(seq)


def pack_first_chunks(lengths: list[int], max_tokens: int, max_waste: float = 0.125,
                      multiple: int = 1) -> list[list[int]]:
    """Group first prefill chunks (of ``lengths`` tokens) for attention: indices
    into ``lengths``, longest first. The chunks share one packed forward without
    padding (kivi_cache.PackedPrefill); each group's attention runs on its chunks
    right-padded to one width.

    A group is as wide as its longest chunk, rounded up to ``multiple``; it
    takes chunks while its padded size stays within ``max_tokens`` (a chunk
    longer than that goes alone) and the padding its rows would not have alone
    within ``max_waste`` of that size. Sorting by length keeps similar lengths
    together, so a bulk run of similar prompts pads little, and its groups are
    mostly full: the same (rows, width) attention shapes again and again.
    """
    def rounded(n: int) -> int:
        return -(-n // multiple) * multiple

    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    groups: list[list[int]] = []
    for i in order:
        group = groups[-1] if groups else None
        if group is not None:
            width, count = rounded(lengths[group[0]]), len(group) + 1
            # Padding a row would not have alone (its own rounding aside).
            padding = sum(width - rounded(lengths[j]) for j in [*group, i])
            if count * width <= max_tokens and padding <= max_waste * count * width:
                group.append(i)
                continue
        groups.append([i])
    return groups
