"""Who owns which KV block and slot: the allocator behind the KIVI store.

Pure Python and numpy: it counts and hands out ids; the store (engine/kv_store.py)
owns the arrays those ids address. A sequence owns one tail slot and a list of
block ids shared by all layers (block ``j`` of a sequence holds its tokens
``j*G .. j*G+G-1`` in every layer). The scheduler asks it before admitting or
growing a sequence; it also owns the byte budget (bytes per block and per slot).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


class OutOfKVMemory(RuntimeError):
    """No free block or slot is left in the store."""


@dataclass(eq=False)
class SequenceKV:
    """One sequence's place in the store."""

    slot: int
    num_layers: int
    block_ids: list[int] = field(default_factory=list)
    tail_lens: list[int] = field(default_factory=list)  # per layer
    blocks_used: list[int] = field(default_factory=list)  # per layer

    def __post_init__(self):
        self.tail_lens = [0] * self.num_layers
        self.blocks_used = [0] * self.num_layers

    def offset(self, layer: int, group_size: int) -> int:
        """Tokens committed in ``layer``."""
        return self.blocks_used[layer] * group_size + self.tail_lens[layer]


def blocks_for_budget(budget: int, *, block_bytes: int, slot_bytes: int, max_sequences: int,
                      group_size: int, context: int | None = None) -> int:
    """Blocks a store of ``max_sequences`` slots can have within ``budget`` bytes,
    and no more than ``max_sequences`` sequences of ``context`` tokens need
    (may be < 1: the budget cannot hold the tails)."""
    num_blocks = (budget - max_sequences * slot_bytes) // block_bytes
    if context is not None:
        num_blocks = min(num_blocks, max_sequences * -(-context // group_size))
    return int(num_blocks)


class BlockManager:
    """Free lists of blocks and slots, and every slot's block table.

    Args:
        num_blocks, num_slots: the store's capacity.
        num_layers: layers of each sequence (for SequenceKV's per-layer counts).
        group_size, residual, flush_blocks: G, R, k of the flush rule (KVConfig).
        block_bytes, slot_bytes: bytes of one block (all layers) and one slot's tails.
    """

    def __init__(self, num_blocks: int, num_slots: int, *, num_layers: int, group_size: int, residual: int,
                 flush_blocks: int = 1, block_bytes: int = 0, slot_bytes: int = 0):
        self.num_blocks, self.num_slots, self.num_layers = num_blocks, num_slots, num_layers
        self.group_size, self.residual, self.flush_blocks = group_size, residual, flush_blocks
        self.block_bytes, self.slot_bytes = block_bytes, slot_bytes
        self._free_blocks = list(range(num_blocks - 1, -1, -1))
        self._free_slots = list(range(num_slots - 1, -1, -1))
        # Block tables by slot, kept as blocks are allocated: a step's table is
        # one gather of rows (a nested list -> array costs ~100 us at B=32, 4k).
        self._tables = np.zeros((num_slots, min(num_blocks, 64)), dtype=np.int32)

    # ---- counts (the scheduler's Allocator) ---------------------------------

    @property
    def free_blocks(self) -> int:
        return len(self._free_blocks)

    @property
    def free_slots(self) -> int:
        return len(self._free_slots)

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks a sequence of ``num_tokens`` tokens holds (the rest is in its tail)."""
        g, r, kg = self.group_size, self.residual, self.flush_blocks * self.group_size
        return 0 if num_tokens < r + kg else (num_tokens - r) // kg * (kg // g)

    def blocks_held(self, seq) -> int:
        """Blocks held by an engine Sequence (its ``kv``, None before admission)."""
        return len(seq.kv.block_ids) if seq.kv is not None else 0

    def can_allocate(self, num_tokens: int) -> bool:
        """Whether a new sequence of ``num_tokens`` tokens fits now."""
        return bool(self._free_slots) and self.blocks_needed(num_tokens) <= self.free_blocks

    def used_bytes(self) -> int:
        """Bytes of blocks and tails currently owned by sequences."""
        return ((self.num_blocks - self.free_blocks) * self.block_bytes
                + (self.num_slots - self.free_slots) * self.slot_bytes)

    def budget_bytes(self) -> int:
        """Bytes of all blocks and tails the store owns."""
        return self.num_blocks * self.block_bytes + self.num_slots * self.slot_bytes

    # ---- allocation ---------------------------------------------------------

    def allocate(self) -> SequenceKV:
        """A new, empty sequence with its own slot (blocks come as it grows)."""
        if not self._free_slots:
            raise OutOfKVMemory("no free KV slot")
        return SequenceKV(self._free_slots.pop(), self.num_layers)

    def free(self, seq: SequenceKV) -> None:
        """Give a sequence's blocks and slot back (idempotent)."""
        if seq.slot < 0:
            return
        self._free_blocks.extend(reversed(seq.block_ids))
        self._free_slots.append(seq.slot)
        self._tables[seq.slot] = 0
        seq.block_ids, seq.slot = [], -1

    def block(self, seq: SequenceKV, index: int) -> int:
        """Block id of the sequence's ``index``-th block, allocating it the first
        time any layer reaches it."""
        if index == len(seq.block_ids):
            if not self._free_blocks:
                raise OutOfKVMemory("KV pool is full: no free block")
            seq.block_ids.append(self._free_blocks.pop())
            if index >= self._tables.shape[1]:
                grown = np.zeros((self.num_slots, max(index + 1, 2 * self._tables.shape[1])), dtype=np.int32)
                grown[:, : self._tables.shape[1]] = self._tables
                self._tables = grown
            self._tables[seq.slot, index] = seq.block_ids[index]
        return seq.block_ids[index]

    def block_tables(self, seqs: list[SequenceKV], num_blocks: list[int], width_multiple: int = 1) -> np.ndarray:
        """int32 [B, W]: each sequence's block ids in token order, zeros after;
        W = max(1, max num_blocks) rounded up to ``width_multiple``."""
        m = width_multiple
        width = -(-max(1, max(num_blocks)) // m) * m
        rows = self._tables[[s.slot for s in seqs], :width]
        if rows.shape[1] < width:
            rows = np.pad(rows, ((0, 0), (0, width - rows.shape[1])))
        return rows
