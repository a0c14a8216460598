"""The paged KIVI KV store: per-layer pools, block/slot allocation, and the
per-step writes and reads of every sequence.

One store serves one model. Each layer owns a ``KiviPool`` (kernels/layout.py);
a sequence owns a tail slot and a list of block ids shared by all layers (block
``j`` of a sequence holds its tokens ``j*G .. j*G+G-1`` in every layer).

Write/read order matters for memory (measured, kernels/kivi_reference.py): MLX
updates a pool array in place only when no pending computation still reads it.
So within a layer every write (new tokens, flushes) comes before the attention
that reads the pool, and prefill attention is evaluated before its tokens are
committed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx

from kernels import (
    KiviPool,
    allocate_pool,
    blocks_to_tokens,
    check_layout,
    dequantize_key_blocks,
    dequantize_value_blocks,
    quantize_key_blocks,
    quantize_value_blocks,
    tokens_to_blocks,
)
from kernels.dispatch import decode_attend, flush


@dataclass(frozen=True, slots=True)
class KVConfig:
    """KIVI parameters: bits b, group size G, residual length R."""

    bits: int = 4
    group_size: int = 32
    residual: int = 128

    def __post_init__(self):
        check_layout(self.bits, self.group_size)
        if self.residual < self.group_size or self.residual % self.group_size:
            raise ValueError(f"residual ({self.residual}) must be a positive multiple of group_size")


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


class KiviStore:
    """Pools for every layer plus the allocator of their blocks and slots.

    Args:
        num_layers, num_kv_heads, head_dim: the model's attention shape.
        config: KIVI parameters.
        num_blocks: blocks per layer pool (capacity: num_blocks * G tokens).
        num_slots: tails, i.e. the most sequences held at once.
        dtype: dtype of the tails (the model's activations); scales and zeros
            are bf16 for a bf16 model, else fp16.
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, *, config: KVConfig,
                 num_blocks: int, num_slots: int, dtype: mx.Dtype = mx.float16):
        check_layout(config.bits, config.group_size, head_dim)
        self.config = config
        self.num_layers = num_layers
        self.dtype = dtype
        self.pools: list[KiviPool] = []
        for _ in range(num_layers):
            pool = allocate_pool(num_blocks, num_slots, num_kv_heads, head_dim, bits=config.bits,
                                 group_size=config.group_size, residual=config.residual, dtype=mx.float16)
            if dtype != mx.float16:  # tails in the model's dtype; scales fp16 unless bf16
                sd = mx.bfloat16 if dtype == mx.bfloat16 else mx.float16
                pool = KiviPool(*(a.astype(sd) if a.dtype == mx.float16 else a for a in pool[:6]),
                                pool.tail_k.astype(dtype), pool.tail_v.astype(dtype))
            self.pools.append(pool)
        mx.eval(self.pools)
        self._free_blocks = list(range(num_blocks - 1, -1, -1))
        self._free_slots = list(range(num_slots - 1, -1, -1))
        self.num_blocks, self.num_slots = num_blocks, num_slots
        p0 = self.pools[0]
        self.block_bytes = num_layers * sum(a.nbytes // num_blocks for a in p0[:6])
        self.slot_bytes = num_layers * (p0.tail_k.nbytes + p0.tail_v.nbytes) // num_slots

    # ---- allocation ------------------------------------------------------

    @property
    def free_blocks(self) -> int:
        return len(self._free_blocks)

    @property
    def free_slots(self) -> int:
        return len(self._free_slots)

    def used_bytes(self) -> int:
        """Bytes of blocks and tails currently owned by sequences."""
        return ((self.num_blocks - self.free_blocks) * self.block_bytes
                + (self.num_slots - self.free_slots) * self.slot_bytes)

    def budget_bytes(self) -> int:
        """Bytes of all blocks and tails the store owns."""
        return self.num_blocks * self.block_bytes + self.num_slots * self.slot_bytes

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks a sequence of ``num_tokens`` tokens holds (the rest is in its tail)."""
        g, r = self.config.group_size, self.config.residual
        return 0 if num_tokens < r + g else (num_tokens - r) // g

    def new_sequence(self) -> SequenceKV:
        if not self._free_slots:
            raise OutOfKVMemory("no free KV slot")
        return SequenceKV(self._free_slots.pop(), self.num_layers)

    def release(self, seq: SequenceKV) -> None:
        """Give a sequence's blocks and slot back (idempotent)."""
        if seq.slot < 0:
            return
        self._free_blocks.extend(reversed(seq.block_ids))
        self._free_slots.append(seq.slot)
        seq.block_ids, seq.slot = [], -1

    def _block_for(self, seq: SequenceKV, index: int) -> int:
        """Block id of the sequence's ``index``-th block, allocating the first
        time any layer reaches it."""
        if index == len(seq.block_ids):
            if not self._free_blocks:
                raise OutOfKVMemory("KV pool is full: no free block")
            seq.block_ids.append(self._free_blocks.pop())
        return seq.block_ids[index]

    # ---- writes ----------------------------------------------------------

    def _write_blocks(self, pool: KiviPool, ids: list[int], k: mx.array, v: mx.array) -> None:
        """Quantize full blocks k, v [N, H_kv, G, D] into pool blocks ``ids``."""
        sd = pool.k_scales.dtype
        idx = mx.array(ids, dtype=mx.int32)
        for names, quantized in (
            (("k_codes", "k_scales", "k_zeros"), quantize_key_blocks(k, bits=self.config.bits, scale_dtype=sd)),
            (("v_codes", "v_scales", "v_zeros"), quantize_value_blocks(v, bits=self.config.bits, scale_dtype=sd)),
        ):
            for name, arr in zip(names, quantized):
                getattr(pool, name)[idx] = arr

    def append(self, layer: int, seq: SequenceKV, k: mx.array, v: mx.array) -> None:
        """Commit new tokens k, v [H_kv, L, D] of one sequence to ``layer``.

        Applies the flush rule: while the tail would hold R + G or more
        tokens, its oldest G become a quantized block. A long prompt is thus
        quantized at once, leaving R .. R+G-1 tokens in the tail.
        """
        g, r = self.config.group_size, self.config.residual
        pool = self.pools[layer]
        t_old, n_new = seq.tail_lens[layer], k.shape[1]
        total = t_old + n_new
        n_flush = 0 if total < r + g else (total - r) // g
        if n_flush == 0:
            pool.tail_k[seq.slot, :, t_old:total] = k.astype(pool.tail_k.dtype)
            pool.tail_v[seq.slot, :, t_old:total] = v.astype(pool.tail_v.dtype)
            seq.tail_lens[layer] = total
            return
        # all: [H_kv, T, D] -- old tail then new tokens; evaluated before the
        # writes below so no pending read keeps the pool from updating in place.
        all_k = mx.concatenate([pool.tail_k[seq.slot, :, :t_old], k.astype(pool.tail_k.dtype)], axis=1)
        all_v = mx.concatenate([pool.tail_v[seq.slot, :, :t_old], v.astype(pool.tail_v.dtype)], axis=1)
        mx.eval(all_k, all_v)
        first = seq.blocks_used[layer]
        ids = [self._block_for(seq, first + i) for i in range(n_flush)]
        cut = n_flush * g
        self._write_blocks(pool, ids, tokens_to_blocks(all_k[:, :cut], g), tokens_to_blocks(all_v[:, :cut], g))
        pool.tail_k[seq.slot, :, : total - cut] = all_k[:, cut:]
        pool.tail_v[seq.slot, :, : total - cut] = all_v[:, cut:]
        seq.blocks_used[layer] = first + n_flush
        seq.tail_lens[layer] = total - cut

    def append_decode(self, layer: int, seqs: list[SequenceKV], k: mx.array, v: mx.array) -> None:
        """Commit one new token per sequence: k, v [B, H_kv, D].

        One scatter writes every token into its tail (a tail holds at most
        R + G - 1 tokens between steps, so there is room); the sequences whose
        tail thereby reaches R + G flush their oldest G tokens into a new
        block, all in one flush call (a kernel where one runs).
        """
        g, r = self.config.group_size, self.config.residual
        pool = self.pools[layer]
        slots = mx.array([s.slot for s in seqs], dtype=mx.int32)
        pos = mx.array([s.tail_lens[layer] for s in seqs], dtype=mx.int32)
        # tail[slots, :, pos]: [B, H_kv, D] (numpy rules: advanced axes first)
        pool.tail_k[slots, :, pos] = k.astype(pool.tail_k.dtype)
        pool.tail_v[slots, :, pos] = v.astype(pool.tail_v.dtype)
        full = []
        for s in seqs:
            s.tail_lens[layer] += 1
            if s.tail_lens[layer] == r + g:
                full.append(s)
        if not full:
            return
        ids = [self._block_for(s, s.blocks_used[layer]) for s in full]
        flush(pool, mx.array([s.slot for s in full], dtype=mx.int32), mx.array(ids, dtype=mx.int32),
              mx.array([r + g] * len(full), dtype=mx.int32), bits=self.config.bits, group_size=g)
        for s in full:
            s.tail_lens[layer] -= g
            s.blocks_used[layer] += 1

    # ---- reads -----------------------------------------------------------

    def dense_past(self, layer: int, seq: SequenceKV) -> tuple[mx.array, mx.array]:
        """The sequence's committed K and V in ``layer`` as [H_kv, S, D] (blocks
        dequantized, then the tail), for prefill attention."""
        pool = self.pools[layer]
        t, nb = seq.tail_lens[layer], seq.blocks_used[layer]
        tail_k, tail_v = pool.tail_k[seq.slot, :, :t], pool.tail_v[seq.slot, :, :t]
        if nb == 0:
            return tail_k, tail_v
        idx = mx.array(seq.block_ids[:nb], dtype=mx.int32)
        bits, dt = self.config.bits, pool.tail_k.dtype
        k = blocks_to_tokens(dequantize_key_blocks(pool.k_codes[idx], pool.k_scales[idx], pool.k_zeros[idx],
                                                   bits=bits, dtype=dt))
        v = blocks_to_tokens(dequantize_value_blocks(pool.v_codes[idx], pool.v_scales[idx], pool.v_zeros[idx],
                                                     bits=bits, dtype=dt))
        return mx.concatenate([k, tail_k], axis=1), mx.concatenate([v, tail_v], axis=1)

    def decode_attend(self, layer: int, seqs: list[SequenceKV], q: mx.array, scale: float) -> mx.array:
        """Attention of one new query per sequence over its blocks and tail.

        Args:
            q: [B, H_q, D], the sequences' current tokens already committed.

        Returns:
            [B, H_q, D].
        """
        max_nb = max(1, max(s.blocks_used[layer] for s in seqs))
        table = [s.block_ids[: s.blocks_used[layer]] + [0] * (max_nb - s.blocks_used[layer]) for s in seqs]
        return decode_attend(
            q, self.pools[layer],
            mx.array(table, dtype=mx.int32),
            mx.array([s.blocks_used[layer] for s in seqs], dtype=mx.int32),
            mx.array([s.slot for s in seqs], dtype=mx.int32),
            mx.array([s.tail_lens[layer] for s in seqs], dtype=mx.int32),
            scale=scale, bits=self.config.bits, group_size=self.config.group_size,
        )
