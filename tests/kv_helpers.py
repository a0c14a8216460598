"""Store entry points only the tests (and a benchmark) use: per-layer decode
writes and attention over a KiviStore, without the engine's per-step batch."""

from __future__ import annotations

import mlx.core as mx

from kiviq.engine.kv_store import KiviStore, SequenceKV
from kiviq.kernels.dispatch import decode_attend as dispatch_decode_attend


def append_decode(store: KiviStore, layer: int, seqs: list[SequenceKV], k: mx.array, v: mx.array) -> None:
    """Commit one new token per sequence to ``layer`` alone: k, v [B, H_kv, D].

    A tail holds at most R + k*G - 1 tokens between steps; one that would
    reach R + k*G flushes its oldest k*G tokens into k new blocks.
    """
    store.write_decode(layer, store.begin_decode(seqs, layer), k, v)


def decode_attend(store: KiviStore, layer: int, seqs: list[SequenceKV], q: mx.array, scale: float) -> mx.array:
    """Attention of one new query per sequence over its blocks and tail.

    Args:
        q: [B, H_q, D], the sequences' current tokens already committed.

    Returns:
        [B, H_q, D].
    """
    blocks = [s.blocks_used[layer] for s in seqs]
    return dispatch_decode_attend(
        q, store.pools[layer],
        mx.array(store.blocks.block_tables(seqs, blocks, store.table_width_multiple)),
        mx.array(blocks, dtype=mx.int32),
        mx.array([s.slot for s in seqs], dtype=mx.int32),
        mx.array([s.tail_lens[layer] for s in seqs], dtype=mx.int32),
        scale=scale, bits=store.config.bits, group_size=store.config.group_size, use_kernel=store.use_kernel,
    )


def attend_decode(store: KiviStore, layer: int, batch, q: mx.array, scale: float) -> mx.array:
    """The step's attention for ``layer`` of a batch from ``begin_decode`` whose
    tokens are already written (q: [B, H_q, 1, D] or [B, H_q, D]; returns q's shape)."""
    plan, _ = store._plan(layer, batch, q, scale)
    return plan(q, store.pools[layer])
