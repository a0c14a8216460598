"""The batched decode forward through ``mx.compile``, with the KV pools as
explicit state.

Why: at small batches a decode step is host-bound. Building the step's graph
op by op in Python (the model, then per layer the tail writes and the
attention launches) is about half of a B=1 step; a compiled function replays
a recorded graph instead, and fuses chains of elementwise ops.

What a compiled step may depend on: everything that differs between steps
must be an input. Here that is the tokens, the RoPE offsets, the step's
int32 metadata (block tables, lengths, slots, write indices, and on CUDA the
flush's slots and blocks: the step flushes inside its graph) and every
layer's pool arrays, which come back as outputs: where the tail writes are
scatters (the reference, Metal) those are new arrays, updated in place as in
the plain path, since the store drops the old arrays before the step is
evaluated. On CUDA the attention kernel writes the tails itself
(``KiviStore.write_and_attend``): the pools are inputs only, since returning 288
unchanged arrays (36 layers x 8) cost ~0.2 ms of host time per call (CPU machine). The
attention's launch plan is made from shapes alone
(``kernels.kivi_cuda.split_plan``), so it is fixed for a trace;
``mx.compile`` retraces whenever an input's shape changes, i.e. when the
batch size or the block-table width changes.

A trace costs a plain build plus the compile passes, so a shape is only
compiled once it repeats: the first step of a new (batch size, table width)
runs plain, the second traces, later ones replay. At B=1 the table widens
every G tokens: one plain step and one trace per G steps;
``KiviStore.table_width_multiple`` widens the table in larger steps (the
engine's builder sets 32 columns when it compiles). The last ``MAX_SHAPES``
traced shapes are kept: under continuous batching the batch size moves back
and forth as sequences join and finish, and a shape seen again replays at once.
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from typing import Any

import mlx.core as mx

from kiviq.engine.kivi_cache import KiviLayerCache
from kiviq.engine.kv_store import KiviStore
from kiviq.engine.step_batches import DecodeBatch


class CompiledDecode:
    """``__call__(batch, ids)`` -> [B, V] logits, or None when this step
    should run plain (its shape has not repeated yet)."""

    MAX_SHAPES = 8  # traced (batch size, table width, flush) shapes kept, least recently used dropped

    def __init__(self, model: Any, store: KiviStore):
        self.model, self.store = model, store
        self._last: tuple[int, int, int] | None = None  # the previous step's shape
        # One compiled function per shape: dropping a function frees its trace.
        self._fns: OrderedDict[tuple[int, int, int], Any] = OrderedDict()
        self.stats = {"plain": 0, "compiled": 0, "traces": 0}

    def __call__(self, batch: DecodeBatch, ids: mx.array) -> mx.array | None:
        flush = batch.flush or ()
        key = (ids.shape[0], batch.block_tables.shape[1], len(flush))
        last, self._last = self._last, key
        fn = self._fns.get(key)
        if fn is None:
            if key != last:  # not repeated (yet): a trace may never pay off
                self.stats["plain"] += 1
                return None
            fn = self._fns[key] = mx.compile(functools.partial(self._forward, flushes=bool(flush)))
            self.stats["traces"] += 1
            if len(self._fns) > self.MAX_SHAPES:
                self._fns.popitem(last=False)
        self._fns.move_to_end(key)
        self.stats["compiled"] += 1
        offsets = batch.offsets
        if not isinstance(offsets, mx.array):  # B = 1: a Python int would be traced as a constant
            offsets = mx.array([offsets], dtype=mx.int32)
        pools = self.store.pools
        width = len(pools[0])
        outs = fn(ids, offsets, batch.block_tables, batch.num_blocks, batch.slots, batch.tail_lens,
                  *batch.write_index, *flush, *(a for pool in pools for a in pool))
        # Replace the pools before anything is evaluated: the old arrays are then
        # referenced by the step's scatters alone, which can update them in place.
        for layer in range(len(pools) if len(outs) > 1 else 0):
            pools[layer] = type(pools[layer])(*outs[1 + layer * width: 1 + (layer + 1) * width])
        return outs[0]

    def _forward(self, ids, offsets, block_tables, num_blocks, slots, tail_lens, w_slot, w_head, w_pos, *state,
                 flushes: bool = False):
        """The traced step: the model over the store, on stand-in pools; with
        ``flushes``, the first three of ``state`` are the step's flush
        (``DecodeBatch.flush``)."""
        store = self.store
        flush, state = (tuple(state[:3]), state[3:]) if flushes else (None, state)
        width = len(store.pools[0])
        pools = [type(p)(*state[i * width:(i + 1) * width]) for i, p in enumerate(store.pools)]
        batch = DecodeBatch(None, slots=slots, block_tables=block_tables, num_blocks=num_blocks,
                            tail_lens=tail_lens, offsets=offsets, write_index=(w_slot, w_head, w_pos), flush=flush)
        with store.using_pools(pools):
            caches = [KiviLayerCache(store, layer, [], batch=batch) for layer in range(store.num_layers)]
            logits = self.model(ids, cache=caches)[:, -1]
        if store.tails_written_in_place:  # by the attention kernel: the pools are unchanged
            return [logits]
        # Scatter writes replaced the stand-ins' arrays: return them.
        return [logits, *(a for pool in pools for a in pool)]
