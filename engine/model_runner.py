"""The one place that runs the model: prefill chunks and batched decode
steps over the paged KIVI store.

Attention happens here: every forward runs inside ``self.attention``
(kivi_cache.AttentionHook), which routes mlx-lm's attention helper to the
KIVI caches for the duration of the forward and restores it afterwards.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from kiviq.engine.compiled_decode import CompiledDecode
from kiviq.engine.kivi_cache import AttentionHook, KiviLayerCache
from kiviq.engine.kv_store import KiviStore, SequenceKV


class ModelRunner:
    """Runs an mlx-lm model whose attention reads and writes a KiviStore."""

    def __init__(self, model: nn.Module, store: KiviStore, *, compile_decode: bool = False):
        self.model = model
        self.store = store
        self.attention = AttentionHook(model)
        # Optional: decode steps replayed through mx.compile (engine.compiled_decode).
        self.compiled = CompiledDecode(model, store) if compile_decode else None

    def _caches(self, seqs: list[SequenceKV], lengths: list[int] | None = None) -> list[KiviLayerCache]:
        return [KiviLayerCache(self.store, layer, seqs, lengths) for layer in range(self.store.num_layers)]

    def prefill(self, seq: SequenceKV, tokens: list[int]) -> mx.array:
        """Feed a chunk of one sequence's context.

        Returns:
            [V] logits after the chunk's last token.
        """
        with self.attention:
            logits = self.model(mx.array(tokens)[None], cache=self._caches([seq]))
        return logits[0, -1]

    def prefill_new(self, seqs: list[SequenceKV], prompts: list[list[int]]) -> mx.array:
        """Whole prompts of new sequences in one forward (right-padded).

        Returns:
            [B, V] logits after each prompt's last token.
        """
        lengths = [len(p) for p in prompts]
        width = max(lengths)
        tokens = mx.array([p + [0] * (width - len(p)) for p in prompts])
        with self.attention:
            logits = self.model(tokens, cache=self._caches(seqs, lengths))
        return logits[mx.arange(len(prompts)), mx.array(lengths) - 1]

    def decode(self, seqs: list[SequenceKV], tokens: list[int] | mx.array) -> mx.array:
        """One token per sequence, all in one forward (per-sequence RoPE
        offsets come from the caches).

        The step's slots, lengths, block tables and flushes are prepared once
        for all layers (``KiviStore.begin_decode``); each layer then only
        writes its token and attends.

        Returns:
            [B, V] logits.
        """
        batch = self.store.begin_decode(seqs)
        ids = tokens[:, None] if isinstance(tokens, mx.array) else mx.array([[t] for t in tokens])
        with self.attention:  # a compiled step traces the model inside it too
            if self.compiled is not None:
                logits = self.compiled(batch, ids)
                if logits is not None:
                    return logits
            caches = [KiviLayerCache(self.store, layer, seqs, batch=batch) for layer in range(self.store.num_layers)]
            logits = self.model(ids, cache=caches)
        return logits[:, -1]

    def launch(self, *arrays: mx.array) -> None:
        """Start evaluating outputs and every pending pool write, without waiting
        (a pipelined decode step; the next step's graph is built meanwhile)."""
        mx.async_eval(*arrays, self.store.pools)

    def settle(self, *arrays: mx.array) -> None:
        """Evaluate outputs and every pending pool write, so the next step's
        writes find no pending reader (and update the pool in place)."""
        mx.eval(*arrays, self.store.pools)
