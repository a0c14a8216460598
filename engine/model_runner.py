"""The one place that runs the model: prefill chunks and batched decode
steps over the paged KIVI store.

Attention happens here: every forward runs inside ``self.attention``
(kivi_cache.AttentionHook), which routes mlx-lm's attention helper to the
KIVI caches for the duration of the forward and restores it afterwards.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from kiviq.engine.compiled_decode import CompiledDecode
from kiviq.engine.kivi_cache import AttentionHook, KiviLayerCache, PackedPrefill, pack_first_chunks_layout
from kiviq.engine.kv_store import KiviStore, SequenceKV
from kiviq.engine.layer_pacer import LayerPacer


# mlx-lm families whose Model.__call__ is exactly `head(self.model(inputs, cache))`,
# the head being lm_head or, with tied embeddings, embed_tokens.as_linear.
PLAIN_HEAD_FAMILIES = frozenset({"llama", "mistral", "qwen2", "qwen3"})


def vocabulary_projection(model: nn.Module):
    """The model's final projection (hidden -> logits) as a function, or None
    where its family may do more than project (then prefill takes full logits)."""
    if getattr(model, "model_type", None) not in PLAIN_HEAD_FAMILIES or not hasattr(model, "model"):
        return None
    if getattr(model.args, "tie_word_embeddings", False):
        return model.model.embed_tokens.as_linear
    return getattr(model, "lm_head", None)


# On a GPU MLX builds a cuDNN attention graph per attention shape (~45 ms of host time on an
# H200, while the device waits) and keeps the last 256, and a forward of a new shape
# costs ~20-30 ms of host time more, so prefill runs on shapes from a small set that
# repeats: the attention of a group of first chunks is padded to a multiple of
# PREFILL_WIDTH_MULTIPLE tokens and a power-of-two number of rows, the packed forward
# they share to a few lengths (kivi_cache.packed_length); a prompt split across
# steps is cut after a multiple of PREFILL_CHUNK_MULTIPLE tokens, and a later chunk's
# attention is padded to such a multiple (kivi_cache.causal_attention).
PREFILL_WIDTH_MULTIPLE = 64
PREFILL_CHUNK_MULTIPLE = 256


class ModelRunner:
    """Runs an mlx-lm model whose attention reads and writes a KiviStore."""

    def __init__(self, model: nn.Module, store: KiviStore, *, compile_decode: bool = False):
        self.model = model
        self.store = store
        self.attention = AttentionHook(model)
        self._split = vocabulary_projection(model)
        # Only a GPU builds attention graphs per shape; on a CPU padding is pure cost.
        gpu = mx.default_device() == mx.gpu
        self.prefill_width_multiple = PREFILL_WIDTH_MULTIPLE if gpu else 1
        self.prefill_chunk_multiple = PREFILL_CHUNK_MULTIPLE if gpu else 1
        # Optional: decode steps replayed through mx.compile (engine.compiled_decode).
        self.compiled = CompiledDecode(model, store) if compile_decode else None

    def prefill(self, seq: SequenceKV, tokens: list[int]) -> mx.array:
        """Feed a later chunk of one sequence's context (it attends to the
        sequence's committed past).

        Returns:
            [V] logits after the chunk's last token.
        """
        pacer, multiple = LayerPacer(), self.prefill_chunk_multiple
        caches = [KiviLayerCache(self.store, layer, [seq], attention_multiple=multiple, pacer=pacer)
                  for layer in range(self.store.num_layers)]
        with self.store.forward_writes(), self.attention:
            hidden = self.trunk(mx.array(tokens)[None], caches)
        return self.head(hidden[0, -1:])[0]

    def prefill_layout(self, lengths: list[int], groups: list[list[int]] | None = None) -> PackedPrefill:
        """The packed forward of first chunks of ``lengths`` tokens whose attention
        runs in ``groups`` (default: one group), padded as this device wants."""
        return pack_first_chunks_layout(lengths, groups or [list(range(len(lengths)))],
                                        self.prefill_width_multiple, pow2_rows=self.prefill_chunk_multiple > 1)

    def prefill_first(self, seqs: list[SequenceKV], chunks: list[list[int]],
                      groups: list[list[int]] | None = None) -> mx.array:
        """The first chunks of new sequences in one packed forward (no padding
        between them; kivi_cache.PackedPrefill), attending in ``groups`` of similar
        lengths (scheduler.pack_first_chunks; default: all in one); their keys and
        values go into the store as each layer makes them (``KiviStore.begin_prefill``).

        Returns:
            [B, V] logits after each chunk's last token.
        """
        lengths = [len(c) for c in chunks]
        layout = self.prefill_layout(lengths, groups)
        batch = self.store.begin_prefill(seqs, lengths, layout.starts)
        tokens = np.zeros(layout.tokens, np.int32)
        for chunk, start in zip(chunks, layout.starts):
            tokens[start:start + len(chunk)] = chunk
        pacer = LayerPacer()
        caches = [KiviLayerCache(self.store, layer, seqs, prefill=batch, packed=layout, pacer=pacer)
                  for layer in range(self.store.num_layers)]
        with self.store.forward_writes(), self.attention:
            hidden = self.trunk(mx.array(tokens)[:, None], caches)  # a row per token: [T, 1, H]
        last = hidden[mx.array([s + n - 1 for s, n in zip(layout.starts, lengths)]), 0]
        return self.head(last)

    def trunk(self, tokens: mx.array, caches: list[KiviLayerCache]) -> mx.array:
        """Hidden states [B, L, H] after the final norm where the model's
        family is known to end in a plain vocabulary projection (``head``), else
        its logits [B, L, V]."""
        if self._split is None:
            return self.model(tokens, cache=caches)
        return self.model.model(tokens, cache=caches)

    def head(self, hidden: mx.array) -> mx.array:
        """Logits [..., V] of rows that ``trunk`` returned: a prompt's logits are
        only needed after its last token, so the vocabulary projection (151k x
        2560 for Qwen3-4B, ~10% of a prefill's FLOPs and a [B, L, V] array) runs
        on those rows alone."""
        return hidden if self._split is None else self._split(hidden)

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
        mx.async_eval(*arrays, self.store.pending())

    def settle(self, *arrays: mx.array) -> None:
        """Evaluate outputs and every pending pool write (`KiviStore.pending`), so the
        next step's writes find no pending reader (and update the pool in place)."""
        mx.eval(*arrays, self.store.pending())
