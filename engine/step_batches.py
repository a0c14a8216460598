"""What a KiviStore hands the forward of one step: where every layer's new tokens
go and what its attention reads, made once per step for all layers
(``KiviStore.begin_decode``, ``KiviStore.begin_prefill``)."""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx

from kiviq.engine.block_manager import SequenceKV


@dataclass(eq=False, slots=True)
class DecodeBatch:
    """One batched decode step's metadata, the same in every layer (built by
    ``KiviStore.begin_decode``; every int array is int32).

    Shapes: slots, num_blocks, tail_lens [B];
    block_tables [B, W], W = max(1, max num_blocks) rounded up to the store's
    ``table_width_multiple``.
    """

    seqs: list[SequenceKV]
    slots: mx.array
    block_tables: mx.array  # pool block ids in token order; zeros past num_blocks
    num_blocks: mx.array  # quantized blocks, this step's flushes included
    tail_lens: mx.array  # tail tokens, the new one included
    offsets: int | mx.array  # tokens before the new one (the RoPE offset); an int when B = 1
    # (slot, kv head, tail index) of every new row, each [B, H_kv, 1]: one scatter
    # per tail with prepared indices (numpy-style mixed indexing rebuilt them per layer)
    # of the model's [B, H_kv, 1, D] rows as they come.
    write_index: tuple[mx.array, mx.array, mx.array]
    # The step's flush inside its own graph (CUDA, `KiviStore.begin_decode`): the
    # flushing slots [B] (-1 past them), their new blocks [B * k] and the kernel's
    # params, for `dispatch.step_flush`; None where the flush ran before the step.
    flush: tuple[mx.array, mx.array, mx.array] | None = None
    # The attention launch of this step (dispatch.attend_plan), made by the first
    # layer, with whether it writes the tails itself (dispatch.writes_tail); under
    # "flush", the in-graph flush's launches (KiviStore._step_flush).
    plans: dict = field(default_factory=dict)


@dataclass(eq=False, slots=True)
class PrefillBatch:
    """The first chunks of new sequences run in one forward: where each real token
    goes, the same in every layer (built by ``KiviStore.begin_prefill``; int arrays
    int32, token indices into the forward's token-major rows).

    Each chunk of n tokens follows the flush rule at once: its first
    ``blocks_needed(n) * G`` tokens become quantized blocks, the rest the tail.
    """

    seqs: list[SequenceKV]
    lengths: list[int]  # tokens per chunk
    starts: list[int]  # each chunk's first token among the forward's token-major rows
    block_first: mx.array | None  # [N]: the first token of each of the N new blocks
    block_ids: mx.array | None  # [N]: their pool blocks
    tail_src: mx.array | None  # [M]: the tokens that stay in a tail
    tail_slot: mx.array | None  # [M, 1]
    tail_pos: mx.array | None  # [M, 1]


__all__ = ["DecodeBatch", "PrefillBatch"]
