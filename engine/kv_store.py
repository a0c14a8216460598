"""The paged KIVI KV store: per-layer pools and the per-step writes and reads
of every sequence.

One store serves one model. Each layer owns a ``KiviPool`` (kernels/layout.py);
which sequence owns which block and slot is the block manager's business
(engine/block_manager.py, ``KiviStore.blocks``).

Write/read order matters for memory (measured, kernels/kivi_reference.py): MLX
updates a pool array in place only when no pending computation still reads it.
So within a layer every write (new tokens, flushes) comes before the attention
that reads the pool, and prefill attention is evaluated before its tokens are
committed.

A batched decode step is prepared once for all layers (``begin_decode``):
between forwards every layer of a sequence holds the same tokens, so slots,
write positions, block tables and lengths are the same in every layer, and
each layer only scatters its new token and runs its attention.
"""

from __future__ import annotations

import contextlib

import mlx.core as mx
import numpy as np

from kiviq.engine.block_manager import BlockManager, OutOfKVMemory, SequenceKV
from kiviq.engine.config import KVConfig
from kiviq.engine.step_batches import DecodeBatch, PrefillBatch
from kiviq.kernels import (
    KiviPool,
    allocate_pool,
    blocks_to_tokens,
    check_layout,
    dequantize_key_blocks,
    dequantize_value_blocks,
)
from kiviq.kernels.dispatch import (
    attend_plan,
    blocks_written_in_place,
    flush_layers,
    prologue_plan,
    step_flush,
    step_flush_params,
    write_blocks,
    writes_tail,
)
from kiviq.kernels.qk_rope import Prologue
from kiviq.kernels.rotation import check_rotation, hadamard_rotate

__all__ = ["DecodeBatch", "KVConfig", "KiviStore", "OutOfKVMemory", "PrefillBatch", "SequenceKV"]


class KiviStore:
    """Pools for every layer; ``blocks`` (a BlockManager) allocates their blocks and slots.

    Args:
        num_layers, num_kv_heads, head_dim: the model's attention shape.
        config: KIVI parameters.
        num_blocks: blocks per layer pool (capacity: num_blocks * G tokens).
        num_slots: tails, i.e. the most sequences held at once.
        dtype: dtype of the tails (the model's activations); scales and zeros
            are bf16 for a bf16 model, else fp16.
        use_kernel: passed to every kernels.dispatch call (None: the kernel where
            it runs; False: the reference).
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, *, config: KVConfig,
                 num_blocks: int, num_slots: int, dtype: mx.Dtype = mx.float16, use_kernel: bool | None = None):
        check_layout(config.bits, config.group_size, head_dim)
        if config.rotate:
            check_rotation(head_dim)
        # The map from the model's basis into the pools' (None: the same basis); its
        # own inverse. Rotated pools hold K H and V H (KVConfig.rotate): the store
        # writes and flushes them like any others; its callers (KiviLayerCache.attend, the
        # decode prologue: prologue_and_attend) rotate q, k and v on the way in, and the
        # output goes out rotated back (decode: the attention launch's merge; prefill: the
        # caller).
        self.rotation = hadamard_rotate if config.rotate else None
        self.config = config
        self.num_layers = num_layers
        self.dtype = dtype
        self.use_kernel = use_kernel
        self.pools: list[KiviPool] = []
        for _ in range(num_layers):
            # Tails of R + k*G rows (allocate_pool gives residual + G).
            pool = allocate_pool(num_blocks, num_slots, num_kv_heads, head_dim, bits=config.bits,
                                 group_size=config.group_size,
                                 residual=config.residual + config.flush_tokens - config.group_size,
                                 dtype=mx.float16)
            if dtype != mx.float16:  # tails in the model's dtype; scales fp16 unless bf16
                sd = mx.bfloat16 if dtype == mx.bfloat16 else mx.float16
                pool = KiviPool(*(a.astype(sd) if a.dtype == mx.float16 else a for a in pool[:6]),
                                pool.tail_k.astype(dtype), pool.tail_v.astype(dtype))
            self.pools.append(pool)
        mx.eval(self.pools)
        p0 = self.pools[0]
        self._unrun_writes: list[tuple[int, mx.array]] = []  # (layer, done): see pending()
        # Block writes are in-place launches (CUDA) rather than scatters into the
        # pools: then a later chunk need not finish its reads of a pool before its
        # writes (see append).
        self._blocks_in_place = blocks_written_in_place(p0, use_kernel)
        # The in-place flush kernel's params where a decode step can flush inside its
        # own graph (CUDA; see begin_decode), else None.
        self._step_flush_params = step_flush_params(p0, config.flush_blocks, use_kernel)
        self.blocks = BlockManager(
            num_blocks, num_slots, num_layers=num_layers, group_size=config.group_size,
            residual=config.residual, flush_blocks=config.flush_blocks,
            block_bytes=num_layers * sum(a.nbytes // num_blocks for a in p0[:6]),
            slot_bytes=num_layers * (p0.tail_k.nbytes + p0.tail_v.nbytes) // num_slots)
        # Decode block tables are this many columns wide, rounded up (1: exactly
        # the longest sequence's blocks). A compiled decode step is retraced
        # whenever the width changes (engine.compiled_decode), i.e. every G
        # tokens of the longest sequence at width multiple 1; columns past a
        # sequence's blocks are never read. A wider table also changes the
        # kernel's split plan.
        self.table_width_multiple = 1
        # Whether the last decode step's attention wrote the tails itself (the CUDA
        # kernel, dispatch.writes_tail): then the next step flushes inside its graph.
        self._kernel_writes_tails = False

    @property
    def tails_written_in_place(self) -> bool:
        """Whether the last decode step's attention wrote the new tokens into the
        tails itself, in place (the CUDA kernel), rather than by scatters."""
        return self._kernel_writes_tails

    def used_bytes(self) -> int:
        """Bytes of blocks and tails owned by sequences (the worker's KV metrics)."""
        return self.blocks.used_bytes()

    def budget_bytes(self) -> int:
        """Bytes of all blocks and tails the store owns."""
        return self.blocks.budget_bytes()

    # ---- writes ----------------------------------------------------------

    def _write_blocks(self, layer: int, ids: list[int] | mx.array, keys: mx.array, values: mx.array,
                      first: mx.array) -> None:
        """Quantize the G-token blocks of keys, values [B, H_kv, L, D] that start at
        tokens ``first`` (row * L + position) into ``layer``'s blocks ``ids``
        (`dispatch.write_blocks`); an in-place launch waits in ``_unrun_writes``."""
        idx = ids if isinstance(ids, mx.array) else mx.array(ids, dtype=mx.int32)
        done = write_blocks(self.pools[layer], keys, values, first, idx, bits=self.config.bits,
                            group_size=self.config.group_size, use_kernel=self.use_kernel)
        if done is not None:
            self._unrun_writes.append((layer, done))

    def pending(self) -> list:
        """What a forward's caller evaluates so that the pools hold all it wrote: the
        pools (their scatters) and the in-place block writes (`dispatch.write_blocks`),
        which no graph node reads."""
        writes, self._unrun_writes = self._unrun_writes, []
        return [self.pools, [done for _, done in writes]]

    def layer_writes(self, layer: int) -> list[mx.array]:
        """What holds ``layer``'s writes of the forward being built: its pool arrays
        (their scatters) and its in-place block writes. A forward whose next layer
        depends on them (``mx.depends``) runs them as it goes: left for the end, each
        would keep its layer's keys and values alive through the whole forward (a
        prefill step's peak memory 2.5x the bare model's on the CPU machine)."""
        return [*self.pools[layer], *(done for at, done in self._unrun_writes if at == layer)]

    def _run_writes(self, layer: int | None = None) -> None:
        """Run the in-place block writes (of ``layer``, or all) that nobody evaluated
        yet, before a read of those blocks. The engine's runner evaluates them with
        each forward, so in the engine this finds none: a later chunk reads a layer
        before it writes it. It costs a sync only for a caller that drives the store
        itself."""
        run = [done for at, done in self._unrun_writes if layer is None or at == layer]
        if run:
            mx.eval(run)
            self._unrun_writes = [(at, d) for at, d in self._unrun_writes if layer is not None and at != layer]

    @contextlib.contextmanager
    def forward_writes(self):
        """Around building a forward that writes the pools: if it fails, its in-place
        block writes are dropped unrun (their blocks are released, and run later they
        could land after a new owner's)."""
        try:
            yield
        except BaseException:
            self._unrun_writes = []
            raise

    def append(self, layer: int, seq: SequenceKV, k: mx.array, v: mx.array, reads: tuple = ()) -> None:
        """Commit new tokens k, v [H_kv, L, D] of one sequence to ``layer``.

        Applies the flush rule: while the tail would hold R + k*G or more
        tokens, its oldest k*G become k quantized blocks. A long prompt is thus
        quantized at once, leaving R .. R + k*G - 1 tokens in the tail.

        ``reads``: arrays built from this layer's pool (a later chunk's attention
        over its past). Where blocks are written by scatters they are evaluated
        first, so no pending read keeps a scatter from updating the pool in place
        (MLX would copy the whole pool). With in-place block writes nothing waits:
        the new blocks are not the ones read, and a tail scatter behind a pending
        read copies only this layer's tails (tens of microseconds on a GPU, where a
        host sync per layer cost the device its queue).
        """
        g = self.config.group_size
        pool = self.pools[layer]
        t_old, n_new = seq.tail_lens[layer], k.shape[1]
        total = t_old + n_new
        n_flush = self.blocks.blocks_needed(total)  # the tail's tokens follow the same rule
        if reads and not self._blocks_in_place:
            mx.eval(*reads)
        if n_flush == 0:
            pool.tail_k[seq.slot, :, t_old:total] = k.astype(pool.tail_k.dtype)
            pool.tail_v[seq.slot, :, t_old:total] = v.astype(pool.tail_v.dtype)
            seq.tail_lens[layer] = total
            return
        # all: [H_kv, T, D] -- old tail then new tokens.
        all_k = mx.concatenate([pool.tail_k[seq.slot, :, :t_old], k.astype(pool.tail_k.dtype)], axis=1)
        all_v = mx.concatenate([pool.tail_v[seq.slot, :, :t_old], v.astype(pool.tail_v.dtype)], axis=1)
        if not self._blocks_in_place:
            mx.eval(all_k, all_v)
        first = seq.blocks_used[layer]
        ids = [self.blocks.block(seq, first + i) for i in range(n_flush)]
        cut = n_flush * g
        self._write_blocks(layer, ids, all_k[None], all_v[None], mx.arange(0, cut, g, dtype=mx.int32))
        pool.tail_k[seq.slot, :, : total - cut] = all_k[:, cut:]
        pool.tail_v[seq.slot, :, : total - cut] = all_v[:, cut:]
        seq.blocks_used[layer] = first + n_flush
        seq.tail_lens[layer] = total - cut

    def begin_prefill(self, seqs: list[SequenceKV], lengths: list[int], starts: list[int]) -> PrefillBatch:
        """Prepare one forward over the first chunks of new sequences (``lengths``
        tokens each, chunk i's tokens at ``starts[i]`` onwards among the forward's
        token-major rows): blocks are allocated, the write indices of every layer
        built once, and the sequences' bookkeeping advanced to the chunk's end
        (``write_prefill`` then writes each layer).

        Prefill this way needs no host sync inside the forward: nothing reads
        the pools (a first chunk attends to itself), so every write is a scatter
        that updates its pool in place.
        """
        g, n_layers = self.config.group_size, self.num_layers
        if any(s.offset(0, g) for s in seqs):
            raise ValueError("begin_prefill takes first chunks of new sequences")
        block_first, block_ids, tail_src, tail_slot, tail_pos = [], [], [], [], []
        for seq, n, base in zip(seqs, lengths, starts):
            nb = self.blocks.blocks_needed(n)
            block_ids += [self.blocks.block(seq, j) for j in range(nb)]
            block_first += range(base, base + nb * g, g)
            tail_src += range(base + nb * g, base + n)
            tail_slot += [seq.slot] * (n - nb * g)
            tail_pos += range(n - nb * g)
            seq.tail_lens, seq.blocks_used = [n - nb * g] * n_layers, [nb] * n_layers

        def ints(values, column=False):
            if not values:
                return None
            a = mx.array(values, dtype=mx.int32)
            return a[:, None] if column else a

        return PrefillBatch(seqs, list(lengths), list(starts), ints(block_first), ints(block_ids), ints(tail_src),
                            ints(tail_slot, True), ints(tail_pos, True))

    def write_prefill(self, layer: int, batch: PrefillBatch, k: mx.array, v: mx.array) -> None:
        """Commit one layer's keys and values of a prefill forward, k, v
        [B, H_kv, L, D] (token b * L + l at [b, :, l]), by ``batch``'s indices: all
        new blocks in one write (`_write_blocks`), one scatter per tail."""
        pool = self.pools[layer]
        h, d = k.shape[1], k.shape[3]
        if batch.block_ids is not None:
            self._write_blocks(layer, batch.block_ids, k, v, batch.block_first)
        # Token-major rows [B * L, H_kv, D], so a token is one index.
        k_rows = mx.swapaxes(k, 1, 2).reshape(-1, h, d)
        v_rows = mx.swapaxes(v, 1, 2).reshape(-1, h, d)
        if batch.tail_src is not None:
            heads = mx.arange(h, dtype=mx.int32)[None]
            index = (batch.tail_slot, heads, batch.tail_pos)
            pool.tail_k[index] = _as(k_rows[batch.tail_src], pool.tail_k.dtype)
            pool.tail_v[index] = _as(v_rows[batch.tail_src], pool.tail_v.dtype)

    def begin_decode(self, seqs: list[SequenceKV], layer: int | None = None) -> DecodeBatch:
        """Prepare a decode step that commits one new token per sequence.

        Applies the flush rule first: a tail about to reach R + k*G tokens has
        its oldest k*G quantized into k new blocks before the step's attention, in
        every layer at once. Where the attention kernel writes the tails (CUDA),
        the flush is ops of the step's own graph, made with its first attention
        plan (``DecodeBatch.flush``, ``dispatch.step_flush``): no evaluation of
        its own, and a compiled step replays it. Elsewhere it runs here, before
        the step's graph (one host sync; flushing after the write would sync
        inside the forward, once per layer). The pools end the step exactly as
        with a flush after the write: the same k*G tokens are quantized and the
        tail is shifted the same way. The sequences' bookkeeping is advanced
        here, for the token the step will write.

        Args:
            seqs: the batch; with ``layer=None`` every layer of each must hold
                the same tokens (so they do between forwards).
            layer: prepare only this layer (the batch then serves it alone).

        Returns:
            The step's DecodeBatch, for ``write_and_attend``.
        """
        g, r, kb = self.config.group_size, self.config.residual, self.config.flush_blocks
        n = self.num_layers
        self._run_writes()
        first = 0 if layer is None else layer
        before = [(s.tail_lens[first], s.blocks_used[first]) for s in seqs]
        if layer is None:
            for s, (t, nb) in zip(seqs, before):
                if s.tail_lens.count(t) != n or s.blocks_used.count(nb) != n:
                    raise RuntimeError("a batched decode step needs every layer of a sequence to hold the same tokens")
        full = [i for i, (t, _) in enumerate(before) if t == r + kb * g - 1]
        # Every step of a batch flushes in its graph once the kernel writes the tails
        # (the flush's shape is the batch's, whoever flushes: one compiled trace).
        in_graph = layer is None and self._kernel_writes_tails and self._step_flush_params is not None
        ids = [self.blocks.block(seqs[i], before[i][1] + j) for i in full for j in range(kb)]
        if full and not in_graph:
            pools = self.pools if layer is None else [self.pools[layer]]
            flush_layers(pools, [seqs[i].slot for i in full], ids, [r + kb * g - 1] * len(full),
                         bits=self.config.bits, group_size=g, blocks_per_slot=kb, use_kernel=self.use_kernel)
        tails, blocks = [t + 1 for t, _ in before], [nb for _, nb in before]
        for i in full:
            tails[i], blocks[i] = r, blocks[i] + kb
        for s, t, nb in zip(seqs, tails, blocks):
            if layer is None:
                s.tail_lens, s.blocks_used = [t] * n, [nb] * n
            else:
                s.tail_lens[layer], s.blocks_used[layer] = t, nb
        offsets = [nb * g + t for t, nb in before]
        # The step's ints in one host array, so the GPU migrates one managed
        # allocation per step instead of one per array (~250 us of device time
        # each, measured on an H200); the arrays are views of it.
        b = len(seqs)
        tables = self.blocks.block_tables(seqs, blocks, self.table_width_multiple)
        parts = [np.array([[s.slot for s in seqs], [t - 1 for t in tails], blocks, tails, offsets],
                          dtype=np.int32).ravel(), tables.ravel()]
        if in_graph:  # the flush's slots (-1 past the flushing ones), new blocks and params
            flush = np.full(b + b * kb, -1, dtype=np.int32)
            flush[:len(full)] = [seqs[i].slot for i in full]
            flush[b:b + len(ids)] = ids
            parts += [flush, np.array([*self._step_flush_params, b], dtype=np.int32)]
        packed = mx.array(np.concatenate(parts))
        slots, write_pos, num_blocks, tail_lens, offsets_d = (packed[i * b:(i + 1) * b] for i in range(5))
        at, end = 5 * b + tables.size, 5 * b + tables.size + b * (1 + kb)  # the tables end; the flush's ids end
        step_flush_meta = (packed[at:at + b], packed[at + b:end], packed[end:]) if in_graph else None
        shape = (b, self.pools[0].tail_k.shape[1], 1)
        write_index = (mx.broadcast_to(slots[:, None, None], shape),
                       mx.broadcast_to(mx.arange(shape[1], dtype=mx.int32)[None, :, None], shape),
                       mx.broadcast_to(write_pos[:, None, None], shape))
        return DecodeBatch(
            seqs,
            slots=slots,
            block_tables=packed[5 * b:at].reshape(tables.shape),
            num_blocks=num_blocks,
            tail_lens=tail_lens,
            offsets=offsets[0] if b == 1 else offsets_d,
            write_index=write_index,
            flush=step_flush_meta,
        )

    @contextlib.contextmanager
    def using_pools(self, pools: list[KiviPool]):
        """Run the per-layer decode methods (``write_decode``, ``write_and_attend``)
        on stand-in pools: ``mx.compile``'s traced arrays (engine.compiled_decode)."""
        saved, self.pools = self.pools, pools
        try:
            yield
        finally:
            self.pools = saved

    def write_decode(self, layer: int, batch: DecodeBatch, k: mx.array, v: mx.array) -> None:
        """Write the step's new tokens k, v [B, H_kv, 1, D] (the model's layout; or
        [B, H_kv, D]) into ``layer``'s tails."""
        pool = self.pools[layer]
        if k.ndim == 3:
            k, v = k[:, :, None], v[:, :, None]
        pool.tail_k[batch.write_index] = _as(k, pool.tail_k.dtype)
        pool.tail_v[batch.write_index] = _as(v, pool.tail_v.dtype)

    # ---- reads -----------------------------------------------------------

    def write_and_attend(self, layer: int, batch: DecodeBatch, q: mx.array, k: mx.array, v: mx.array,
                         scale: float) -> mx.array:
        """``write_decode`` then the step's attention, for one layer of a step. Where the
        attention kernel writes the tails itself (CUDA: ``dispatch.writes_tail``), the
        new tokens go with its launch and no scatter is built (two graph nodes per
        layer and step, and no in-place condition to keep).

        Args:
            q: [B, H_q, 1, D] (or [B, H_q, D]); k, v: [B, H_kv, 1, D] (or [B, H_kv, D]),
                in the pools' basis (``rotation`` applied).

        Returns:
            q's shape, in the model's basis: a rotated store's output rotated back.
        """
        plan, self._kernel_writes_tails = self._plan(layer, batch, q, scale)
        pool = self.pools[layer]
        if self._kernel_writes_tails:
            return plan(q, pool, _as(k, pool.tail_k.dtype), _as(v, pool.tail_v.dtype))
        self.write_decode(layer, batch, k, v)
        return plan(q, pool)

    def prologue_and_attend(self, layer: int, batch: DecodeBatch, qkv: mx.array, offsets: mx.array,
                            prologue: Prologue, q_norm: mx.array | None, k_norm: mx.array | None,
                            scale: float) -> mx.array:
        """``write_and_attend`` of the q, k and v that ``prologue`` makes from the layer's
        fused q/k/v projection row [B, 1, (H_q + 2 H_kv) D] (norms ``q_norm``, ``k_norm``;
        RoPE at ``offsets`` [B] int32): on CUDA all in the split kernel's launch
        (``dispatch.prologue_plan``), elsewhere with ``Prologue.reference``; the same
        bits. Returns [B, H_q, 1, D] in the model's basis."""
        b, d = qkv.shape[0], self.pools[layer].tail_k.shape[-1]
        key = ("prologue", b, qkv.dtype, scale, prologue)
        plan = batch.plans.get(key, False)
        if plan is False:
            plan = batch.plans[key] = prologue_plan(
                (b, prologue.n_heads, 1, d), qkv.dtype, self.pools[layer], batch.block_tables,
                batch.num_blocks, batch.slots, batch.tail_lens, scale=scale, bits=self.config.bits,
                group_size=self.config.group_size, prologue=prologue, use_kernel=self.use_kernel,
                rotate_out=self.config.rotate, after=self._step_flush(batch))
        if plan is not None:
            self._kernel_writes_tails = True
            return plan.with_prologue(qkv, self.pools[layer], offsets, q_norm, k_norm)
        q, k, v = prologue.reference(qkv, offsets, q_norm, k_norm)
        return self.write_and_attend(layer, batch, q, k, v, scale)

    def _plan(self, layer: int, batch: DecodeBatch, q: mx.array, scale: float):
        """(the step's attention launch plan, whether it writes the tails): made by the
        first layer, shared by the rest."""
        key = (q.shape, q.dtype, scale)
        made = batch.plans.get(key)
        if made is None:
            plan = attend_plan(
                q.shape, q.dtype, self.pools[layer], batch.block_tables, batch.num_blocks, batch.slots,
                batch.tail_lens, scale=scale, bits=self.config.bits, group_size=self.config.group_size,
                use_kernel=self.use_kernel, rotate_out=self.config.rotate, after=self._step_flush(batch))
            made = batch.plans[key] = (plan, writes_tail(plan))
        return made

    def _step_flush(self, batch: DecodeBatch) -> list[mx.array]:
        """The step's flush as ops of its graph (``DecodeBatch.flush``), made once, with
        the step's first attention plan, over the pools the forward uses (a compiled
        step's stand-ins): what the plans' launches must follow. [] where the flush ran
        before the step."""
        if batch.flush is None:
            return []
        done = batch.plans.get("flush")
        if done is None:
            done = batch.plans["flush"] = step_flush(self.pools, *batch.flush, bits=self.config.bits,
                                                     group_size=self.config.group_size, use_kernel=self.use_kernel)
        return done

    def dense_past(self, layer: int, seq: SequenceKV) -> tuple[mx.array, mx.array]:
        """The sequence's committed K and V in ``layer`` as [H_kv, S, D] (blocks
        dequantized, then the tail), for prefill attention."""
        self._run_writes(layer)
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


def _as(x: mx.array, dtype: mx.Dtype) -> mx.array:
    """x in ``dtype``, without a graph node when it already is."""
    return x if x.dtype == dtype else x.astype(dtype)
