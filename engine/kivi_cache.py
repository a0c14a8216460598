"""KIVI caches that stock mlx-lm models use unchanged.

mlx-lm attention layers call ``cache.update_and_fetch(keys, values)`` and then
``scaled_dot_product_attention(q, k, v, cache=cache, ...)`` from
``mlx_lm.models.base``. ``AttentionHook`` (entered by the model runner around
each forward) routes the latter to ``KiviLayerCache.attend`` when the cache is
ours (and to the stock function otherwise), so llama, qwen2, qwen3, mistral and
other families that use the shared helper run unchanged:

- prefill (L > 1): full-precision fused SDPA over the committed past
  (dequantized blocks + fp16 tail) and the fresh chunk; the chunk is quantized
  afterwards (DESIGN.md).
- first chunks of new sequences, packed (``PackedPrefill``): the forward's rows
  are their tokens one after another, one token per batch entry ([T, 1, H]), so
  the matmuls and norms do no padding and RoPE takes each token's position as
  its entry's offset; attention alone runs on right-padded groups, gathered
  from those rows and scattered back.
- decode (L == 1): the new token is committed first (flush rule applied),
  then decode attention reads the quantized blocks and the tail through the
  block tables (kernel where available, reference elsewhere). The engine's
  caches share one ``DecodeBatch`` per step (``KiviStore.begin_decode``), so
  a layer only writes its token and attends.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models import base as mlx_lm_base

from kiviq.engine.block_manager import blocks_for_budget
from kiviq.engine.device_memory import default_kv_memory
from kiviq.engine.kv_store import KiviStore, KVConfig, SequenceKV
from kiviq.engine.layer_pacer import LayerPacer
from kiviq.engine.step_batches import DecodeBatch, PrefillBatch
from kiviq.kernels.qk_rope import Prologue

_stock_sdpa = mlx_lm_base.scaled_dot_product_attention


@dataclass(eq=False)
class AttentionGroup:
    """First chunks that attend side by side, right-padded to ``width``: row r's
    slots are ``index[r * width:(r + 1) * width]`` (packed rows; a padding slot
    repeats the row's first token, which no real query sees under the causal mask)."""

    index: mx.array  # [rows * width] int32
    rows: int
    width: int
    attention_rows: int  # rows as attention runs them (causal_attention's ``rows``)


@dataclass(eq=False)
class PackedPrefill:
    """First chunks of new sequences packed into the rows of one forward (see the
    module docstring): chunk i's tokens are rows ``starts[i]`` onwards, rows past
    the last chunk pad the forward to ``tokens``."""

    tokens: int
    starts: list[int]
    positions: mx.array  # [tokens] int32: each row's RoPE position (its index in its chunk)
    groups: list[AttentionGroup]
    back: mx.array  # [tokens] int32: each row's output among the groups' token-major outputs


def packed_length(n: int, multiple: int) -> int:
    """Rows of a packed forward of ``n`` tokens: n rounded up to ``multiple``
    (1: n itself), and above 32 multiples to a 32nd of its power of two (at most
    1/16 more rows), so that the forward shapes a GPU meets come from a small set."""
    if multiple <= 1:
        return n
    step = max(multiple, 1 << max(0, (n - 1).bit_length() - 5))
    return -(-n // step) * step


def pack_first_chunks_layout(lengths: list[int], groups: list[list[int]], multiple: int = 1,
                             pow2_rows: bool = False) -> PackedPrefill:
    """The packed forward of first chunks of ``lengths`` tokens, grouped for
    attention by ``groups`` (indices into ``lengths``; scheduler.pack_first_chunks):
    chunks in group order, each group's attention as wide as its longest chunk
    rounded up to ``multiple``, on a power-of-two number of rows with ``pow2_rows``."""
    starts, t = [0] * len(lengths), 0
    for group in groups:
        for i in group:
            starts[i], t = t, t + lengths[i]
    total = packed_length(t, multiple)
    positions = np.zeros(total, np.int32)
    back = np.zeros(total, np.int32)
    out, attention = 0, []
    for group in groups:
        width = -(-max(lengths[i] for i in group) // multiple) * multiple
        index = np.empty((len(group), width), np.int32)
        for r, i in enumerate(group):
            s, n = starts[i], lengths[i]
            index[r, :n] = np.arange(s, s + n)
            index[r, n:] = s
            positions[s:s + n] = np.arange(n)
            back[s:s + n] = np.arange(out + r * width, out + r * width + n)
        out += len(group) * width
        rows = 1 << (len(group) - 1).bit_length() if pow2_rows else len(group)
        attention.append(AttentionGroup(mx.array(index.reshape(-1)), len(group), width, rows))
    return PackedPrefill(total, starts, mx.array(positions), attention, mx.array(back))


class KiviLayerCache:
    """One layer's cache for a batch of sequences held in a KiviStore.

    Speaks mlx-lm's cache interface (``offset``, ``update_and_fetch``,
    ``nbytes``, ``state``, ``empty``) and does the attention itself.
    """

    def __init__(self, store: KiviStore, layer: int, seqs: list[SequenceKV], *,
                 batch: DecodeBatch | None = None, prefill: PrefillBatch | None = None,
                 packed: PackedPrefill | None = None, attention_multiple: int = 1,
                 pacer: LayerPacer | None = None):
        self.store, self.layer, self.seqs = store, layer, seqs
        # A prefill forward's pace on the device (layer_pacer); None: built in one go.
        self.pacer = pacer
        # A later chunk's attention length padded to a multiple (causal_attention).
        self.attention_multiple = attention_multiple
        # A decode step prepared for every layer at once (its seqs are `seqs`).
        self.batch = batch
        # First chunks of new sequences packed into one forward (both or neither):
        # the store's write indices and the rows' layout, likewise for every layer.
        if (prefill is None) != (packed is None):
            raise ValueError("first chunks need both the store's PrefillBatch and their PackedPrefill")
        self.prefill, self.packed = prefill, packed
        self._pending: tuple[mx.array, mx.array] | None = None

    @property
    def offset(self) -> int | mx.array:
        """Committed tokens (the RoPE offset); per sequence when batched."""
        if self.batch is not None:
            return self.batch.offsets
        if self.packed is not None:
            return self.packed.positions
        g = self.store.config.group_size
        offsets = [s.offset(self.layer, g) for s in self.seqs]
        return offsets[0] if len(offsets) == 1 else mx.array(offsets)

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        # Nothing is stored yet: `attend` decides the order of writes and reads.
        if self._pending is not None:
            raise RuntimeError(
                "KIVI cache: attention did not go through kiviq's hook (AttentionHook); "
                "this model family computes attention itself and is not supported")
        self._pending = (keys, values)
        return keys, values

    def attend(self, queries: mx.array, keys: mx.array, values: mx.array, scale: float) -> mx.array:
        """Attention for this layer; commits keys/values [B, H_kv, L, D].

        A rotated store (``KVConfig.rotate``, ``--kv-bits 2r``) lives in the Hadamard
        basis: q, k and v are rotated along D on entry (``KiviStore.rotation``),
        every path below (decode, prefill chunks) stores and attends to rotated rows
        only, and the output is rotated back (by the decode kernel's launch, where
        it runs). H is orthogonal and symmetric, so q.k and softmax(qK^T) V H H are
        unchanged in exact arithmetic, and pools and flushes need no change: they
        quantize whatever rows they are given.

        Returns:
            [B, H_q, L, D].
        """
        rotate = self.store.rotation
        if rotate is not None:
            queries, keys, values = (rotate(x) for x in (queries, keys, values))
        self._pending = None
        if self.packed is not None:
            out = self._packed_attend(queries, keys, values, scale)
            return out if rotate is None else rotate(out)
        if queries.shape[2] == 1:
            batch = self.batch or self.store.begin_decode(self.seqs, self.layer)
            # As the model made them ([B, H, 1, D]): no per-layer reshape nodes; the
            # output comes back in the model's basis (write_and_attend).
            return self.store.write_and_attend(self.layer, batch, queries, keys, values, scale)
        out = self._prefill_attend(queries, keys, values, scale)
        return out if rotate is None else rotate(out)

    def attend_projection(self, qkv: mx.array, offsets: mx.array, prologue: Prologue, q_norm: mx.array | None,
                          k_norm: mx.array | None, scale: float) -> mx.array:
        """A decode step's attention for this layer from its fused q/k/v projection
        row [B, 1, (H_q + 2 H_kv) D] (engine.decode_attention): ``prologue`` makes q, k
        and v (``KiviStore.prologue_and_attend``; for a rotated store it must rotate);
        commits k and v. Returns [B, H_q, 1, D] in the model's basis."""
        if prologue.rotate != (self.store.rotation is not None):
            raise ValueError(f"a prologue with rotate={prologue.rotate} for a store that is "
                             f"{'' if self.store.rotation is not None else 'not '}rotated (kv_bits 2r)")
        batch = self.batch or self.store.begin_decode(self.seqs, self.layer)
        return self.store.prologue_and_attend(self.layer, batch, qkv, offsets, prologue, q_norm, k_norm, scale)

    def _prefill_attend(self, queries: mx.array, keys: mx.array, values: mx.array, scale: float) -> mx.array:
        """A prefill chunk's attention (L > 1), in the store's basis."""
        if queries.shape[0] != 1:
            raise ValueError("a batched prefill takes first chunks of new sequences (KiviStore.begin_prefill)")
        seq = self.seqs[0]
        if seq.offset(self.layer, 1) == 0:  # first chunk: attends to itself only
            out = causal_attention(queries, keys, values, scale, multiple=self.attention_multiple)
        else:
            past_k, past_v = self.store.dense_past(self.layer, seq)
            k_all = mx.concatenate([past_k, keys[0].astype(past_k.dtype)], axis=1)[None]
            v_all = mx.concatenate([past_v, values[0].astype(past_v.dtype)], axis=1)[None]
            out = causal_attention(queries, k_all.astype(queries.dtype), v_all.astype(queries.dtype), scale,
                                   multiple=self.attention_multiple)
            self.store.append(self.layer, seq, keys[0], values[0], reads=(out,))
            return self._after_writes(out)
        self.store.append(self.layer, seq, keys[0], values[0])
        return self._after_writes(out)

    def _packed_attend(self, queries: mx.array, keys: mx.array, values: mx.array, scale: float) -> mx.array:
        """Packed first chunks ([T, H, 1, D]: a row per token): each attention group
        gathered into its right-padded rows, attending causally to itself only, its
        output scattered back to the rows; the keys and values written by the
        store's indices (the forward's token-major rows are the packed rows)."""
        t, d = queries.shape[0], queries.shape[3]
        q, k, v = (x.reshape(t, x.shape[1], d) for x in (queries, keys, values))
        outs = []
        for g in self.packed.groups:
            def padded(x, g=g):
                return x[g.index].reshape(g.rows, g.width, x.shape[1], d).transpose(0, 2, 1, 3)

            out = causal_attention(padded(q), padded(k), padded(v), scale, rows=g.attention_rows)
            outs.append(out.transpose(0, 2, 1, 3).reshape(g.rows * g.width, -1, d))
        self.store.write_prefill(self.layer, self.prefill, k[None].swapaxes(1, 2), v[None].swapaxes(1, 2))
        out = outs[0] if len(outs) == 1 else mx.concatenate(outs)
        return self._after_writes(out[self.packed.back][:, :, None])

    def _after_writes(self, out: mx.array) -> mx.array:
        """``out``, once this layer's writes have run (``KiviStore.layer_writes``),
        launched by the forward's pacer where it has one."""
        out = mx.depends(out, self.store.layer_writes(self.layer))
        return out if self.pacer is None else self.pacer(out)

    @property
    def nbytes(self) -> int:
        """Bytes this layer holds for these sequences (blocks + tails)."""
        pool = self.store.pools[self.layer]
        nb_total = pool.k_codes.shape[0]
        per_block = sum(a.nbytes for a in pool[:6]) // nb_total
        per_slot = (pool.tail_k.nbytes + pool.tail_v.nbytes) // pool.tail_k.shape[0]
        return sum(s.blocks_used[self.layer] * per_block + per_slot for s in self.seqs)

    @property
    def state(self) -> list[mx.array]:
        return list(self.store.pools[self.layer])

    def empty(self) -> bool:
        return all(s.offset(self.layer, 1) == 0 for s in self.seqs)

    def is_trimmable(self) -> bool:
        return False


def causal_attention(queries: mx.array, keys: mx.array, values: mx.array, scale: float, *,
                     rows: int | None = None, multiple: int = 1) -> mx.array:
    """Causal fused attention of queries [B, H_q, L, D] over keys, values [B, H_kv, S, D],
    the L queries aligned with the last L keys, run on zero-padded copies whose shape
    comes from a small set (a GPU builds an attention graph per shape): B rows padded
    to ``rows``, and L and S both extended by the same count to a multiple of
    ``multiple``. The result is the same: a padded row is a batch entry of its own,
    and a key appended after the last one lies beyond every real query's diagonal.

    Returns:
        [B, H_q, L, D].
    """
    b, _, length, _ = queries.shape
    extra, more_rows = -length % multiple, (rows or b) - b
    if not (extra or more_rows):
        return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask="causal")
    pad = [(0, more_rows), (0, 0), (0, extra), (0, 0)]
    out = mx.fast.scaled_dot_product_attention(mx.pad(queries, pad), mx.pad(keys, pad), mx.pad(values, pad),
                                               scale=scale, mask="causal")
    return out[:b, :, :length]


def kiviq_sdpa(queries, keys, values, cache, scale: float, mask, sinks=None):
    """Drop-in for mlx-lm's ``scaled_dot_product_attention``."""
    if isinstance(cache, KiviLayerCache):
        if sinks is not None:
            raise ValueError("KIVI caches do not support attention sinks")
        return cache.attend(queries, keys, values, scale)
    return _stock_sdpa(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)


class AttentionHook:
    """Routes mlx-lm's shared attention helper through ``kiviq_sdpa`` while entered.

    Patches only the modules of ``model``'s own layers (and ``base``) that use
    the stock helper, and restores them on exit; re-entrant.
    """

    def __init__(self, model: nn.Module):
        names = {type(m).__module__ for _, m in model.named_modules()} | {mlx_lm_base.__name__}
        self._modules = [sys.modules[n] for n in sorted(names)
                         if n in sys.modules and getattr(sys.modules[n], "scaled_dot_product_attention", None)
                         is _stock_sdpa]
        self._depth = 0

    def __enter__(self) -> "AttentionHook":
        if self._depth == 0:
            for module in self._modules:
                module.scaled_dot_product_attention = kiviq_sdpa
        self._depth += 1
        return self

    def __exit__(self, *exc) -> None:
        self._depth -= 1
        if self._depth == 0:
            for module in self._modules:
                module.scaled_dot_product_attention = _stock_sdpa


def attention_shape(model: nn.Module) -> tuple[int, int, int]:
    """(num_layers, num_kv_heads, head_dim) of an mlx-lm model."""
    args = model.args
    n_heads = args.num_attention_heads
    head_dim = getattr(args, "head_dim", None) or args.hidden_size // n_heads
    n_kv = getattr(args, "num_key_value_heads", None) or n_heads
    return len(model.layers), n_kv, head_dim


def store_sizes(model: nn.Module, config: KVConfig, dtype: mx.Dtype | None = None):
    """The bytes of one block (all layers) and of one sequence's tail slot in a store
    for ``model``: ``block_bytes`` and ``slot_bytes`` of a one-block probe's allocator."""
    layers, n_kv, head_dim = attention_shape(model)
    probe = KiviStore(layers, n_kv, head_dim, config=config, num_blocks=1, num_slots=1,
                      dtype=dtype if dtype is not None else model_dtype(model))
    return probe.blocks


def make_store(model: nn.Module, config: KVConfig, *, kv_memory: int | None = None,
               max_sequences: int = 8, context: int | None = None, dtype: mx.Dtype | None = None,
               use_kernel: bool | None = None) -> KiviStore:
    """A store for ``model`` whose pools and tails fit in ``kv_memory`` bytes,
    and no larger than ``max_sequences`` sequences of ``context`` tokens need.

    Raises:
        ValueError: the budget cannot hold the tails plus one full-context
            sequence's worth of blocks.
    """
    layers, n_kv, head_dim = attention_shape(model)
    if dtype is None:
        dtype = model_dtype(model)
    budget = kv_memory if kv_memory is not None else default_kv_memory()
    sizes = store_sizes(model, config, dtype)
    num_blocks = blocks_for_budget(budget, block_bytes=sizes.block_bytes, slot_bytes=sizes.slot_bytes,
                                   max_sequences=max_sequences, group_size=config.group_size, context=context)
    if num_blocks < 1:
        raise ValueError(f"kv_memory={budget} bytes cannot hold {max_sequences} sequence tails "
                         f"({sizes.slot_bytes} bytes each) plus any quantized block")
    return KiviStore(layers, n_kv, head_dim, config=config, num_blocks=num_blocks,
                     num_slots=max_sequences, dtype=dtype, use_kernel=use_kernel)


def model_dtype(model: nn.Module) -> mx.Dtype:
    """The dtype the model computes in (its first floating parameter's)."""
    from mlx.utils import tree_flatten

    for _, p in tree_flatten(model.parameters()):
        if mx.issubdtype(p.dtype, mx.floating):
            return p.dtype
    return mx.float16


class KiviSequenceCache(list):
    """The per-layer caches of one sequence (a list, as mlx-lm expects), plus
    ``release()`` to give its blocks back. Its forwards must run inside the
    model's ``AttentionHook``."""

    def __init__(self, store: KiviStore):
        self.store = store
        self.sequence = store.blocks.allocate()
        super().__init__(KiviLayerCache(store, i, [self.sequence]) for i in range(store.num_layers))

    def release(self) -> None:
        self.store.blocks.free(self.sequence)

