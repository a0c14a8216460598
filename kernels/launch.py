"""Launch planning shared by the CUDA and Metal kernels: what the kernels support,
the split-K plan, the launch geometry and the small constant inputs.

Decode attention is occupancy-bound at small batch, so each (sequence, kv head) is
cut into splits of whole warp steps (split-K); each split emits (max, sum, partial
output) and a merge combines them, the fp16 tail being more splits of TAIL_ROWS rows.
The number of splits comes from the SHAPE only (B, H_kv, max blocks; `split_plan`)
and, with every length, travels as data (`params`) or in the launch grid; templates
hold only compile-time constants (dtypes, D, G, bits, rep), so a growing sequence
never recompiles a kernel.
"""

from __future__ import annotations

import functools

import mlx.core as mx

from kiviq.kernels.cuda_device import num_sms
from kiviq.kernels.layout import KiviPool, check_layout

LOG2E = 1.4426950408889634
WARPS = 4  # warps per thread block of the split kernels
STEP_TOKENS = 256  # tokens per warp step of the CUDA-core split kernel (8 per lane)
# The MMA kernel works block by block, so a split may be one block: at B = 1 and 4k
# tokens 124 one-block splits per head spread over the GPU, where 4-block splits left
# 2 warps per SM each walking 4 blocks in sequence (the merge reads splits in parallel).
MMA_STEP_TOKENS = 32
# Splits are sized so the grid holds about this many warps per SM (several waves of
# short units; the hardware scheduler balances ragged batches).
UNITS_PER_SM = 48
# Splits shorter than this many blocks spend much of their time on a split's fixed
# cost (q loaded, partials written and merged): small batches get the wave plan
# instead (H200: B = 1-32 at 4k-32k tokens 8-33% faster; where the occupancy plan's
# splits are >= 8 blocks, the wave plan's longer ones were 0-18% slower).
MIN_SPLIT_BLOCKS = 8
# Thread blocks per SM the MMA split kernel is compiled for (`__launch_bounds__`), per
# (pool dtype, bits); the rest compile without bounds. fp16 2-bit runs 4 blocks either way
# (128 registers), but the bounded schedule (127) took 2-3% less device time (H200). Capping
# the others at 4 blocks (126-128 registers instead of 150-162, 16 warps per SM instead of
# 12) made none faster (bf16 5-8% slower), 5 or 6 blocks (spills) 10-60% slower: the
# kernel waits on dependent instructions within a warp, which more warps per SM do not
# hide (docs/performance.md, "Launch bounds").
MMA_BLOCKS_PER_SM = {(mx.float16, 2): 4}
RESIDENT_WARPS = 12  # warps per SM the wave plan counts on (3 blocks at ~150-162 registers)
SPLIT_COST_STEPS = 1.5  # a split's fixed cost, in warp steps (the wave plan's model)
MAX_SPLITS = 1024  # quantized splits + the tail's, per (sequence, kv head)
# The tail (R + G - 1 rows at most) is cut into splits of this many rows, one warp each
# (KIVI_TAIL_ROWS in the source): one warp for all of it was the critical path at B = 1.
TAIL_ROWS = 32
MAX_TAIL_SPLITS = 16  # R + G <= 512
MAX_REP = 8  # query heads per kv head handled by one warp (register budget)
HEAD_DIMS = (32, 64, 128, 256)
POOL_DTYPES = (mx.float16, mx.bfloat16)
Q_DTYPES = (mx.float16, mx.bfloat16, mx.float32)
POOL_NAMES = ("k_codes", "k_scales", "k_zeros", "v_codes", "v_scales", "v_zeros", "tail_k", "tail_v")


def split_plan(batch: int, kv_heads: int, max_blocks: int, group_size: int,
               sms: int | None = None, step_tokens: int = STEP_TOKENS,
               warps: int = WARPS) -> tuple[int, int]:
    """Split-K plan from the shape alone: (quantized splits S, blocks per split).

    A warp step covers `step_tokens` tokens (256 for the CUDA-core kernel, one block
    for the MMA kernel), so splits are whole steps. Enough splits that
    B * H_kv * S warps give every SM several waves even at B = 1 (`_occupancy_plan`);
    where that makes splits shorter than MIN_SPLIT_BLOCKS (small batches), fewer,
    longer splits packed into whole waves instead (`_wave_plan`). The tail is one
    more split, not counted here. Where there are at least `warps` steps the count is
    a multiple of `warps` (the warps of a thread block, one split each), so the last
    few splits may be empty.

    Args:
        sms: streaming multiprocessors to fill; None reads the device's
            (`kernels.cuda_device.num_sms`).
    """
    step_blocks = max(1, step_tokens // group_size)
    steps = -(-max_blocks // step_blocks)
    if steps == 0:
        return 0, step_blocks
    sms = sms or num_sms()
    splits, per = _occupancy_plan(batch * kv_heads, steps, sms, warps)
    if per * step_blocks < MIN_SPLIT_BLOCKS and steps >= warps:
        splits, per = _wave_plan(batch * kv_heads, steps, sms, warps)
    return splits, per * step_blocks


def _occupancy_plan(pairs: int, steps: int, sms: int, warps: int) -> tuple[int, int]:
    """(splits, steps per split): about UNITS_PER_SM warps per SM, never more splits
    than steps, whole thread blocks of splits."""
    want = max(1, -(-sms * UNITS_PER_SM // pairs))
    want = min(want, MAX_SPLITS - MAX_TAIL_SPLITS)  # the merge keeps a weight per split in smem
    per = -(-steps // min(steps, want))
    splits = -(-steps // per)
    if steps >= warps:
        # Whole thread blocks of quantized splits: the tail's short splits then never
        # share a block with a long one (a block holds its SM slot until its slowest
        # warp ends).
        splits = -(-splits // warps) * warps
        per = -(-steps // splits)
    return splits, per


@functools.lru_cache(maxsize=1024)  # a search of up to ~250 counts (65 us): once per shape, not per step
def _wave_plan(pairs: int, steps: int, sms: int, warps: int) -> tuple[int, int]:
    """(splits, steps per split) whose thread blocks finish soonest if RESIDENT_WARPS
    warps per SM run at once: waves x (steps per split + SPLIT_COST_STEPS), ties to
    fewer splits (a smaller merge). Split counts are multiples of `warps`."""
    slots = sms * max(1, RESIDENT_WARPS // warps)  # thread blocks at once
    top = min(-(-steps // warps) * warps, MAX_SPLITS - MAX_TAIL_SPLITS)
    best = None
    for splits in range(warps, top + 1, warps):
        per = -(-steps // splits)
        waves = -(-(pairs * splits // warps) // slots)
        cost = waves * (per + SPLIT_COST_STEPS)
        if best is None or cost < best[0]:
            best = (cost, splits, per)
    return best[1], best[2]


def supports(q_shape, q_dtype, pool: KiviPool, bits: int, group_size: int) -> str | None:
    """None when the attention kernels handle this call, else the reason they do not."""
    b, h_q, d = q_shape
    h_kv = pool.tail_k.shape[1]
    if d not in HEAD_DIMS or d % group_size:
        return f"head_dim {d} (kernel: {HEAD_DIMS}, multiple of G)"
    if h_q % h_kv or h_q // h_kv > MAX_REP:
        return f"H_q / H_kv = {h_q}/{h_kv} (kernel: integer ratio <= {MAX_REP})"
    if q_dtype not in Q_DTYPES or pool.k_scales.dtype not in POOL_DTYPES:
        return f"dtypes q={q_dtype} pool={pool.k_scales.dtype}"
    if pool.tail_k.dtype != pool.k_scales.dtype:
        return "tail and scale dtypes differ"
    if -(-pool.tail_k.shape[2] // TAIL_ROWS) > MAX_TAIL_SPLITS:
        return f"R + G = {pool.tail_k.shape[2]} (kernel: <= {TAIL_ROWS * MAX_TAIL_SPLITS})"
    try:
        check_layout(bits, group_size, d)
    except ValueError as e:
        return str(e)
    return None


def flush_supports(pool: KiviPool) -> str | None:
    """None when the flush kernels handle this pool, else the reason they do not."""
    d = pool.k_codes.shape[2]
    if d not in HEAD_DIMS:
        return f"head_dim {d} (flush kernel: {HEAD_DIMS})"
    if pool.k_scales.dtype not in POOL_DTYPES:
        return f"pool dtype {pool.k_scales.dtype} (flush kernel: {POOL_DTYPES})"
    if pool.tail_k.dtype != pool.k_scales.dtype:  # the kernels read tails as scale-dtype rows
        return f"tails of {pool.tail_k.dtype} beside {pool.k_scales.dtype} scales (flush kernel: the same dtype)"
    return None


_CONSTS: dict = {}
_CONST_VALUES: dict = {}  # id of a `const` array -> its values (no device read-back)


def const(values: tuple, dtype) -> mx.array:
    """A small constant array, made once per value: no per-call host array (an extra
    graph node and upload per call)."""
    key = (str(dtype), values)
    a = _CONSTS.get(key)
    if a is None:
        if len(_CONSTS) >= 1024:
            _CONSTS.clear()
            _CONST_VALUES.clear()
        a = _CONSTS[key] = mx.array(list(values), dtype=dtype)
        _CONST_VALUES[id(a)] = values
        mx.eval(a)
    return a


def const_values(a: mx.array) -> tuple:
    """The values a `const` array was made from."""
    return _CONST_VALUES[id(a)]


def packed_views(ints: list) -> list:
    """The int32 arrays `ints` as views (same shapes) of one array made on the device.

    MLX keeps host-made arrays in managed memory (and those of 8 bytes or less in one
    shared pool the host keeps writing); a kernel reading them pays for page
    migration on every launch (~23 us per split launch at B = 1). A concatenation is a
    GPU op, so its output is device memory, read from managed memory once per step
    instead of by every layer's launches.
    """
    packed = mx.concatenate([a.reshape(-1).astype(mx.int32) for a in ints])
    views, at = [], 0
    for a in ints:
        views.append(packed[at:at + a.size].reshape(a.shape))
        at += a.size
    return views


def attend_launch(q_shape, q_dtype, pool, block_tables, num_blocks, slots, tail_lens, *,
                  scale, bits, group_size, warps=WARPS, sms=None, step_tokens=STEP_TOKENS,
                  tail_rows: int | None = TAIL_ROWS):
    """Everything a split launch needs, from shapes and small int arrays.

    The tail is cut into splits of `tail_rows` rows (None: one split, the Metal
    kernel's way).

    Returns (meta, split kwargs, number of splits with the tail, rep): `meta` are the
    split kernel's inputs after q and the pool's arrays (block tables, num blocks,
    slots, tail lengths, `params`, the query scale; the merge reads `params` too);
    the kwargs lack `inputs` and `template`.
    """
    b, h_q, d = q_shape
    h_kv, rg = pool.tail_k.shape[1], pool.tail_k.shape[2]
    reason = supports(q_shape, q_dtype, pool, bits, group_size)
    if reason:
        raise ValueError(f"kivi kernel does not support {reason}")
    rep = h_q // h_kv
    mb = block_tables.shape[1]
    nsplit, bps = split_plan(b, h_kv, mb, group_size, sms, step_tokens, warps)
    if mb == 0:  # no quantized blocks anywhere: a dummy column, never read
        block_tables = mx.zeros((b, 1), dtype=mx.int32)
    i32 = lambda a: a if a.dtype == mx.int32 else a.astype(mx.int32)  # noqa: E731
    tail_splits = -(-rg // tail_rows) if tail_rows else 1
    # params[5]: whether the call brings the new token (kernels.cuda_attend.AttendPlan)
    meta = [i32(block_tables), i32(num_blocks), i32(slots), i32(tail_lens),
            const((max(mb, 1), bps, nsplit, rg, tail_splits, 0), mx.int32),
            const((float(scale) * LOG2E,), mx.float32)]
    nsu = nsplit + tail_splits
    split = dict(
        grid=(-(-nsu // warps) * warps * 32, h_kv, b),
        threadgroup=(warps * 32, 1, 1),
        output_shapes=[(b, h_kv, nsu, rep, d), (b, h_kv, nsu, rep, 2)],
        output_dtypes=[mx.float32, mx.float32],
    )
    return meta, split, nsu, rep


def attend_templates(q_dtype, pool, *, bits, group_size, rep, warps=WARPS):
    """(split template, merge template): compile-time constants only."""
    d = pool.tail_k.shape[-1]
    return (
        [("T", q_dtype), ("SD", pool.k_scales.dtype), ("D", d), ("G", group_size),
         ("BITS", bits), ("REP", rep), ("NW", warps)],
        [("T", q_dtype), ("D", d), ("REP", rep), ("MAX_SPLITS", MAX_SPLITS)],
    )


def flush_template(pool: KiviPool, *, bits, group_size) -> list:
    """The compile-time constants of the flush kernels."""
    return [("SD", pool.k_scales.dtype), ("D", pool.tail_k.shape[-1]), ("G", group_size), ("BITS", bits)]
