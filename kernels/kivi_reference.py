"""KIVI decode attention and tail flush in plain mlx ops: the parity oracle.

Storage layout (full description in `kernels.layout`; kernels read exactly this):
    k_codes  uint8 [NB, H_kv, D, G // P]    per-channel key codes, P tokens per byte
    k_scales, k_zeros  [NB, H_kv, D]        fp16 | bf16
    v_codes  uint8 [NB, H_kv, G, D // P]    per-token value codes, P channels per byte
    v_scales, v_zeros  [NB, H_kv, D // G, G]  group-major
    tail_k, tail_v     [NS, H_kv, R + G, D] unquantized residual, by slot, oldest first
    P = 8 // b; code j of a byte at bits [j*b, j*b + b) (little-endian).
Quantization contract and error bound: `kernels.kivi_quant`.

Decode math (what a kernel mirrors; all float32):
    q_s = f32(q) * scale                         the softmax scale is applied to q once
    per split: m = max(q_s . k), l = sum exp(q_s . k - m), acc = sum exp(q_s . k - m) v
    splits: the sequence's quantized blocks (a kernel may cut them into several
    split-K chunks) and the tail; merged exactly:
        M = max_i m_i,  out = sum_i exp(m_i - M) acc_i / sum_i exp(m_i - M) l_i
    An empty split has m = -inf and contributes nothing. Output cast to q's dtype.
This reference dequantizes gathered blocks to float32 and masks positions past each
sequence's length; a kernel reads only real positions, never masks. It works like a
split-K kernel: table columns in chunks of CHUNK_BLOCKS blocks, each chunk one split,
rows in groups, so it holds float32 K and V for at most about CHUNK_BLOCKS blocks at
once (CHUNK_BLOCKS * G * H_kv * D * 8 bytes), not for the whole cache.

Measured notes (mlx 0.32.4, CPU and CUDA on one H200):
  * Quantization gives bit-identical codes, scales and zeros on CPU and CUDA.
  * On CUDA, float32 matmuls run as TF32 unless MLX_ENABLE_TF32=0 (outputs 3e-4 off).
    For parity at float32 precision run the oracle with MLX_ENABLE_TF32=0 or under
    `mx.stream(mx.cpu)`.
  * A slice/scatter update of a pool array is in place only while no unevaluated
    op still reads it: "write token, then attend" in one graph stays in place; an
    attention left lazy and then a write copies the whole array (CPU and CUDA).
"""

from __future__ import annotations

import mlx.core as mx

from kiviq.kernels.kivi_quant import (
    dequantize_groups,
    dequantize_value_blocks,
    plain_key_codes,
    quantize_key_blocks,
    quantize_value_blocks,
    unpack,
)
from kiviq.kernels.layout import KiviPool, check_layout

_NEG_INF = float("-inf")


def _split_stats(
    qh: mx.array, kt: mx.array, v: mx.array, valid: mx.array
) -> tuple[mx.array, mx.array, mx.array]:
    """(max, sum-of-exp, unnormalised output) of one split, masked by `valid`.

    Shapes:
        qh [B, H_kv, rep, D]; kt [B, H_kv, D, S], v [B, H_kv, S, D] (float32, v zero
        wherever not valid); valid [B, S] bool
        -> m, l [B, H_kv, rep, 1], acc [B, H_kv, rep, D].
    """
    s = mx.where(valid[:, None, None, :], qh @ kt, _NEG_INF)
    m = mx.max(s, axis=-1, keepdims=True)
    # An empty split (m = -inf) must give p = 0, not exp(-inf + inf) = NaN.
    p = mx.exp(s - mx.where(m == _NEG_INF, 0.0, m))
    return m, mx.sum(p, axis=-1, keepdims=True), p @ v


# Most quantized blocks one piece of the reference dequantizes at once, summed over
# the sequences of a row group (see `decode_attention`). Module level, not an
# argument, so the signature stays the kernels'; a benchmark may change it.
CHUNK_BLOCKS = 64


def _block_split(
    qh: mx.array, pool: KiviPool, block_tables: mx.array, num_blocks: mx.array,
    c0: int, c1: int, *, bits: int, group_size: int,
) -> tuple[mx.array, mx.array, mx.array]:
    """(m, l, acc) of the quantized blocks in table columns [c0, c1): one split-K chunk.

    Shapes: qh [B, H_kv, rep, D]; block_tables [B, >= c1]; num_blocks [B].
    Holds float32 K and V for B * (c1 - c0) blocks only.
    """
    b, h_kv, _, d = qh.shape
    n, g = c1 - c0, group_size
    # used: [B, n]. Garbage table entries read block 0 with zeroed scales and zeros,
    # so they dequantize to exact zeros whatever block 0 holds.
    used = mx.arange(c0, c1)[None, :] < num_blocks[:, None]
    ids = mx.where(used, block_tables[:, c0:c1].astype(mx.int32), 0).reshape(-1)

    def params(arr: mx.array, perm: tuple[int, ...]) -> mx.array:
        x = arr[ids].reshape(b, n, *arr.shape[1:])
        x = mx.where(used.reshape(b, n, *(1,) * (x.ndim - 2)), x, 0)
        return mx.transpose(x, perm)

    # Transposing the packed bytes (not the float32 result) puts the tokens of
    # each (sequence, kv head) in order: one matmul per head, no float transposes.
    # kt: [B, H_kv, D, n, G] -> [B, H_kv, D, n * G] (tiles in plain order first)
    kc = mx.transpose(plain_key_codes(pool.k_codes[ids], bits).reshape(b, n, h_kv, d, -1), (0, 2, 3, 1, 4))
    k_perm = (0, 2, 3, 1)
    kt = dequantize_groups(
        unpack(kc, bits), params(pool.k_scales, k_perm), params(pool.k_zeros, k_perm)
    ).reshape(b, h_kv, d, n * g)
    # v: [B, H_kv, n, G, D] -> [B, H_kv, n * G, D]
    vc = mx.transpose(pool.v_codes[ids].reshape(b, n, h_kv, g, -1), (0, 2, 1, 3, 4))  # tiles kept whole
    v_perm = (0, 2, 1, 3, 4)
    v = dequantize_value_blocks(
        vc, params(pool.v_scales, v_perm), params(pool.v_zeros, v_perm), bits=bits
    ).reshape(b, h_kv, n * g, d)
    valid = mx.arange(c0 * g, c1 * g)[None, :] < (num_blocks * g)[:, None]
    return _split_stats(qh, kt, v, valid)


def _tail_split(
    qh: mx.array, pool: KiviPool, slots: mx.array, tail_lens: mx.array
) -> tuple[mx.array, mx.array, mx.array]:
    """(m, l, acc) of the fp16 tails of the sequences in ``slots``."""
    # tkt: [B, H_kv, D, R + G], tv: [B, H_kv, R + G, D].
    tkt = mx.swapaxes(pool.tail_k[slots].astype(mx.float32), -1, -2)
    t_valid = mx.arange(tkt.shape[-1])[None, :] < tail_lens.astype(mx.int32)[:, None]
    # Stale entries past tail_len must not reach 0 * x (NaN stays NaN).
    tv = mx.where(t_valid[:, None, :, None], pool.tail_v[slots].astype(mx.float32), 0.0)
    return _split_stats(qh, tkt, tv, t_valid)


def _merge(splits: list[tuple[mx.array, mx.array, mx.array]]) -> mx.array:
    """Exact log-sum-exp merge of (m, l, acc) splits -> normalised output."""
    m_all = splits[0][0]
    for m_i, _, _ in splits[1:]:
        m_all = mx.maximum(m_all, m_i)
    m_all = mx.where(m_all == _NEG_INF, 0.0, m_all)
    l_tot = mx.zeros_like(m_all)
    acc_tot = mx.zeros_like(splits[0][2])
    for m_i, l_i, acc_i in splits:
        w = mx.exp(m_i - m_all)
        l_tot = l_tot + w * l_i
        acc_tot = acc_tot + w * acc_i
    return acc_tot / mx.where(l_tot == 0, 1.0, l_tot)


def decode_attention(
    q: mx.array,
    pool: KiviPool,
    block_tables: mx.array,
    num_blocks: mx.array,
    slots: mx.array,
    tail_lens: mx.array,
    *,
    scale: float,
    bits: int,
    group_size: int = 32,
) -> mx.array:
    """One decode step of attention over KIVI-quantized blocks plus the tail.

    Args:
        q: [B, H_q, D], one query token per sequence, RoPE applied.
        pool: the layer's KiviPool.
        block_tables: int32 [B, max_blocks], pool block ids in token order; entries
            at index >= num_blocks[b] are ignored (may be garbage, even out of range).
        num_blocks: int32 [B], quantized blocks per sequence (may be 0).
        slots: int32 [B], tail slot per sequence.
        tail_lens: int32 [B], tail tokens including the current one (already
            written into the tail); 0 only when the sequence has blocks.
        scale: softmax scale, usually D ** -0.5.
        bits: b.
        group_size: G.

    Returns:
        [B, H_q, D] in q's dtype. A sequence with no tokens at all gets zeros.

    Memory: the work is cut like a split-K kernel's, so the float32 K and V held at
    once stay bounded whatever the sequences' lengths. Table columns are cut into
    chunks of ``CHUNK_BLOCKS`` (fixed boundaries 0, C, 2C, ..., independent of the
    batch), each a split; the tail is one more split; the splits are merged by the
    exact log-sum-exp above. Rows are taken in groups of at most
    ``CHUNK_BLOCKS // (blocks per chunk)`` sequences (the tail counts as
    ``(R + G) / G`` blocks), so one piece dequantizes at most about ``CHUNK_BLOCKS``
    blocks. A row's result does not depend on the other rows or their grouping.
    """
    b, h_q, d = q.shape
    h_kv = pool.tail_k.shape[1]
    check_layout(bits, group_size, d)
    if h_q % h_kv != 0:
        raise ValueError(f"H_q ({h_q}) must be a multiple of H_kv ({h_kv})")
    rep = h_q // h_kv
    # qh: [B, H_kv, rep, D]; query head h = kv * rep + r reads kv head h // rep.
    qh = (q.astype(mx.float32) * scale).reshape(b, h_kv, rep, d)
    num_blocks = num_blocks.astype(mx.int32)

    mb = block_tables.shape[1]
    chunk = max(1, CHUNK_BLOCKS)
    per_row = max(min(mb, chunk), -(-pool.tail_k.shape[2] // group_size))
    rows = max(1, chunk // per_row)
    outs = []
    for r0 in range(0, b, rows):
        r1 = min(b, r0 + rows)
        sel = slice(r0, r1) if (r0, r1) != (0, b) else slice(None)
        qg, nbg = qh[sel], num_blocks[sel]
        splits = [_block_split(qg, pool, block_tables[sel], nbg, c0, min(mb, c0 + chunk),
                               bits=bits, group_size=group_size)
                  for c0 in range(0, mb, chunk)]
        splits.append(_tail_split(qg, pool, slots[sel], tail_lens[sel]))
        outs.append(_merge(splits))
    out = outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=0)
    return out.reshape(b, h_q, d).astype(q.dtype)


def decode_attention_dense(
    q: mx.array, k: mx.array, v: mx.array, scale: float
) -> mx.array:
    """Plain softmax attention of one sequence's query token, in float32.

    Args:
        q: [H_q, D].
        k, v: [H_kv, S, D], S >= 1, any float dtype.
        scale: softmax scale.

    Returns:
        [H_q, D] in q's dtype.
    """
    h_q, d = q.shape
    h_kv = k.shape[0]
    # qh: [H_kv, rep, D]
    qh = (q.astype(mx.float32) * scale).reshape(h_kv, h_q // h_kv, d)
    s = qh @ mx.swapaxes(k.astype(mx.float32), -1, -2)
    p = mx.exp(s - mx.max(s, axis=-1, keepdims=True))
    p = p / mx.sum(p, axis=-1, keepdims=True)
    return (p @ v.astype(mx.float32)).reshape(h_q, d).astype(q.dtype)


def check_flush_args(pool: KiviPool, slots, new_block_ids, tail_lens, *, bits: int,
                     group_size: int, blocks_per_slot: int = 1) -> tuple[mx.array, mx.array] | None:
    """Validate a flush request (shared by the reference and the kernels).

    With ``blocks_per_slot`` = k, each slot flushes its oldest k*G tokens into k
    blocks: new_block_ids then holds k ids per slot, slot by slot.

    Returns:
        (slots, new_block_ids) as int32 arrays, or None when nothing flushes.

    Raises:
        ValueError: mismatched lengths, a tail shorter than k*G, repeated slots or
            block ids, or a pool built for another layout.
    """
    g, kb = group_size, blocks_per_slot
    _, _, d, row = pool.k_codes.shape
    check_layout(bits, g, d)
    if row * (8 // bits) != g:
        raise ValueError(f"pool was built for G={row * (8 // bits)}, not {g}")
    # Checked on host lists (a bad flush corrupts silently). The engine passes
    # lists: reading device arrays back would wait for every queued step.
    slot_list, id_list, lens = (_host_ints(x) for x in (slots, new_block_ids, tail_lens))
    f = len(slot_list)
    if f == 0:
        return None
    if len(id_list) != f * kb or len(lens) != f:
        raise ValueError(f"slots and tail_lens must have the same length, and new_block_ids "
                         f"{kb} per slot")
    if min(lens) < kb * g:
        raise ValueError(f"every flushed tail needs >= G={g} tokens per block it flushes "
                         f"({kb} blocks), got {lens}")
    if len(set(slot_list)) != f or len(set(id_list)) != f * kb:
        raise ValueError("slots and new_block_ids must not repeat")
    return mx.array(slot_list, dtype=mx.int32), mx.array(id_list, dtype=mx.int32)


def _host_ints(x) -> list[int]:
    """A list, tuple or array of ints as a Python list."""
    return x.tolist() if isinstance(x, mx.array) else [int(v) for v in x]



FLUSHED = ("k_codes", "k_scales", "k_zeros", "v_codes", "v_scales", "v_zeros")


def quantize_flushed(pool: KiviPool, rows_k: mx.array, rows_v: mx.array, *, bits: int,
                     group_size: int) -> tuple[mx.array, ...]:
    """The new blocks (arrays named by FLUSHED) from the oldest G rows of flushed tails.

    rows_k, rows_v: [F, H_kv, R + G, D], the flushing slots' tails.
    """
    g = group_size
    return (*quantize_key_blocks(rows_k[:, :, :g], bits=bits, scale_dtype=pool.k_scales.dtype),
            *quantize_value_blocks(rows_v[:, :, :g], bits=bits, scale_dtype=pool.v_scales.dtype))


def write_blocks(pool: KiviPool, keys: mx.array, values: mx.array, first: mx.array, ids: mx.array, *,
                 bits: int, group_size: int, quantize=quantize_flushed) -> None:
    """Quantize G-token blocks of a forward's keys and values into the pool.

    keys, values: [B, H_kv, L, D], the model's layout. Block n is row first[n] // L,
    positions first[n] % L .. + G - 1 (int32 [N]), written at pool block ids[n]: rows
    gathered, quantized (`quantize`: `quantize_flushed` or a kernel of its contract)
    and scattered, all lazy. The CUDA kernel of the same contract writes in place
    (`cuda_flush.write_blocks`).
    """
    b, h, length, d = keys.shape
    g, n = group_size, ids.shape[0]
    tokens = (first[:, None] + mx.arange(g, dtype=mx.int32)[None]).reshape(-1)

    def blocks(x: mx.array) -> mx.array:  # [N, H_kv, G, D] in the tails' dtype
        rows = mx.swapaxes(x, 1, 2).reshape(b * length, h, d)[tokens]
        return mx.swapaxes(rows.reshape(n, g, h, d), 1, 2).astype(pool.tail_k.dtype)

    for name, arr in zip(FLUSHED, quantize(pool, blocks(keys), blocks(values), bits=bits, group_size=g)):
        getattr(pool, name)[ids] = arr


def shifted_tail(rows: mx.array, group_size: int) -> mx.array:
    """Tail rows [F, H_kv, R + G, D] once their oldest G tokens left: shifted down,
    zeros at the end."""
    g = group_size
    return mx.concatenate([rows[:, :, g:], mx.zeros_like(rows[:, :, :g])], axis=2)


def write_flushed(pool: KiviPool, slots: mx.array, ids: mx.array, tail_k: mx.array,
                  tail_v: mx.array, quantized) -> None:
    """Scatter a flush into the pool: the new blocks at ``ids``, the shifted tails
    at ``slots`` (only those rows are rebuilt; the pool is written by scatter)."""
    for name, arr in zip(FLUSHED, quantized):
        getattr(pool, name)[ids] = arr
    pool.tail_k[slots] = tail_k
    pool.tail_v[slots] = tail_v

def flush_tails(
    pool: KiviPool,
    slots: mx.array,
    new_block_ids: mx.array,
    tail_lens: mx.array,
    *,
    bits: int,
    group_size: int = 32,
) -> KiviPool:
    """Quantize the oldest G tail tokens of some slots into new blocks; shift tails.

    Updates the pool's arrays in place through scatter assignment (`arr[idx] = val`,
    which MLX performs without copying when nothing else references the buffer):
    shapes never change, other slots and blocks are untouched. Tail positions at or
    past the new length (tail_len - G) are zero-filled.

    Args:
        pool: the layer's KiviPool (its arrays are mutated).
        slots: int32 [F], distinct slots to flush.
        new_block_ids: int32 [F], distinct free block ids receiving those tokens.
        tail_lens: int32 [F], PRE-flush tail lengths; each must be >= G.
        bits: b.
        group_size: G.

    Returns:
        The same pool object, for chaining.
    """
    g = group_size
    checked = check_flush_args(pool, slots, new_block_ids, tail_lens, bits=bits, group_size=g)
    if checked is None:
        return pool
    slots, ids = checked

    # rows: [F, H_kv, R + G, D]. Evaluated and released before any write (`finish`):
    # on the GPU a still pending read of a tail (this gather) keeps MLX from updating
    # it in place, and the scatter below would copy the whole tail array (measured on
    # CUDA).
    rows_k, rows_v = pool.tail_k[slots], pool.tail_v[slots]
    finish([rows_k, rows_v])
    quantized = quantize_flushed(pool, rows_k, rows_v, bits=bits, group_size=g)
    write_flushed(pool, slots, ids, shifted_tail(rows_k, g), shifted_tail(rows_v, g), quantized)
    return pool


def gather_flush_layers(pools: list[KiviPool], slots: mx.array, ids: mx.array, *, bits: int, group_size: int,
                        blocks_per_slot: int = 1, quantize=quantize_flushed) -> None:
    """`flush_tails` of the same slots into the same block ids of several pools (a
    model's layers), with k = blocks_per_slot blocks per slot, and one host sync for
    all of them: the flush path where no fused in-place kernel exists.

    Every read of the pools (the flushed tails' rows, gathered) is started at once
    (`mx.async_eval`), the writes (scatters) are built meanwhile and stay lazy: a
    scatter updates a pool in place only if, when it is evaluated (with the caller's
    next graph), no read of that buffer is pending on the device; MLX copies the whole
    array otherwise. So the device has released the pools' buffers when this returns
    (`finish`).

    Args:
        slots, ids: checked int32 arrays (`check_flush_args`).
        quantize: (pool, blocks_k, blocks_v, *, bits, group_size) -> the new blocks
            (`quantize_flushed`, or a kernel of the same contract).
    """
    g, kb = group_size, blocks_per_slot
    # rows: [F, H_kv, R + k*G, D] per pool and tail.
    rows = [(pool.tail_k[slots], pool.tail_v[slots]) for pool in pools]
    reads = [a for pair in rows for a in pair]
    mx.async_eval(reads)
    for pool, (rows_k, rows_v) in zip(pools, rows):
        # Each new block quantizes the first G rows of one entry: the slot's rows
        # themselves when k = 1, else its oldest k*G rows cut into k entries of G.
        blocks_k, blocks_v = (rows_k, rows_v) if kb == 1 else (_entries(rows_k, kb, g), _entries(rows_v, kb, g))
        quantized = quantize(pool, blocks_k, blocks_v, bits=bits, group_size=g)
        write_flushed(pool, slots, ids, shifted_tail(rows_k, kb * g), shifted_tail(rows_v, kb * g), quantized)
    finish(reads)


def finish(arrays: list[mx.array]) -> None:
    """Wait until ``arrays`` are computed and the device has released every buffer
    their kernels used, so that scatters into those buffers, evaluated after this,
    happen in place.

    `mx.eval` alone is not enough: the CUDA backend keeps a kernel's inputs alive
    until a completion handler runs on another thread, which can come after `eval`
    returns; `mx.synchronize` waits for the handlers too.
    """
    if arrays:
        mx.eval(arrays)
        mx.synchronize()


def _entries(rows: mx.array, k: int, g: int) -> mx.array:
    """[F, H_kv, T, D] tail rows -> [F * k, H_kv, G, D]: the oldest k*G rows as k
    blocks' worth of rows per slot, slot by slot (the order of new_block_ids)."""
    f, h, _, d = rows.shape
    return rows[:, :, : k * g].reshape(f, h, k, g, d).transpose(0, 2, 1, 3, 4).reshape(f * k, h, g, d)
