"""KIVI decode attention and tail flush as CUDA kernels (`mx.fast.cuda_kernel`).

Same signatures and semantics as `kernels.kivi_reference.decode_attention` and
`flush_tails`; storage layout in `kernels.layout`, quantization contract in
`kernels.kivi_quant`. The kernels are built once at import and are None where MLX has
no CUDA backend (`mx.cuda.is_available()` false); `kernels.dispatch` picks them.

Decode attention: two launches per layer for all sequences, one split kernel and the
merge. There are two split kernels with the same inputs, outputs, grid and merge:

  1a. `kivi_attend_split_mma` (the default wherever `mma_supports`: bits 2/4, G = 32,
     D 64/128, H_q / H_kv <= 8): tensor cores. One warp per (sequence b, kv head h,
     split s); a split is >= 1 block (MMA_STEP_TOKENS). The warp double-buffers its
     blocks in shared memory with cp.async (codes, scales, zeros of one (block, head)
     tile are contiguous), dequantizes K and V to the pool dtype in registers (the code
     is or-ed into the mantissa of a power of two whose ulp weighs 1 at the code's bit
     position, that constant subtracted, then one packed FMA with scale and zero:
     `kivi_deq4`) straight into m16n8k16 MMA fragments,
     float32 accumulation: scores = K_hat q^T (tokens x query heads, heads padded to 8),
     online softmax in base 2, out^T += V_hat^T p^T (channels x heads). See the comment
     above ATTEND_MMA_SOURCE for the fragment layouts. The fp16 tail splits run the
     CUDA-core tail code shared with 1b. The dequantization costs one LOP3 (and-or
     into a magic exponent placed so that no shift is needed where the code fits the
     mantissa), one subtract and one FMA per pair; shared addresses are per-lane bases
     plus constants. That cut ~1160 to ~910 instructions per (block, head) tile and
     178-213 to 128 registers as MLX compiles it (ncu; 16 warps per SM), 1.2-1.4x
     faster, bit-identical output. `KIVIQ_KIVI_MIN_BLOCKS=N` compiles it with
     launch bounds for N blocks per SM (see `bounded_declaration`).
     With fp16 pools it takes its FOLD path (`fold_applies`; the comment above
     ATTEND_MMA_SOURCE): scales folded into q and p, zeros in two small MMAs, a code
     pair one AND (an fp16 subnormal). ~23% fewer instructions per tile; on the H200
     1.09-1.15x faster than dequantizing at B >= 32 (docs/benchmarks.md, session 12).
  1b. `kivi_attend_split` (everything else: 8-bit, G != 32, D 32/256, or
     KIVIQ_KIVI_KERNEL=v1 for A/B runs): CUDA cores, float32 throughout. One warp per
     (b, h, split), 4 warps per thread block (they share (b, h) and stage its query rows
     once). Splits 0..S-1 cut the sequence's quantized blocks into chunks of `bps`
     blocks (split-K); splits S, S+1, ... are the fp16 tail in chunks of TAIL_ROWS (32)
     rows, one warp each (one warp walking up to R + G - 1 rows was the critical path
     of a B = 1 call). K phase: a warp step covers 256 tokens
     (256 / G blocks); lane = (block, 8-token segment), loops over the D channels
     reading b bytes of codes per channel (8 codes), dequantizes in registers and keeps
     8 x rep scores. Softmax: warp max per head, exp2 against the running max, p to
     shared memory. V phase: lane = (token offset, 8 channels); per token, b bytes of
     codes plus one scale/zero pair; acc[rep][8] stays in registers for the split.
  Both: every warp computes all H_q / H_kv query heads of its kv head, so the codes are
  read once per group, and writes (m, l, acc) per query head: running max and sum in
  log2 units, and the unnormalised output. Only real positions are read: block ids come
  from the table up to num_blocks, tail rows up to tail_len. No mask, no padding, no
  fp16 K/V in global memory.
  2. `kivi_attend_merge`: one thread block per (b, query head) of 1..16 warps (about 8
     splits per warp): exact log-sum-exp merge of the splits (weights computed once per
     block into shared memory; warps take splits in turn, each lane D / 32 channels;
     the warps' sums meet in shared memory), output cast to q's dtype.
A decode step builds the launches once for all layers (`AttendPlan`, via
`kernels.dispatch.attend_plan`); each layer then only launches.
The number of splits comes from the SHAPE only (B, H_kv, max blocks; `split_plan`)
and, with every length, travels as data (`params`) or in the launch grid; the
template holds only compile-time constants (dtypes, D, G, bits, rep), so a growing
sequence never recompiles anything.

Numerics (vs the float32 reference):
  * CUDA-core kernel: dequantization `q * scale + zero` is contracted to one FMA (the
    reference rounds twice: ~1 float32 ulp of x_hat), the softmax runs in base 2 with
    log2(e) folded into the query scale, and sums run in another order. Outputs agree
    to about 1e-6 relative before the final cast.
  * MMA kernel: K_hat and V_hat are rounded once to the pool dtype (what a
    dequantize-then-attend path stores; 2^-11 relative in fp16, 2^-8 in bf16), q is
    rounded to it for the dot products and p for the value sum; all sums float32.
    Against an oracle that rounds K, V and q alike it agrees to u * max|v| (p's
    rounding); tests/test_kernels_gpu.py states and checks both contracts. This is the
    design decision behind the speed: float32 CUDA-core math was the limit of 1b.
    Its FOLD path (fp16 pools) never rounds K_hat or V_hat; it rounds q * scale (per
    channel and block) and p * scale (per token and group) to fp16 instead, with the
    zeros' terms from the rounded q and p: within 3 u max|v| of exact for the values,
    and the scores exactly as tests/test_kernels_gpu.py's `oracle_fold` computes them.

Performance (H200, docs/benchmarks.md): see the kernel section there for the
measured table (MMA vs CUDA-core vs fp16 SDPA vs dequantize-then-SDPA).

Flush: `kivi_flush_quantize` quantizes the oldest G tail tokens of every flushing slot
in one launch (one thread per key channel AND per value group: both number
F * H_kv * D), bit-exact to `kernels.kivi_quant`: float32 subtract, correctly rounded
division (`__fsub_rn`, `__fdiv_rn`), `rintf` (half to even), zero and scale rounded to
the storage dtype first and codes computed from the stored values. The caller
scatters the small outputs into the pool and shifts the tails with mlx ops
(`kivi_flush`), in place as in the reference. `kivi_flush_fused` (what
`dispatch.flush_layers`, the engine's flush, runs on CUDA; KIVIQ_FLUSH_KERNEL=gather
selects the first kernel with mlx gathers and scatters for A/B runs; no Metal twin
yet, Metal runs the gather path) reads the tails through the flushing slots, handles
k blocks per slot, writes the new blocks and shifts the tails in place: a layer's
flush is one launch and no graph node besides (see the comment above
FLUSH_FUSED_SOURCE for the ordering that makes writing through an input safe).
Both share `kivi_flush_block`, so they quantize alike.
"""

from __future__ import annotations

import os

import mlx.core as mx

from kiviq.kernels.cuda_source import CUDA_TYPES, compact, kernel_header
from kiviq.kernels.kivi_reference import check_flush_args, shifted_tail, write_flushed
from kiviq.kernels.layout import KiviPool, check_layout

LOG2E = 1.4426950408889634
WARPS = 4  # warps per thread block of the split kernel
STEP_TOKENS = 256  # tokens per warp step (8 per lane)
# The MMA kernel works block by block, so a split may be one block: at B = 1 and 4k
# tokens 124 one-block splits per head spread over the GPU, where 4-block splits left
# 2 warps per SM each walking 4 blocks in sequence (the merge reads splits in parallel).
MMA_STEP_TOKENS = 32
# Splits are sized so the grid holds about this many warps per SM (several waves of
# short units; the hardware scheduler balances ragged batches).
UNITS_PER_SM = 48
MAX_SPLITS = 1024  # quantized splits + the tail's, per (sequence, kv head)
# The tail (R + G - 1 rows at most) is cut into splits of this many rows, one warp each
# (KIVI_TAIL_ROWS in the source): one warp for all of it was the critical path at B = 1.
TAIL_ROWS = 32
MAX_TAIL_SPLITS = 16  # R + G <= 512
MAX_REP = 8  # query heads per kv head handled by one warp (register budget)
HEAD_DIMS = (32, 64, 128, 256)
POOL_DTYPES = (mx.float16, mx.bfloat16)
Q_DTYPES = (mx.float16, mx.bfloat16, mx.float32)


def _cuda_available() -> bool:
    try:
        return bool(mx.cuda.is_available())
    except AttributeError:
        return False


def num_sms() -> int:
    """Streaming multiprocessors to fill: KIVIQ_NUM_SMS, else 132 (H100/H200)."""
    return int(os.environ.get("KIVIQ_NUM_SMS", "132"))


def split_plan(batch: int, kv_heads: int, max_blocks: int, group_size: int,
               sms: int | None = None, step_tokens: int = STEP_TOKENS) -> tuple[int, int]:
    """Split-K plan from the shape alone: (quantized splits S, blocks per split).

    A warp step covers `step_tokens` tokens (256 for the CUDA-core kernel, one block
    for the MMA kernel), so splits are whole steps. Enough splits that
    B * H_kv * S warps give every SM several waves even at B = 1; never more splits
    than steps. The tail is one more split, not counted here.
    """
    step_blocks = max(1, step_tokens // group_size)
    steps = -(-max_blocks // step_blocks)
    if steps == 0:
        return 0, step_blocks
    want = max(1, -(-(sms or num_sms()) * UNITS_PER_SM // (batch * kv_heads)))
    want = min(want, MAX_SPLITS - MAX_TAIL_SPLITS)  # the merge keeps a weight per split in smem
    steps_per_split = -(-steps // min(steps, want))
    return -(-steps // steps_per_split), steps_per_split * step_blocks


KERNEL_ENV = "KIVIQ_KIVI_KERNEL"  # "auto" (default): MMA where it applies; "v1": never
FOLD_ENV = "KIVIQ_KIVI_FOLD"  # "1" (default): fp16 pools take the MMA kernel's FOLD path


def fold_applies(pool: KiviPool) -> bool:
    """Whether the MMA kernel runs its FOLD path for this pool (see ATTEND_MMA_SOURCE):
    fp16 pools, unless KIVIQ_KIVI_FOLD=0 (the A/B arm: dequantize to fp16 in registers)."""
    value = os.environ.get(FOLD_ENV, "1").strip()
    if value not in ("0", "1"):
        raise ValueError(f"{FOLD_ENV} must be 1 or 0, got {value!r}")
    return value == "1" and pool.k_scales.dtype == mx.float16


def mma_supports(q_shape, pool: KiviPool, bits: int, group_size: int) -> str | None:
    """None when the tensor-core split kernel handles this call (on top of `supports`),
    else why not. It covers the common layouts; the CUDA-core kernel covers the rest."""
    d = q_shape[-1]
    if os.environ.get(KERNEL_ENV, "auto").lower() == "v1":
        return f"{KERNEL_ENV}=v1"
    if bits not in (2, 4) or group_size != 32 or d not in (64, 128):
        return f"bits={bits}, G={group_size}, D={d} (MMA kernel: bits 2/4, G=32, D 64/128)"
    return None


def supports(q_shape, q_dtype, pool: KiviPool, bits: int, group_size: int) -> str | None:
    """None when the kernels handle this call, else the reason they do not."""
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


# ----------------------------------------------------------------------------------
# CUDA source. Helpers live in the header (outside MLX's namespace, prefixed kivi_).

HEADER = r"""
#define KIVI_NEG_INF (__int_as_float(0xff800000))
#define KIVI_FULL 0xffffffffu

// Indices shared by both split kernels (grid: x = splits in groups of NW warps,
// y = kv head, z = sequence; params = [max blocks, blocks per split, quantized splits,
// R + G, tail splits]). Splits 0 .. nsplit-1 read quantized blocks; split nsplit + j
// reads tail rows j * KIVI_TAIL_ROWS .. + KIVI_TAIL_ROWS - 1.
#define KIVI_TAIL_ROWS 32
#define KIVI_SPLIT_INDICES                          \
  const int lane = threadIdx.x & 31;                \
  const int warp = threadIdx.x >> 5;                \
  const int h = blockIdx.y;                         \
  const int b = blockIdx.z;                         \
  const int H_kv = gridDim.y;                       \
  const int mbs = params[0];                        \
  const int bps = params[1];                        \
  const int nsplit = params[2];                     \
  const int RG = params[3];                         \
  const int nsu = nsplit + params[4];               \
  const int split = blockIdx.x * NW + warp;

// The tail chunk of split `split` (>= nsplit): rows row0 .. row0 + rows - 1 of slot
// slots[b]'s tail, and nr, the chunk's row holding this step's new token (-1 if none
// or if params[5] is 0: the token is already in the tail). With params[5] = 1 the
// tail's last row (tail_lens[b] - 1) is read from k_new / v_new [B, H_kv, D] and
// written into the tail by the one warp whose chunk holds it: the engine's decode
// step then needs no scatter per layer (two graph nodes) for its tail write.
#define KIVI_TAIL_CHUNK                                                           \
  const int tl_all = min(tail_lens[b], RG);                                       \
  const int row0 = (split - nsplit) * KIVI_TAIL_ROWS;                             \
  const int rows = max(0, min(tl_all - row0, KIVI_TAIL_ROWS));                    \
  const size_t base = (((size_t)slots[b] * H_kv + h) * RG + row0) * D;            \
  const int nr_at = tl_all - 1 - row0;                                            \
  const int nr = (params[5] != 0 && nr_at >= 0 && nr_at < rows) ? nr_at : -1;     \
  const size_t kv = ((size_t)b * H_kv + h) * D;

__device__ __forceinline__ float kivi_f(float x) { return x; }
__device__ __forceinline__ float kivi_f(__half x) { return __half2float(x); }
__device__ __forceinline__ float kivi_f(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T> __device__ __forceinline__ T kivi_from_f(float x);
template <> __device__ __forceinline__ float kivi_from_f<float>(float x) { return x; }
template <> __device__ __forceinline__ __half kivi_from_f<__half>(float x) {
  return __float2half_rn(x);
}
template <> __device__ __forceinline__ __nv_bfloat16 kivi_from_f<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

// 8 consecutive codes (BITS bytes, aligned to BITS bytes by the layout) as two words.
template <int BITS>
__device__ __forceinline__ void kivi_load8(const uint8_t* p, uint32_t& lo, uint32_t& hi) {
  if constexpr (BITS == 2) {
    lo = __ldg(reinterpret_cast<const unsigned short*>(p));
    hi = 0u;
  } else if constexpr (BITS == 4) {
    lo = __ldg(reinterpret_cast<const unsigned int*>(p));
    hi = 0u;
  } else {
    const uint2 w = __ldg(reinterpret_cast<const uint2*>(p));
    lo = w.x;
    hi = w.y;
  }
}

// Code j (0..7) of kivi_load8's words as an exact float, without an int->float
// conversion: the code's bits are or-ed into the mantissa of 2^(23-p) (p = its bit
// position, kept <= 23 - BITS by a 16-bit shift), then 2^(23-p) is subtracted.
template <int BITS>
__device__ __forceinline__ float kivi_code(uint32_t lo, uint32_t hi, int j) {
  const int wb = j * BITS;
  const int o = wb & 31;
  uint32_t w = (wb >= 32) ? hi : lo;
  const bool shift = o + BITS > 23;
  const int p = shift ? o - 16 : o;
  if (shift) w >>= 16;
  const uint32_t mask = ((1u << BITS) - 1u) << p;
  const uint32_t magic = uint32_t(150 - p) << 23;
  return __uint_as_float((w & mask) | magic) - __uint_as_float(magic);
}

// One fp16/bf16 value from its 16 bits (exact).
template <typename SD> __device__ __forceinline__ float kivi_bits_f(uint32_t bits);
template <> __device__ __forceinline__ float kivi_bits_f<__half>(uint32_t bits) {
  return __half2float(__ushort_as_half((unsigned short)bits));
}
template <> __device__ __forceinline__ float kivi_bits_f<__nv_bfloat16>(uint32_t bits) {
  return __uint_as_float(bits << 16);
}

// 8 fp16/bf16 values packed in 16 bytes, as floats.
template <typename SD>
__device__ __forceinline__ void kivi_unpack8f(const uint4 u, float* x) {
  const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    x[2 * k] = kivi_bits_f<SD>(w[k] & 0xffffu);
    x[2 * k + 1] = kivi_bits_f<SD>(w[k] >> 16);
  }
}

// 8 consecutive fp16/bf16 values (16 bytes, aligned) as floats.
template <typename SD>
__device__ __forceinline__ void kivi_load8f(const SD* p, float* x) {
  kivi_unpack8f<SD>(__ldg(reinterpret_cast<const uint4*>(p)), x);
}

__device__ __forceinline__ uint4 kivi_ld16(const void* p) {
  return __ldg(reinterpret_cast<const uint4*>(p));
}

__device__ __forceinline__ float kivi_warp_max(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(KIVI_FULL, x, o));
  return x;
}

__device__ __forceinline__ float kivi_warp_sum(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(KIVI_FULL, x, o);
  return x;
}

// The quantization contract of kernels.kivi_quant for one group, given its min/max.
template <typename SD, int BITS>
__device__ __forceinline__ void kivi_group_params(float mn, float mx, SD& zero, SD& scale,
                                                  float& zf, float& sf) {
  zero = kivi_from_f<SD>(mn);
  scale = kivi_from_f<SD>(__fdiv_rn(__fsub_rn(mx, mn), float((1 << BITS) - 1)));
  zf = kivi_f(zero);
  sf = kivi_f(scale);
}

template <int BITS>
__device__ __forceinline__ uint32_t kivi_quantize(float x, float zf, float sf) {
  if (sf == 0.0f) return 0u;
  float q = rintf(__fdiv_rn(__fsub_rn(x, zf), sf));
  q = fminf(fmaxf(q, 0.0f), float((1 << BITS) - 1));
  return uint32_t(q);
}

// One new block of one kv head, thread d of D: the key group of channel d (the G
// rows of rk) and the value group d (token d / NG, channel group d % NG of the rows
// of rv), written at output index fh (= new block * H_kv + kv head). Shared by both
// flush kernels, so they quantize alike by construction.
template <typename SD, int D, int G, int BITS>
__device__ __forceinline__ void kivi_flush_block(const SD* rk, const SD* rv, int fh, int d,
                                                 uint8_t* k_codes, SD* k_scales, SD* k_zeros,
                                                 uint8_t* v_codes, SD* v_scales, SD* v_zeros) {
  constexpr int P = 8 / BITS;
  constexpr int NG = D / G;
  constexpr int CPW = 32 / BITS;   // codes per 32-bit word
  constexpr int VW = G * (int)sizeof(SD) / 16;  // 16-byte words of one value group
  // Every load first (G key rows of channel d, one value group), then the math from
  // registers: walking the rows with each load feeding the next min/max kept one load
  // in flight per thread, ~89 us per layer at one flushing slot (session 8's trace).
  const int t = d / NG;  // the value group: token d / NG, channels (d % NG) * G .. + G
  const int gi = d % NG;
  SD xk[G];
  uint4 xv_raw[VW];
#pragma unroll
  for (int r = 0; r < G; ++r) xk[r] = rk[(size_t)r * D + d];
  const uint4* src_v = reinterpret_cast<const uint4*>(rv + (size_t)t * D + gi * G);
#pragma unroll
  for (int i = 0; i < VW; ++i) xv_raw[i] = src_v[i];
  const SD* xv = reinterpret_cast<const SD*>(xv_raw);
  {
    // Keys: channel d over the G oldest tokens.
    float mn = kivi_f(xk[0]), mx = mn;
#pragma unroll
    for (int r = 1; r < G; ++r) {
      const float v = kivi_f(xk[r]);
      mn = fminf(mn, v);
      mx = fmaxf(mx, v);
    }
    SD zero, scale;
    float zf, sf;
    kivi_group_params<SD, BITS>(mn, mx, zero, scale, zf, sf);
    uint32_t* dst = reinterpret_cast<uint32_t*>(k_codes + ((size_t)fh * D + d) * (G / P));
#pragma unroll
    for (int w = 0; w < G / CPW; ++w) {
      uint32_t word = 0u;
#pragma unroll
      for (int j = 0; j < CPW; ++j) word |= kivi_quantize<BITS>(kivi_f(xk[w * CPW + j]), zf, sf) << (j * BITS);
      dst[w] = word;
    }
    k_scales[(size_t)fh * D + d] = scale;
    k_zeros[(size_t)fh * D + d] = zero;
  }
  {
    // Values: token t, channels gi * G .. + G.
    float mn = kivi_f(xv[0]), mx = mn;
#pragma unroll
    for (int c = 1; c < G; ++c) {
      const float v = kivi_f(xv[c]);
      mn = fminf(mn, v);
      mx = fmaxf(mx, v);
    }
    SD zero, scale;
    float zf, sf;
    kivi_group_params<SD, BITS>(mn, mx, zero, scale, zf, sf);
    uint32_t* dst = reinterpret_cast<uint32_t*>(
        v_codes + ((size_t)fh * G + t) * (D / P) + gi * (G / P));
#pragma unroll
    for (int w = 0; w < G / CPW; ++w) {
      uint32_t word = 0u;
#pragma unroll
      for (int j = 0; j < CPW; ++j) word |= kivi_quantize<BITS>(kivi_f(xv[w * CPW + j]), zf, sf) << (j * BITS);
      dst[w] = word;
    }
    v_scales[(size_t)fh * D + d] = scale;
    v_zeros[(size_t)fh * D + d] = zero;
  }
}

// A tail of rg rows (channel d of it, this thread's) moved down by `from` rows in
// place, zeros after the kept rows. Rows go up in chunks of SR, a chunk's loads before
// its stores: with SR <= from a store only lands on rows this thread has already read,
// so one thread per channel needs no barrier, and SR loads per tail are in flight.
template <typename SD, int D, int SR>
__device__ __forceinline__ void kivi_shift_tails(SD* tk, SD* tv, int rg, int from, int d) {
  for (int i0 = 0; i0 < rg; i0 += SR) {
    SD ks[SR], vs[SR];
#pragma unroll
    for (int r = 0; r < SR; ++r) {
      const int i = i0 + r + from;
      ks[r] = i < rg ? tk[(size_t)i * D + d] : kivi_from_f<SD>(0.0f);
      vs[r] = i < rg ? tv[(size_t)i * D + d] : kivi_from_f<SD>(0.0f);
    }
#pragma unroll
    for (int r = 0; r < SR; ++r) {
      if (i0 + r < rg) {
        tk[(size_t)(i0 + r) * D + d] = ks[r];
        tv[(size_t)(i0 + r) * D + d] = vs[r];
      }
    }
  }
}

// Rows 0 .. tl-1 (tl <= 32) of an fp16/bf16 tail (tk / tv, rows of D) folded into a
// warp's running (m, l, acc): scores with lane = tail row, then lane = (token offset,
// 8 channels) for the values. pw: this warp's [REP][PS] floats. Loads are issued in
// batches of 4 x 16 bytes: one warp walking rows one dependent load at a time was the
// latency of a whole B = 1 call when the tail was one split (measured).
// nr >= 0: row nr of this chunk is the step's new token, read from kn / vn (the
// model's k and v) instead of the tail, and written into the tail here for the next
// steps (no other warp reads that row in this step: see KIVI_TAIL_CHUNK).
template <typename SD, int D, int REP, int PS>
__device__ __forceinline__ void kivi_tail_attend(const float* qs, float* pw, const SD* tk,
                                                 const SD* tv, int tl, int nr, const SD* kn,
                                                 const SD* vn, int lane,
                                                 float (&m)[REP], float (&l)[REP],
                                                 float (&acc)[REP][8]) {
  constexpr int LR = D / 8;
  constexpr int TPI = 32 / LR;
  constexpr int KB = (D / 8 < 4) ? D / 8 : 4;  // 16-byte loads in flight per lane
  const int cc = lane % LR;
  const int to = lane / LR;
  const int n = tl;  // warp-uniform, <= 32
  const bool valid = lane < n;
  float s[REP];
#pragma unroll
  for (int r = 0; r < REP; ++r) s[r] = 0.0f;
  if (nr >= 0) {  // the new token into the tail, 16 bytes per lane (kn, vn: D apart)
    for (int i = lane; i < D / 8; i += 32) {
      *reinterpret_cast<uint4*>(const_cast<SD*>(tk) + (size_t)nr * D + 8 * i) = kivi_ld16(kn + 8 * i);
      *reinterpret_cast<uint4*>(const_cast<SD*>(tv) + (size_t)nr * D + 8 * i) = kivi_ld16(vn + 8 * i);
    }
  }
  if (valid) {
    const SD* row = lane == nr ? kn : tk + (size_t)lane * D;
#pragma unroll 1
    for (int d0 = 0; d0 < D; d0 += 8 * KB) {
      uint4 raw[KB];
#pragma unroll
      for (int i = 0; i < KB; ++i) raw[i] = kivi_ld16(row + d0 + 8 * i);
#pragma unroll
      for (int i = 0; i < KB; ++i) {
        float x[8];
        kivi_unpack8f<SD>(raw[i], x);
#pragma unroll
        for (int j = 0; j < 8; ++j)
#pragma unroll
          for (int r = 0; r < REP; ++r) s[r] = fmaf(qs[(d0 + 8 * i + j) * REP + r], x[j], s[r]);
      }
    }
  }
#pragma unroll
  for (int r = 0; r < REP; ++r) {
    const float mx = fmaxf(m[r], kivi_warp_max(valid ? s[r] : KIVI_NEG_INF));
    const float alpha = (mx == KIVI_NEG_INF) ? 1.0f : exp2f(m[r] - mx);  // n = 0: no row
    m[r] = mx;
    l[r] *= alpha;
#pragma unroll
    for (int j = 0; j < 8; ++j) acc[r][j] *= alpha;
    const float p = valid ? exp2f(s[r] - mx) : 0.0f;
    l[r] += p;
    pw[r * PS + lane] = p;
  }
  __syncwarp();
#pragma unroll 1
  for (int t0 = to; t0 < n; t0 += KB * TPI) {
    uint4 raw[KB];
#pragma unroll
    for (int i = 0; i < KB; ++i) {
      const int t = t0 + i * TPI;
      raw[i] = t < n ? kivi_ld16((t == nr ? vn : tv + (size_t)t * D) + cc * 8) : make_uint4(0u, 0u, 0u, 0u);
    }
#pragma unroll
    for (int i = 0; i < KB; ++i) {
      const int t = t0 + i * TPI;
      if (t < n) {
        float x[8];
        kivi_unpack8f<SD>(raw[i], x);
#pragma unroll
        for (int r = 0; r < REP; ++r) {
          const float pr = pw[r * PS + t];
#pragma unroll
          for (int j = 0; j < 8; ++j) acc[r][j] = fmaf(pr, x[j], acc[r][j]);
        }
      }
    }
  }
  __syncwarp();
}

// A warp's (m, l, acc) per query head -> part_ml / part_acc at row oi (split-major).
// acc layout: lane = (token offset, channel group cc); summed over token offsets here.
template <int D, int REP>
__device__ __forceinline__ void kivi_write_part(const float (&m)[REP], float (&l)[REP],
                                                float (&acc)[REP][8], int lane,
                                                float* part_acc, float* part_ml, size_t oi) {
  constexpr int LR = D / 8;
  const int cc = lane % LR;
#pragma unroll
  for (int r = 0; r < REP; ++r) {
    l[r] = kivi_warp_sum(l[r]);
#pragma unroll
    for (int o = LR; o < 32; o <<= 1)
#pragma unroll
      for (int j = 0; j < 8; ++j) acc[r][j] += __shfl_xor_sync(KIVI_FULL, acc[r][j], o);
  }
  if (lane == 0) {
#pragma unroll
    for (int r = 0; r < REP; ++r) {
      part_ml[(oi + r) * 2] = m[r];
      part_ml[(oi + r) * 2 + 1] = l[r];
    }
  }
  // An empty split (m = -inf) writes no acc; the merge never reads it.
  if (lane < LR && m[0] != KIVI_NEG_INF) {
#pragma unroll
    for (int r = 0; r < REP; ++r) {
      float4* dst = reinterpret_cast<float4*>(part_acc + (oi + r) * D + cc * 8);
      dst[0] = make_float4(acc[r][0], acc[r][1], acc[r][2], acc[r][3]);
      dst[1] = make_float4(acc[r][4], acc[r][5], acc[r][6], acc[r][7]);
    }
  }
}

// ---- tensor-core helpers (the MMA split kernel) -----------------------------------
template <typename A, typename B> struct kivi_same { static constexpr bool value = false; };
template <typename A> struct kivi_same<A, A> { static constexpr bool value = true; };

// Two storage-dtype values packed in 32 bits, low half first (MMA operand registers).
template <typename SD> __device__ __forceinline__ uint32_t kivi_pack2f(float lo, float hi);
template <> __device__ __forceinline__ uint32_t kivi_pack2f<__half>(float lo, float hi) {
  const __half2 v = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}
template <> __device__ __forceinline__ uint32_t kivi_pack2f<__nv_bfloat16>(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

// (w & MASK) | MAGIC as one LOP3 (ptxas emitted an AND and an OR for the plain C++:
// ncu counted 2 LOP3 per dequantized pair).
template <uint32_t MASK, uint32_t MAGIC>
__device__ __forceinline__ uint32_t kivi_and_or(uint32_t w) {
  uint32_t r;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(r) : "r"(w), "r"(MASK), "r"(MAGIC));
  return r;
}

// The code at bit O (BITS wide) of each 16-bit half of w, dequantized as
// (code * scale + zero) in SD with one rounding (packed FMA; s2 / z2 hold the two
// halves' scale and zero). The code becomes an exact SD number by or-ing it into the
// mantissa of the power of two 2^E whose ulp is 2^-O (E = 10 - O in fp16, 7 - O in
// bf16), so that bit O weighs 1, and subtracting 2^E: no shift as long as the code
// stays inside the mantissa (O + BITS <= 10 / 7).
template <typename SD, int BITS, int O>
__device__ __forceinline__ uint32_t kivi_deq_at(uint32_t w, uint32_t s2, uint32_t z2) {
  constexpr bool F16 = kivi_same<SD, __half>::value;
  constexpr int E = (F16 ? 10 : 7) - O;
  static_assert(E >= 0 && O + BITS <= (F16 ? 10 : 7), "code outside the mantissa");
  constexpr uint32_t M = ((1u << BITS) - 1u) << O;
  constexpr uint32_t H = F16 ? uint32_t(15 + E) << 10 : uint32_t(127 + E) << 7;  // 2^E
  constexpr uint32_t magic = H * 0x00010001u;  // 2^E in both halves
  uint32_t t = kivi_and_or<M * 0x00010001u, magic>(w);
  if constexpr (F16) {
    __half2 x = __hsub2(*reinterpret_cast<__half2*>(&t), *reinterpret_cast<const __half2*>(&magic));
    x = __hfma2(x, *reinterpret_cast<const __half2*>(&s2), *reinterpret_cast<const __half2*>(&z2));
    return *reinterpret_cast<uint32_t*>(&x);
  } else {
    __nv_bfloat162 x = __hsub2(*reinterpret_cast<__nv_bfloat162*>(&t),
                               *reinterpret_cast<const __nv_bfloat162*>(&magic));
    x = __hfma2(x, *reinterpret_cast<const __nv_bfloat162*>(&s2),
                *reinterpret_cast<const __nv_bfloat162*>(&z2));
    return *reinterpret_cast<uint32_t*>(&x);
  }
}

// Codes j = 0..3 of each 16-bit half of w (4 * BITS bits per half, code j at bit
// j * BITS), dequantized as pairs x[j]. Shifts only where a code would leave the
// mantissa: fp16 4-bit one shift per word, fp16 2-bit none, bf16 4-bit three, bf16
// 2-bit one (the per-code shift + and + or was 2-3 instructions per pair).
template <typename SD, int BITS>
__device__ __forceinline__ void kivi_deq4(uint32_t w, uint32_t s2, uint32_t z2, uint32_t (&x)[4]) {
  constexpr bool F16 = kivi_same<SD, __half>::value;
  if constexpr (BITS == 2 && F16) {
    x[0] = kivi_deq_at<SD, 2, 0>(w, s2, z2);
    x[1] = kivi_deq_at<SD, 2, 2>(w, s2, z2);
    x[2] = kivi_deq_at<SD, 2, 4>(w, s2, z2);
    x[3] = kivi_deq_at<SD, 2, 6>(w, s2, z2);
  } else if constexpr (BITS == 2) {
    x[0] = kivi_deq_at<SD, 2, 0>(w, s2, z2);
    x[1] = kivi_deq_at<SD, 2, 2>(w, s2, z2);
    x[2] = kivi_deq_at<SD, 2, 4>(w, s2, z2);
    x[3] = kivi_deq_at<SD, 2, 2>(w >> 4, s2, z2);
  } else if constexpr (F16) {
    const uint32_t w8 = w >> 8;
    x[0] = kivi_deq_at<SD, 4, 0>(w, s2, z2);
    x[1] = kivi_deq_at<SD, 4, 4>(w, s2, z2);
    x[2] = kivi_deq_at<SD, 4, 0>(w8, s2, z2);
    x[3] = kivi_deq_at<SD, 4, 4>(w8, s2, z2);
  } else {
    x[0] = kivi_deq_at<SD, 4, 0>(w, s2, z2);
    x[1] = kivi_deq_at<SD, 4, 0>(w >> 4, s2, z2);
    x[2] = kivi_deq_at<SD, 4, 0>(w >> 8, s2, z2);
    x[3] = kivi_deq_at<SD, 4, 0>(w >> 12, s2, z2);
  }
}

// Two 4-code units (4 * BITS bits each; byte offsets a and b of p) in the two halves.
template <int BITS>
__device__ __forceinline__ uint32_t kivi_unit2(const uint8_t* p, int a, int b) {
  if constexpr (BITS == 4) {
    return uint32_t(*reinterpret_cast<const unsigned short*>(p + a)) |
           (uint32_t(*reinterpret_cast<const unsigned short*>(p + b)) << 16);
  } else {
    return uint32_t(p[a]) | (uint32_t(p[b]) << 16);
  }
}

// FOLD (fp16 pools): the scale moves onto the other MMA operand and the zero into a
// separate MMA, so a code pair costs one AND. Code j of each 16-bit half of w stays at
// its bit position O_j (kivi_code_pos) with a zero exponent field: the fp16 subnormal
// code * 2^(O_j - 24), exact; the caller multiplies the sums by 2^(24 - O_j).
template <int BITS> __device__ __forceinline__ constexpr int kivi_code_pos(int j) {
  return BITS == 2 ? 2 * j : 4 * (j & 1);
}
template <int BITS>
__device__ __forceinline__ void kivi_codes4(uint32_t w, uint32_t (&x)[4]) {
  constexpr uint32_t M = ((1u << BITS) - 1u) * 0x00010001u;
  if constexpr (BITS == 2) {
    x[0] = w & M;
    x[1] = w & (M << 2);
    x[2] = w & (M << 4);
    x[3] = w & (M << 6);
  } else {
    const uint32_t w8 = w >> 8;
    x[0] = w & M;
    x[1] = w & (M << 4);
    x[2] = w8 & M;
    x[3] = w8 & (M << 4);
  }
}

// Two fp16 products, rounded once each (the folded operand: q * scale, p * scale).
__device__ __forceinline__ uint32_t kivi_hmul2(uint32_t a, uint32_t b) {
  __half2 r = __hmul2(*reinterpret_cast<const __half2*>(&a), *reinterpret_cast<const __half2*>(&b));
  return *reinterpret_cast<uint32_t*>(&r);
}

// Asynchronous 16-byte global -> shared copies (sm_80+), grouped per staged block.
__device__ __forceinline__ void kivi_cp16(void* smem, const void* gmem) {
  const unsigned a = (unsigned)__cvta_generic_to_shared(smem);
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(a), "l"(gmem) : "memory");
}
__device__ __forceinline__ void kivi_cp_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N> __device__ __forceinline__ void kivi_cp_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

// Stage one (block, kv head) tile into dst: [k codes][v codes][k scales][k zeros]
// [v scales][v zeros], all contiguous in global memory per tile.
template <typename SD, int D, int KTILE, int VTILE>
__device__ __forceinline__ void kivi_stage_tile(uint8_t* dst, int lane, size_t tile,
                                                const uint8_t* k_codes, const uint8_t* v_codes,
                                                const SD* k_scales, const SD* k_zeros,
                                                const SD* v_scales, const SD* v_zeros) {
  constexpr int SC = D / 8;  // 16-byte chunks of one scale or zero array (D values)
  const uint8_t* kc = k_codes + tile * KTILE;
  const uint8_t* vc = v_codes + tile * VTILE;
  for (int i = lane; i < KTILE / 16; i += 32) kivi_cp16(dst + i * 16, kc + i * 16);
  // Value rows are stored swizzled: chunk c of token row t goes to chunk c ^ ((t / 8) %
  // NCH), so the V phase's lanes (rows 8f + ..) hit different banks (a 4-way conflict
  // at 4 bits otherwise).
  constexpr int NCH = (VTILE / 32) / 16;  // 16-byte chunks per token row (G = 32 rows)
  for (int i = lane; i < VTILE / 16; i += 32) {
    const int t = i / NCH, c = i % NCH;
    kivi_cp16(dst + KTILE + (t * NCH + (c ^ ((t >> 3) & (NCH - 1)))) * 16, vc + i * 16);
  }
  for (int i = lane; i < 4 * SC; i += 32) {
    const int a = i / SC, c = i % SC;
    const SD* src = (a == 0 ? k_scales : a == 1 ? k_zeros : a == 2 ? v_scales : v_zeros);
    kivi_cp16(dst + KTILE + VTILE + a * (D * 2) + c * 16, src + tile * D + c * 8);
  }
  kivi_cp_commit();
}

// c += A * B on the tensor cores: m16n8k16, SD inputs, float32 accumulation.
template <typename SD>
__device__ __forceinline__ void kivi_mma(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                         uint32_t a3, uint32_t b0, uint32_t b1) {
  if constexpr (kivi_same<SD, __half>::value) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  } else {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  }
}
"""

# Inputs: q [B, H_q, D] (T); the pool's 8 arrays (layout.py); block_tables [B, MBS],
# num_blocks, slots, tail_lens [B] int32; params int32 [MBS, bps, S, R + G];
# qscale float32 [1] = scale * log2(e).
# Outputs: part_acc float32 [B, H_kv, S + 1, REP, D], part_ml float32 [.., REP, 2].
# Grid: x = ceil((S + 1) / NW) blocks of NW warps, y = H_kv, z = B.
ATTEND_SOURCE = r"""
  constexpr int P = 8 / BITS;
  constexpr int KROW = G / P;        // bytes of one k_codes row (one channel, G tokens)
  constexpr int VROW = D / P;        // bytes of one v_codes row (one token, D channels)
  constexpr int NG = D / G;          // value groups per token
  constexpr int LPB = G / 8;         // K phase: lanes per block (8 tokens each)
  constexpr int SB = 32 / LPB;       // blocks per warp step
  constexpr int STEP = SB * G;       // tokens per warp step (256)
  constexpr int LR = D / 8;          // V phase: lanes per token row (8 channels each)
  constexpr int TPI = 32 / LR;       // V phase: tokens per iteration
  constexpr int VU = (G / TPI < 8) ? G / TPI : 8;  // V phase: tokens loaded together

  __shared__ __align__(16) float qs[D * REP];         // [D][REP] q * scale * log2(e)
  __shared__ __align__(16) float ps[NW * REP * STEP];  // per warp: [REP][STEP] p

  KIVI_SPLIT_INDICES

  // q rows of this kv head's query heads are contiguous: [REP][D].
  {
    const T* qp = q + ((size_t)b * H_kv + h) * (REP * D);
    const float qscale = qscale_in[0];
    for (int i = threadIdx.x; i < REP * D; i += NW * 32) {
      qs[(i % D) * REP + i / D] = kivi_f(qp[i]) * qscale;
    }
  }
  __syncthreads();
  if (split >= nsu) return;  // warp-uniform; no barrier follows

  float* pw = ps + warp * (REP * STEP);
  float m[REP], l[REP], acc[REP][8];
#pragma unroll
  for (int r = 0; r < REP; ++r) {
    m[r] = KIVI_NEG_INF;
    l[r] = 0.0f;
#pragma unroll
    for (int j = 0; j < 8; ++j) acc[r][j] = 0.0f;
  }
  const int cc = lane % LR;  // V phase: channels cc*8 .. cc*8+7 (one value group)
  const int to = lane / LR;  // V phase: token offset

  if (split < nsplit) {
    // ---- quantized blocks [blk0, blk1) of this sequence -------------------------
    const int nb = min(num_blocks[b], mbs);
    const int blk0 = split * bps;
    const int blk1 = min(blk0 + bps, nb);
    const int* table = block_tables + (size_t)b * mbs;
    const int jl = lane / LPB;   // K phase: block within the step
    const int seg = lane % LPB;  // K phase: 8-token segment within the block
    for (int sb = blk0; sb < blk1; sb += SB) {
      const int nblk = min(SB, blk1 - sb);  // warp-uniform
      const bool kvalid = jl < nblk;
      const int pb = kvalid ? table[sb + jl] : 0;
      float s[REP][8];
#pragma unroll
      for (int r = 0; r < REP; ++r)
#pragma unroll
        for (int j = 0; j < 8; ++j) s[r][j] = 0.0f;
      if (kvalid) {
        const size_t tile = (size_t)pb * H_kv + h;
        const uint8_t* kc = k_codes + tile * (D * KROW) + seg * BITS;
        const SD* ksp = k_scales + tile * D;
        const SD* kzp = k_zeros + tile * D;
        // 8 channels at a time: their 8 code loads and one 16-byte load each of
        // scales and zeros are issued together (the scale loads hit one sector per
        // block instead of one per channel).
#pragma unroll 1
        for (int d0 = 0; d0 < D; d0 += 8) {
          uint32_t lo[8], hi[8];
#pragma unroll
          for (int i = 0; i < 8; ++i) kivi_load8<BITS>(kc + (d0 + i) * KROW, lo[i], hi[i]);
          float ks[8], kz[8];
          kivi_load8f<SD>(ksp + d0, ks);
          kivi_load8f<SD>(kzp + d0, kz);
#pragma unroll
          for (int i = 0; i < 8; ++i) {
            float qd[REP];
#pragma unroll
            for (int r = 0; r < REP; ++r) qd[r] = qs[(d0 + i) * REP + r];
#pragma unroll
            for (int j = 0; j < 8; ++j) {
              const float x = fmaf(kivi_code<BITS>(lo[i], hi[i], j), ks[i], kz[i]);
#pragma unroll
              for (int r = 0; r < REP; ++r) s[r][j] = fmaf(qd[r], x, s[r][j]);
            }
          }
        }
      }
      // Online softmax over the step; lane 0's block is always valid, so mx is finite.
#pragma unroll
      for (int r = 0; r < REP; ++r) {
        float mx = KIVI_NEG_INF;
        if (kvalid) {
#pragma unroll
          for (int j = 0; j < 8; ++j) mx = fmaxf(mx, s[r][j]);
        }
        mx = fmaxf(m[r], kivi_warp_max(mx));
        const float alpha = exp2f(m[r] - mx);
        m[r] = mx;
        l[r] *= alpha;
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[r][j] *= alpha;
        float p8[8];
        float lsum = 0.0f;
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          p8[j] = kvalid ? exp2f(s[r][j] - mx) : 0.0f;
          lsum += p8[j];
        }
        l[r] += lsum;
        float4* dst = reinterpret_cast<float4*>(pw + r * STEP + lane * 8);
        dst[0] = make_float4(p8[0], p8[1], p8[2], p8[3]);
        dst[1] = make_float4(p8[4], p8[5], p8[6], p8[7]);
      }
      __syncwarp();
      for (int jj = 0; jj < nblk; ++jj) {
        const int vb = __shfl_sync(KIVI_FULL, pb, jj * LPB);
        const size_t tile = (size_t)vb * H_kv + h;
        const uint8_t* vc = v_codes + tile * (G * VROW) + cc * BITS;
        const SD* vsp = v_scales + tile * (G * NG) + (cc * 8) / G;
        const SD* vzp = v_zeros + tile * (G * NG) + (cc * 8) / G;
        const float* pp = pw + jj * G;
        // VU tokens at a time, their loads issued together.
#pragma unroll 1
        for (int t0 = to; t0 < G; t0 += VU * TPI) {
          uint32_t lo[VU], hi[VU];
          float vs[VU], vz[VU];
#pragma unroll
          for (int i = 0; i < VU; ++i) {
            const int t = t0 + i * TPI;
            kivi_load8<BITS>(vc + t * VROW, lo[i], hi[i]);
            vs[i] = kivi_f(__ldg(vsp + t * NG));
            vz[i] = kivi_f(__ldg(vzp + t * NG));
          }
#pragma unroll
          for (int i = 0; i < VU; ++i) {
            const int t = t0 + i * TPI;
            float pr[REP];
#pragma unroll
            for (int r = 0; r < REP; ++r) pr[r] = pp[r * STEP + t];
#pragma unroll
            for (int j = 0; j < 8; ++j) {
              const float x = fmaf(kivi_code<BITS>(lo[i], hi[i], j), vs[i], vz[i]);
#pragma unroll
              for (int r = 0; r < REP; ++r) acc[r][j] = fmaf(pr[r], x, acc[r][j]);
            }
          }
        }
      }
      __syncwarp();
    }
  } else {
    KIVI_TAIL_CHUNK
    kivi_tail_attend<SD, D, REP, STEP>(qs, pw, tail_k + base, tail_v + base, rows, nr,
                                       k_new + kv, v_new + kv, lane, m, l, acc);
  }
  kivi_write_part<D, REP>(m, l, acc, lane, part_acc, part_ml,
                          ((size_t)(b * H_kv + h) * nsu + split) * REP);
"""


# The tensor-core split kernel: same inputs, outputs, grid and merge as ATTEND_SOURCE;
# G = 32, bits 2 or 4, D a multiple of 32 up to 128, REP <= 8. A warp stages one
# block (K and V codes, scales, zeros) in shared memory, dequantizes it to SD
# fragments and runs m16n8k16 MMAs with float32 accumulation:
#   K phase: scores[token][rep] = K_hat[32 tokens][D] . q^T, rows = tokens (2 m-tiles),
#     n = query heads (padded to 8). Lane (g = lane / 4, f = lane % 4) holds tokens
#     4g .. 4g+3 (one 4-code unit of a channel row) for channels 2f, 2f+1, 2f+8, 2f+9
#     of each 16-channel k-tile.
#   V phase: out^T[channel][rep] += V_hat^T[D][32 tokens] . p^T, rows = channels, k =
#     tokens. Lane holds channels 32mp + 4g .. +3 (one unit of a token row) for tokens
#     8f .. 8f+7, so its value scales (staged transposed, [group][token]) are adjacent.
#   p goes through shared memory in SD ([8][32] per warp): the transpose between the
#   two fragment layouts.
# FOLD (template constant; 1 for fp16 pools unless KIVIQ_KIVI_FOLD=0): no code is
# dequantized. Since K_hat = code * s + z per channel and V_hat = code * s + z per
# token and group,
#   scores = codes . (q * s) + z . q        out = codes^T . (p * s) + z^T . p
# so the scale goes onto the other operand (one HMUL2 per 2 channels of q per block,
# per 2 tokens of p per group), the zeros' terms are two small MMAs of their own
# (zc; zv for all channel groups at once), and a code pair costs one AND: the code at
# its bit position O with a zero exponent is the fp16 subnormal code * 2^(O - 24),
# exact, and the MMA's float32 sums are multiplied back by 2^(24 - O) (O is fixed per
# accumulator register). The dequantization was LOP3 + HSUB2 + HFMA2 per pair, ~45%
# of a tile's instructions: offline SASS (cuobjdump, D = 128) puts the block loop at
# 657 instead of 856 instructions at 4 bits and 606 instead of 817 at 2 bits.
# Numerics: K_hat and V_hat are never rounded; q * s and p * s are, once each to
# fp16 (2^-11 relative), with zeros' terms from the rounded q and p. fp16 only: a
# bf16 code would be a bf16 subnormal (2^-133), whose products underflow float32.
ATTEND_MMA_SOURCE = r"""
  constexpr int P = 8 / BITS;
  constexpr int KROW = G / P;     // bytes of a k_codes row (one channel)
  constexpr int VROW = D / P;     // bytes of a v_codes row (one token)
  constexpr int UB = BITS / 2;    // bytes of a 4-code unit
  constexpr int KT = D / 16;      // k-tiles of the K phase
  constexpr int MP = D / 32;      // channel m-tile pairs of the V phase (one group each)
  constexpr int NG = D / G;       // value groups per token
  constexpr int NCH = VROW / 16;  // 16-byte chunks per value row (swizzled in smem)
  constexpr int KTILE = D * KROW;
  constexpr int VTILE = G * VROW;
  constexpr int SB = KTILE + VTILE + 4 * D * 2;  // one staged block
  constexpr int WB = 2 * SB + 4 * D + 16 * G;    // per warp: 2 stages, v scales^T, p
  static_assert(G == 32, "MMA kernel: G = 32");
  static_assert(!FOLD || kivi_same<SD, __half>::value, "FOLD: fp16 pools only (fp16 subnormal codes)");
  static_assert(WB >= REP * (D + 32) * 4, "tail warp scratch fits in its region");
  // Per warp: stages 0 and 1 (cp.async double buffer), the value scales and zeros
  // transposed to [group][token], and p as [8 heads][32 tokens] in SD. The tail warp
  // uses its region for q (float) and p instead. No block-wide barrier anywhere.
  __shared__ __align__(16) uint8_t smem[NW * WB];

  KIVI_SPLIT_INDICES
  if (split >= nsu) return;
  const T* qp = q + ((size_t)b * H_kv + h) * (REP * D);
  const float qscale = qscale_in[0];
  uint8_t* ws = smem + warp * WB;
  const size_t oi = ((size_t)(b * H_kv + h) * nsu + split) * REP;

  if (split >= nsplit) {  // a chunk of the fp16/bf16 tail, on the CUDA cores
    float* qs = reinterpret_cast<float*>(ws);  // [D][REP] q * scale * log2(e)
    for (int i = lane; i < REP * D; i += 32) qs[(i % D) * REP + i / D] = kivi_f(qp[i]) * qscale;
    __syncwarp();
    float m[REP], l[REP], acc[REP][8];
#pragma unroll
    for (int r = 0; r < REP; ++r) {
      m[r] = KIVI_NEG_INF;
      l[r] = 0.0f;
#pragma unroll
      for (int j = 0; j < 8; ++j) acc[r][j] = 0.0f;
    }
    KIVI_TAIL_CHUNK
    kivi_tail_attend<SD, D, REP, 32>(qs, qs + D * REP, tail_k + base, tail_v + base, rows, nr,
                                     k_new + kv, v_new + kv, lane, m, l, acc);
    kivi_write_part<D, REP>(m, l, acc, lane, part_acc, part_ml, oi);
    return;
  }

  const int g = lane >> 2;
  const int f = lane & 3;
  SD* vs = reinterpret_cast<SD*>(ws + 2 * SB);  // [NG][G] value scales of the block
  SD* vz = vs + D;
  SD* pt = vz + D;                                // [8][G] p

  // q of query head g as B fragments (zero rows pad REP to 8), unscaled: the softmax
  // scale is applied to the float32 scores.
  uint32_t qb[KT][2];
#pragma unroll
  for (int kt = 0; kt < KT; ++kt) {
    qb[kt][0] = 0u;
    qb[kt][1] = 0u;
    if (g < REP) {
      const T* qr = qp + g * D + kt * 16 + 2 * f;
      qb[kt][0] = kivi_pack2f<SD>(kivi_f(qr[0]), kivi_f(qr[1]));
      qb[kt][1] = kivi_pack2f<SD>(kivi_f(qr[8]), kivi_f(qr[9]));
    }
  }
  float m2[2] = {KIVI_NEG_INF, KIVI_NEG_INF};  // query heads 2f, 2f+1
  float l2[2] = {0.0f, 0.0f};                  // this lane's tokens only
  float oacc[2 * MP][4];
  // FOLD: sum over tokens of p * value zero; rows g and g + 8 of lane (g, f) hold
  // channel group g % MP, heads 2f + {0, 1}.
  float zv[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
  for (int i = 0; i < 2 * MP; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) oacc[i][j] = 0.0f;

  const int nb = min(num_blocks[b], mbs);
  const int blk0 = split * bps;
  const int blk1 = min(blk0 + bps, nb);
  const int* table = block_tables + (size_t)b * mbs;
  if (blk0 < blk1) {
    kivi_stage_tile<SD, D, KTILE, VTILE>(ws, lane, (size_t)table[blk0] * H_kv + h, k_codes,
                                         v_codes, k_scales, k_zeros, v_scales, v_zeros);
  }
  for (int blk = blk0; blk < blk1; ++blk) {
    // Prefetch the next block into the other stage, then wait for this one.
    const uint8_t* st = ws + ((blk - blk0) & 1) * SB;
    if (blk + 1 < blk1) {
      kivi_stage_tile<SD, D, KTILE, VTILE>(ws + ((blk + 1 - blk0) & 1) * SB, lane,
                                           (size_t)table[blk + 1] * H_kv + h, k_codes,
                                           v_codes, k_scales, k_zeros, v_scales, v_zeros);
      kivi_cp_wait<1>();
    } else {
      kivi_cp_wait<0>();
    }
    __syncwarp();
    const uint8_t* kc = st;
    const uint8_t* vc = st + KTILE;
    const SD* ks = reinterpret_cast<const SD*>(st + KTILE + VTILE);
    const SD* kz = ks + D;
    {
      const SD* vsg = kz + D;  // [G tokens][NG groups] as stored
      const SD* vzg = vsg + D;
#pragma unroll
      for (int i = lane; i < D; i += 32) {
        const int t = i / NG, gr = i % NG;
        vs[gr * G + t] = vsg[i];
        vz[gr * G + t] = vzg[i];
      }
    }
    __syncwarp();

    // ---- K phase: scores of tokens 4g + {0,1} (m-tile 0) and 4g + {2,3} (m-tile 1)
    // Two accumulators per m-tile (even and odd k-tiles): two independent MMA chains.
    // Every shared address below is a per-lane base plus a compile-time offset (one
    // LDS [R + imm] each; offsets kept in registers cost an IADD3 per load and registers).
    float sc[2][4], sc2[2][4], zc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
      for (int j = 0; j < 4; ++j) sc[i][j] = sc2[i][j] = 0.0f;
    const uint8_t* kl = kc + (2 * f) * KROW + g * UB;  // channel 2f, tokens 4g ..
    const SD* ksl = ks + 2 * f;
    const SD* kzl = kz + 2 * f;
#pragma unroll
    for (int kt = 0; kt < KT; ++kt) {
      const uint8_t* kk = kl + kt * 16 * KROW;
      const uint32_t s01 = *reinterpret_cast<const uint32_t*>(ksl + kt * 16);
      const uint32_t z01 = *reinterpret_cast<const uint32_t*>(kzl + kt * 16);
      const uint32_t s89 = *reinterpret_cast<const uint32_t*>(ksl + kt * 16 + 8);
      const uint32_t z89 = *reinterpret_cast<const uint32_t*>(kzl + kt * 16 + 8);
      uint32_t x01[4], x89[4];
      uint32_t qa = qb[kt][0], qc = qb[kt][1];
      if constexpr (FOLD) {  // codes * (q * scale) + zero . q (zc)
        kivi_codes4<BITS>(kivi_unit2<BITS>(kk, 0, KROW), x01);
        kivi_codes4<BITS>(kivi_unit2<BITS>(kk, 8 * KROW, 9 * KROW), x89);
        qa = kivi_hmul2(qa, s01);
        qc = kivi_hmul2(qc, s89);
        kivi_mma<SD>(zc, z01, z01, z89, z89, qb[kt][0], qb[kt][1]);
      } else {
        kivi_deq4<SD, BITS>(kivi_unit2<BITS>(kk, 0, KROW), s01, z01, x01);
        kivi_deq4<SD, BITS>(kivi_unit2<BITS>(kk, 8 * KROW, 9 * KROW), s89, z89, x89);
      }
#pragma unroll
      for (int mt = 0; mt < 2; ++mt) {
        kivi_mma<SD>((kt & 1) ? sc2[mt] : sc[mt], x01[2 * mt], x01[2 * mt + 1], x89[2 * mt],
                     x89[2 * mt + 1], qa, qc);
      }
    }
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
      for (int j = 0; j < 4; ++j) sc[i][j] += sc2[i][j];
    // sc[mt][2 * hi + e]: token 4g + 2mt + hi (code position j = 2mt + hi), query head 2f + e.
    // ---- online softmax over the block's 32 tokens (base 2) ----
    float alpha[2];
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      float bm = KIVI_NEG_INF;
#pragma unroll
      for (int mt = 0; mt < 2; ++mt) {
        if constexpr (FOLD) {  // zc[e] = zc[2 + e]: every row of its A operand is the zeros
          sc[mt][e] = fmaf(sc[mt][e], qscale * float(1 << (24 - kivi_code_pos<BITS>(2 * mt))), zc[e] * qscale);
          sc[mt][2 + e] = fmaf(sc[mt][2 + e], qscale * float(1 << (24 - kivi_code_pos<BITS>(2 * mt + 1))),
                               zc[e] * qscale);
        } else {
          sc[mt][e] *= qscale;
          sc[mt][2 + e] *= qscale;
        }
        bm = fmaxf(bm, fmaxf(sc[mt][e], sc[mt][2 + e]));
      }
#pragma unroll
      for (int o = 4; o < 32; o <<= 1) bm = fmaxf(bm, __shfl_xor_sync(KIVI_FULL, bm, o));
      const float mn = fmaxf(m2[e], bm);
      alpha[e] = exp2f(m2[e] - mn);
      m2[e] = mn;
      float p[4];
#pragma unroll
      for (int mt = 0; mt < 2; ++mt) {
        p[2 * mt] = exp2f(sc[mt][e] - mn);
        p[2 * mt + 1] = exp2f(sc[mt][2 + e] - mn);
      }
      l2[e] = l2[e] * alpha[e] + ((p[0] + p[1]) + (p[2] + p[3]));
      uint2 pk;
      pk.x = kivi_pack2f<SD>(p[0], p[1]);
      pk.y = kivi_pack2f<SD>(p[2], p[3]);
      *reinterpret_cast<uint2*>(pt + (2 * f + e) * G + 4 * g) = pk;
    }
    // Rescale only when some head's running max moved (rare after the first blocks).
    if (__any_sync(KIVI_FULL, alpha[0] != 1.0f || alpha[1] != 1.0f)) {
#pragma unroll
      for (int i = 0; i < 2 * MP; ++i) {
        oacc[i][0] *= alpha[0];
        oacc[i][1] *= alpha[1];
        oacc[i][2] *= alpha[0];
        oacc[i][3] *= alpha[1];
      }
      zv[0] *= alpha[0];
      zv[1] *= alpha[1];
      zv[2] *= alpha[0];
      zv[3] *= alpha[1];
    }
    __syncwarp();

    // ---- V phase: tokens 8f + 4kt + {0,1} (k 2f, 2f+1) and + {2,3} (k 2f+8, 2f+9) ----
    const uint4 pq = *reinterpret_cast<const uint4*>(pt + g * G + 8 * f);  // query head g
    const SD* vsl = vs + 8 * f;
    const SD* vzl = vz + 8 * f;
    if constexpr (FOLD) {  // the zeros' term of every channel group at once (see zv)
#pragma unroll
      for (int kt = 0; kt < 2; ++kt) {
        const uint32_t za = *reinterpret_cast<const uint32_t*>(vzl + (g % MP) * G + 4 * kt);
        const uint32_t zb = *reinterpret_cast<const uint32_t*>(vzl + (g % MP) * G + 4 * kt + 2);
        kivi_mma<SD>(zv, za, za, zb, zb, kt ? pq.z : pq.x, kt ? pq.w : pq.y);
      }
    }
#pragma unroll
    for (int mp = 0; mp < MP; ++mp) {
      // unit: channels 32mp + 4g .. +3, in the swizzled chunk of rows 8f .. 8f+7
      const int u0 = (mp * 8 + g) * UB;
      const uint8_t* vl = vc + 8 * f * VROW + ((((u0 >> 4) ^ (f & (NCH - 1))) << 4) | (u0 & 15));
#pragma unroll
      for (int kt = 0; kt < 2; ++kt) {
        const int ta = 4 * kt;  // token offset within the lane's rows 8f ..
        const uint32_t sa = *reinterpret_cast<const uint32_t*>(vsl + mp * G + ta);
        const uint32_t sb = *reinterpret_cast<const uint32_t*>(vsl + mp * G + ta + 2);
        uint32_t xa[4], xb[4];
        const uint32_t pb0 = kt ? pq.z : pq.x;
        const uint32_t pb1 = kt ? pq.w : pq.y;
        uint32_t pa = pb0, pc = pb1;
        if constexpr (FOLD) {  // codes * (p * scale), the zeros' term in zv
          kivi_codes4<BITS>(kivi_unit2<BITS>(vl, ta * VROW, (ta + 1) * VROW), xa);
          kivi_codes4<BITS>(kivi_unit2<BITS>(vl, (ta + 2) * VROW, (ta + 3) * VROW), xb);
          pa = kivi_hmul2(pa, sa);
          pc = kivi_hmul2(pc, sb);
        } else {
          const uint32_t za = *reinterpret_cast<const uint32_t*>(vzl + mp * G + ta);
          const uint32_t zb = *reinterpret_cast<const uint32_t*>(vzl + mp * G + ta + 2);
          kivi_deq4<SD, BITS>(kivi_unit2<BITS>(vl, ta * VROW, (ta + 1) * VROW), sa, za, xa);
          kivi_deq4<SD, BITS>(kivi_unit2<BITS>(vl, (ta + 2) * VROW, (ta + 3) * VROW), sb, zb, xb);
        }
#pragma unroll
        for (int i = 0; i < 2; ++i) {
          kivi_mma<SD>(oacc[2 * mp + i], xa[2 * i], xa[2 * i + 1], xb[2 * i], xb[2 * i + 1], pa, pc);
        }
      }
    }
    __syncwarp();  // the next iteration's prefetch overwrites this stage, vs, vz, pt
  }

  // ---- (m, l, acc): oacc[2mp + i][2 * hi + e] = channel 32mp + 4g + 2i + hi, head 2f + e
#pragma unroll
  for (int e = 0; e < 2; ++e)
#pragma unroll
    for (int o = 4; o < 32; o <<= 1) l2[e] += __shfl_xor_sync(KIVI_FULL, l2[e], o);
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    const int r = 2 * f + e;
    float zm[MP];  // FOLD: group mp's zeros' term of head r, from lane (mp, f)
#pragma unroll
    for (int mp = 0; mp < MP; ++mp) zm[mp] = FOLD ? __shfl_sync(KIVI_FULL, zv[e], mp * 4 + f) : 0.0f;
    if (r < REP) {
      if (g == 0) {
        part_ml[(oi + r) * 2] = m2[e];
        part_ml[(oi + r) * 2 + 1] = l2[e];
      }
      if (blk1 > blk0) {  // an empty split writes no acc; the merge never reads it
#pragma unroll
        for (int mp = 0; mp < MP; ++mp) {
          float4 o = make_float4(oacc[2 * mp][e], oacc[2 * mp][2 + e], oacc[2 * mp + 1][e],
                                 oacc[2 * mp + 1][2 + e]);  // code positions j = 0, 1, 2, 3
          if constexpr (FOLD) {
            o.x = fmaf(o.x, float(1 << (24 - kivi_code_pos<BITS>(0))), zm[mp]);
            o.y = fmaf(o.y, float(1 << (24 - kivi_code_pos<BITS>(1))), zm[mp]);
            o.z = fmaf(o.z, float(1 << (24 - kivi_code_pos<BITS>(2))), zm[mp]);
            o.w = fmaf(o.w, float(1 << (24 - kivi_code_pos<BITS>(3))), zm[mp]);
          }
          *reinterpret_cast<float4*>(part_acc + (oi + r) * D + mp * 32 + 4 * g) = o;
        }
      }
    }
  }
"""

# Grid: B * H_q thread blocks of MW warps (MW = blockDim.x / 32, chosen per launch
# from the number of splits: `merge_warps`); out [B, H_q, D] in T.
# The splits' weights 2^(m_i - max) are computed once per block into shared memory,
# cooperatively. Then warp w sums splits w, w + MW, ... with each lane holding D / 32
# channels (vector loads; independent across splits, so they overlap), and the warps'
# partial sums meet in shared memory. At B = 1 there are only H_q blocks and hundreds
# of splits: one thread per channel looping over every split serially was the
# latency of the whole call (measured, docs/benchmarks.md).
MERGE_SOURCE = r"""
  constexpr int CPL = D / 32;  // channels per lane
  __shared__ float ws[MAX_SPLITS];
  __shared__ float red[32];
  __shared__ __align__(16) float accs[MERGE_WARPS * D];
  const int bh = blockIdx.x;   // b * H_q + query head = (b * H_kv + h) * REP + r
  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int nw = blockDim.x >> 5;
  const int nsu = params[2] + params[4];
  const size_t first = (size_t)(bh / REP) * nsu * REP + (bh % REP);  // split 0
  float mx = KIVI_NEG_INF;
  for (int i = tid; i < nsu; i += blockDim.x) mx = fmaxf(mx, part_ml[(first + (size_t)i * REP) * 2]);
  mx = kivi_warp_max(mx);
  if (lane == 0) red[warp] = mx;
  __syncthreads();
  mx = red[0];
  for (int w = 1; w < nw; ++w) mx = fmaxf(mx, red[w]);
  __syncthreads();  // red is reused below
  float lsum = 0.0f;
  for (int i = tid; i < nsu; i += blockDim.x) {
    const size_t k = first + (size_t)i * REP;
    const float mi = part_ml[k * 2];
    // An empty split (m = -inf) has weight 0 and an unwritten acc: never read it.
    const float w = (mi == KIVI_NEG_INF) ? 0.0f : exp2f(mi - mx);
    ws[i] = w;
    lsum = fmaf(w, part_ml[k * 2 + 1], lsum);
  }
  lsum = kivi_warp_sum(lsum);
  if (lane == 0) red[warp] = lsum;
  __syncthreads();
  lsum = 0.0f;
  for (int w = 0; w < nw; ++w) lsum += red[w];
  float a[CPL];
#pragma unroll
  for (int c = 0; c < CPL; ++c) a[c] = 0.0f;
  if (mx != KIVI_NEG_INF) {
#pragma unroll 4
    for (int i = warp; i < nsu; i += nw) {
      const float w = ws[i];  // warp-uniform
      if (w != 0.0f) {
        const float* src = part_acc + (first + (size_t)i * REP) * D + lane * CPL;
        if constexpr (CPL % 4 == 0) {
#pragma unroll
          for (int c = 0; c < CPL; c += 4) {
            const float4 x = *reinterpret_cast<const float4*>(src + c);
            a[c] = fmaf(w, x.x, a[c]);
            a[c + 1] = fmaf(w, x.y, a[c + 1]);
            a[c + 2] = fmaf(w, x.z, a[c + 2]);
            a[c + 3] = fmaf(w, x.w, a[c + 3]);
          }
        } else {
#pragma unroll
          for (int c = 0; c < CPL; ++c) a[c] = fmaf(w, src[c], a[c]);
        }
      }
    }
  }
#pragma unroll
  for (int c = 0; c < CPL; ++c) accs[warp * D + lane * CPL + c] = a[c];
  __syncthreads();
  for (int d = tid; d < D; d += blockDim.x) {
    float s = 0.0f;
    for (int w = 0; w < nw; ++w) s += accs[w * D + d];
    out[(size_t)bh * D + d] = kivi_from_f<T>(mx == KIVI_NEG_INF ? 0.0f : s / lsum);
  }
"""

# Inputs: rows_k, rows_v [F, H_kv, R + G, D] (the flushing slots' tails, SD);
# params int32 [R + G]. One thread block per (f, h), one thread per channel d: the
# key group of channel d and the value group d (token d / NG, channel group d % NG).
# Outputs: k_codes [F, H_kv, D, G/P], k_scales/k_zeros [F, H_kv, D],
#          v_codes [F, H_kv, G, D/P], v_scales/v_zeros [F, H_kv, G, D/G].
FLUSH_SOURCE = r"""
  const int fh = blockIdx.x;
  const int d = threadIdx.x;
  const int RG = params[0];
  kivi_flush_block<SD, D, G, BITS>(rows_k + (size_t)fh * RG * D, rows_v + (size_t)fh * RG * D, fh, d,
                                   k_codes, k_scales, k_zeros, v_codes, v_scales, v_zeros);
"""

# The fused flush, in place (the CUDA default; FLUSH_KERNEL_ENV=gather selects the
# other; no Metal twin yet, Metal runs the gather path). Inputs: the layer's eight pool
# arrays (POOL_NAMES), slots int32 [F] (the flushing slots), ids int32 [F * k] (their
# new blocks, k per slot, slot by slot), params int32 [T, H_kv, k] (T = R + k*G, the
# tail rows). One thread block per (slot f, kv head h), one thread per channel d:
# block blk of the slot is its tail rows blk*G .. blk*G + G - 1, written at block
# ids[f * k + blk]; then, after a barrier (the value groups read other threads'
# channels), the tails move down by k*G rows (kivi_shift_tails). Output: `done`, one
# int32 nobody reads; evaluating it runs the launch.
# The pool is written through its input pointers: MLX hands a kernel its inputs as
# const pointers to the arrays' own buffers (no copy: the pool arrays are whole and
# row-contiguous, and ensure_row_contiguous is off so MLX never substitutes a copy).
# The writes are invisible to MLX's graph, so the caller (dispatch.flush_layers) owns
# the ordering: every computation that reads the pool must already be evaluated or
# enqueued (same stream, earlier graph) and nothing reads the pool in the flush's own
# evaluation. What this replaced: one launch returning the new blocks and the shifted
# tails, then eight scatters per layer, ~290 graph nodes a flush step at 36 layers,
# which was most of the host time a flush step added (docs/benchmarks.md, session 9).
FLUSH_SHIFT_ROWS = 16  # <= k*G (G >= 16), see kivi_shift_tails
FLUSH_FUSED_SOURCE = r"""
  const int RG = params[0];
  const int H_kv = params[1];
  const int K = params[2];
  const int f = blockIdx.x / H_kv, h = blockIdx.x % H_kv;
  const int d = threadIdx.x;
  const size_t slot_rows = ((size_t)slots[f] * H_kv + h) * RG * D;
  SD* tk = const_cast<SD*>(tail_k) + slot_rows;
  SD* tv = const_cast<SD*>(tail_v) + slot_rows;
  for (int blk = 0; blk < K; ++blk) {
    kivi_flush_block<SD, D, G, BITS>(tk + (size_t)blk * G * D, tv + (size_t)blk * G * D,
                                     ids[f * K + blk] * H_kv + h, d,
                                     const_cast<uint8_t*>(k_codes), const_cast<SD*>(k_scales),
                                     const_cast<SD*>(k_zeros), const_cast<uint8_t*>(v_codes),
                                     const_cast<SD*>(v_scales), const_cast<SD*>(v_zeros));
  }
  __syncthreads();
  kivi_shift_tails<SD, D, KIVI_SHIFT_ROWS>(tk, tv, RG, K * G, d);
  if (blockIdx.x == 0 && d == 0) done[0] = 0;
""".replace("KIVI_SHIFT_ROWS", str(FLUSH_SHIFT_ROWS))

POOL_NAMES = ("k_codes", "k_scales", "k_zeros", "v_codes", "v_scales", "v_zeros",
              "tail_k", "tail_v")
ATTEND_INPUTS = ["q", *POOL_NAMES, "block_tables", "num_blocks", "slots", "tail_lens",
                 "params", "qscale_in", "k_new", "v_new"]
ATTEND_OUTPUTS = ["part_acc", "part_ml"]
MERGE_INPUTS = ["part_acc", "part_ml", "params"]
FLUSH_INPUTS = ["rows_k", "rows_v", "params"]
FLUSH_OUTPUTS = list(POOL_NAMES[:6])
FLUSH_FUSED_INPUTS = [*POOL_NAMES, "slots", "ids", "params"]
FLUSH_FUSED_OUTPUTS = ["done"]
FLUSH_KERNEL_ENV = "KIVIQ_FLUSH_KERNEL"  # "fused" (default, FLUSH_FUSED_SOURCE) or "gather"


def _build():
    if not _cuda_available():
        return None, None, None, None, None
    def k(source, **kw):  # the kernel's own header items only (kernels.cuda_source says why)
        return mx.fast.cuda_kernel(source=compact(source), header=kernel_header(HEADER, source), **kw)

    return (
        k(ATTEND_SOURCE, name="kivi_attend_split", input_names=ATTEND_INPUTS,
          output_names=ATTEND_OUTPUTS),
        k(ATTEND_MMA_SOURCE, name="kivi_attend_split_mma", input_names=ATTEND_INPUTS,
          output_names=ATTEND_OUTPUTS),
        k(MERGE_SOURCE, name="kivi_attend_merge", input_names=MERGE_INPUTS, output_names=["out"]),
        k(FLUSH_SOURCE, name="kivi_flush_quantize", input_names=FLUSH_INPUTS,
          output_names=FLUSH_OUTPUTS),
        k(FLUSH_FUSED_SOURCE, name="kivi_flush_fused", input_names=FLUSH_FUSED_INPUTS,
          output_names=FLUSH_FUSED_OUTPUTS, ensure_row_contiguous=False),
    )


ATTEND_KERNEL, ATTEND_MMA_KERNEL, MERGE_KERNEL, FLUSH_KERNEL, FLUSH_FUSED_KERNEL = _build()

# ----------------------------------------------------------------------------------
# Host side, shared with the Metal backend (kernels.kivi_metal).

_CONSTS: dict = {}


def _const(values: tuple, dtype) -> mx.array:
    """A small constant array, made once per value: no per-call host array (an extra
    graph node and upload per call, measured as launch overhead)."""
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


_CONST_VALUES: dict = {}  # id of a `_const` array -> its values (no device read-back)


def _const_values(a: mx.array) -> tuple:
    """The values a `_const` array was made from."""
    return _CONST_VALUES[id(a)]

def attend_launch(q_shape, q_dtype, pool, block_tables, num_blocks, slots, tail_lens, *,
                  scale, bits, group_size, warps=WARPS, sms=None, step_tokens=STEP_TOKENS,
                  tail_rows: int | None = TAIL_ROWS):
    """Everything a split launch needs, from shapes and small int arrays.

    The tail is cut into splits of `tail_rows` rows (None: one split, the Metal
    kernel's way).

    Returns (meta, split kwargs, number of splits with the tail, rep): `meta` are the
    split kernel's inputs after q and the pool's arrays (its last but one is
    `params`, which the merge reads too); the kwargs lack `inputs` and `template`.
    All lengths and the split plan are data (`params`) or grid sizes, never
    template values.
    """
    b, h_q, d = q_shape
    h_kv, rg = pool.tail_k.shape[1], pool.tail_k.shape[2]
    reason = supports(q_shape, q_dtype, pool, bits, group_size)
    if reason:
        raise ValueError(f"kivi kernel does not support {reason}")
    rep = h_q // h_kv
    mb = block_tables.shape[1]
    nsplit, bps = split_plan(b, h_kv, mb, group_size, sms, step_tokens)
    if mb == 0:  # no quantized blocks anywhere: a dummy column, never read
        block_tables = mx.zeros((b, 1), dtype=mx.int32)
    i32 = lambda a: a if a.dtype == mx.int32 else a.astype(mx.int32)  # noqa: E731
    tail_splits = -(-rg // tail_rows) if tail_rows else 1
    meta = [i32(block_tables), i32(num_blocks), i32(slots), i32(tail_lens),
            _const((max(mb, 1), bps, nsplit, rg, tail_splits, 0), mx.int32),  # [5]: see AttendPlan
            _const((float(scale) * LOG2E,), mx.float32)]
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


# ---- launch bounds ------------------------------------------------------------------
# MLX compiles a custom kernel with NVRTC and no register limit: the MMA split kernel
# once came out at 178 registers per thread (ncu), i.e. 2 blocks = 8 warps per SM, with
# instruction issue, not bandwidth, the limit. `mx.fast.cuda_kernel` has no launch-bounds
# option, but the header may declare the very function MLX generates (namespace
# mlx::core::cu, name custom_kernel_<name><template tag>, one pointer per input and
# output) with `__launch_bounds__`, and the definition inherits it. A declaration that
# does not match (another MLX naming scheme) only declares an unused overload: the
# kernel then runs unbounded, still correct.
# Measured on the H200 (docs/benchmarks.md): bounded to 4 blocks (128 registers, no
# spills) ncu timed one isolated launch at B=32 S=8k at 165 us against 199 us unbounded,
# but interleaved benchmark runs did not separate the builds reliably. Since the
# dequantization rewrite the unbounded build itself gets 128 registers (4 blocks per SM;
# shared memory allows 5), so the default stays unbounded; KIVIQ_KIVI_MIN_BLOCKS=N
# compiles the kernel for N blocks per SM for the next A/B.
MMA_MIN_BLOCKS = 0  # blocks of WARPS warps per SM the MMA kernel is compiled for; 0: no bounds
MIN_BLOCKS_ENV = "KIVIQ_KIVI_MIN_BLOCKS"


def bounded_declaration(name: str, template, inputs, outputs, threads: int,
                        min_blocks: int) -> str:
    """The forward declaration, with `__launch_bounds__(threads, min_blocks)`, of the
    kernel MLX generates for `name` and `template` with these (name, dtype) inputs
    and outputs (source that reads no `<input>_shape`/`_strides`/`_ndim`)."""
    tag = "".join(f"_{CUDA_TYPES[v][1]}" if isinstance(v, mx.Dtype) else f"_{int(v)}"
                  for _, v in template)
    args = ([f"const {CUDA_TYPES[dt][0]}* {n}" for n, dt in inputs]
            + [f"{CUDA_TYPES[dt][0]}* {n}" for n, dt in outputs])
    return ("namespace mlx::core::cu {\n"
            f"__global__ void __launch_bounds__({threads}, {min_blocks}) "
            f"custom_kernel_{name}{tag}({', '.join(args)});\n"
            "}  // namespace mlx::core::cu\n")


_BOUNDED: dict = {}


def _mma_kernel(template, input_dtypes, min_blocks: int):
    """The MMA split kernel compiled for `min_blocks` resident blocks (0: unbounded)."""
    if min_blocks <= 0 or ATTEND_MMA_KERNEL is None:  # unbounded, or no CUDA here
        return ATTEND_MMA_KERNEL
    key = (tuple(template), tuple(input_dtypes), min_blocks)
    kernel = _BOUNDED.get(key)
    if kernel is None:
        decl = bounded_declaration("kivi_attend_split_mma", template,
                                   list(zip(ATTEND_INPUTS, input_dtypes)),
                                   [(n, mx.float32) for n in ATTEND_OUTPUTS],
                                   WARPS * 32, min_blocks)
        kernel = _BOUNDED[key] = mx.fast.cuda_kernel(
            name="kivi_attend_split_mma", input_names=ATTEND_INPUTS,
            output_names=ATTEND_OUTPUTS, source=compact(ATTEND_MMA_SOURCE),
            header=kernel_header(HEADER, ATTEND_MMA_SOURCE) + decl)
    return kernel


# ---- one decode step's launches ------------------------------------------------------
MERGE_WARPS = 16  # most warps of a merge block (its shared memory is sized for them)

# Where the launches' small inputs live. MLX keeps every host-made array in managed
# memory (cudaMallocManaged), and arrays of 8 bytes or less (the query scale; B = 1's
# lengths and slot) in one shared pool that the host keeps writing. A CUPTI trace put
# a fixed ~23 us into every split launch from B = 1 to B = 32: the cost of reading
# those pages from the GPU. "device" (default) copies them once per plan, i.e. once
# per decode step, into one device-memory array made by a GPU op, and every layer's
# launches read views of it: the B = 1 split kernel went from 29-38 to 13-24 us, with
# bit-identical outputs (docs/benchmarks.md, session 11). "host" passes them as made.
# The fused flush does the same (`flush_meta`); there it measured within the noise.
META_ENV = "KIVIQ_KIVI_META"


def _meta_on_device() -> bool:
    return os.environ.get(META_ENV, "device").lower() != "host"


def device_meta(meta: list, params_new: mx.array) -> tuple[list, list]:
    """`meta` and its new-token twin as views of one device array: a concatenation is
    a GPU op, so its output is device memory (over 8 bytes: params alone is 24), read
    from managed memory once here instead of by every warp of every layer."""
    block_tables, num_blocks, slots, tail_lens, params, qscale = meta
    views = _packed_views([block_tables, num_blocks, slots, tail_lens, params, params_new])
    scales = mx.concatenate([qscale] * 4)  # 16 bytes: past the 8-byte shared pool
    return views[:5] + [scales], views[:4] + [views[5], scales]


def _packed_views(ints: list) -> list:
    """The int32 arrays `ints` as views (same shapes) of one array made on the device."""
    packed = mx.concatenate([a.reshape(-1).astype(mx.int32) for a in ints])
    views, at = [], 0
    for a in ints:
        views.append(packed[at:at + a.size].reshape(a.shape))
        at += a.size
    return views


def merge_warps(num_splits: int) -> int:
    """Warps per merge block: about 8 splits per warp, 1 .. MERGE_WARPS."""
    return max(1, min(MERGE_WARPS, -(-num_splits // 8)))


class AttendPlan:
    """The launches of one decode step's attention, for every layer of a model.

    Built once per step from the shapes and the step's small int arrays (block
    tables, lengths: the same in every layer); calling it with a layer's q and pool
    only launches the split kernel and the merge. Building it (support checks, split
    plan, templates, argument lists) cost ~45 us of Python per layer when it was redone
    for every layer (H200: 66 -> 21 us build per layer, docs/benchmarks.md).
    """

    __slots__ = ("split", "split_kw", "merge_kw", "meta", "meta_new", "params")

    def __init__(self, q_shape, q_dtype, pool: KiviPool, block_tables, num_blocks, slots,
                 tail_lens, *, scale: float, bits: int, group_size: int):
        out_shape = tuple(q_shape)  # [B, H_q, D], or [B, H_q, 1, D]: the same memory
        q_shape = (q_shape[0], q_shape[1], q_shape[-1])
        b, h_q, d = q_shape
        mma = mma_supports(q_shape, pool, bits, group_size) is None
        self.meta, self.split_kw, nsu, rep = attend_launch(
            q_shape, q_dtype, pool, block_tables, num_blocks, slots, tail_lens, scale=scale,
            bits=bits, group_size=group_size, step_tokens=MMA_STEP_TOKENS if mma else STEP_TOKENS)
        # The same launch, with params[5] = 1: the new token comes with the call.
        self.meta_new = [*self.meta[:4], _const(_const_values(self.meta[4])[:5] + (1,), mx.int32), self.meta[5]]
        if _meta_on_device():
            self.meta, self.meta_new = device_meta(self.meta, self.meta_new[4])
        self.params = self.meta[4]
        template, merge_template = attend_templates(q_dtype, pool, bits=bits,
                                                    group_size=group_size, rep=rep)
        if mma:
            template = template + [("FOLD", int(fold_applies(pool)))]
            min_blocks = int(os.environ.get(MIN_BLOCKS_ENV, MMA_MIN_BLOCKS))
            dtypes = [q_dtype, *(a.dtype for a in pool), *(a.dtype for a in self.meta),
                      pool.tail_k.dtype, pool.tail_v.dtype]
            self.split = _mma_kernel(template, dtypes, min_blocks)
        else:
            self.split = ATTEND_KERNEL
        self.split_kw["template"] = template
        mw = merge_warps(nsu)
        self.merge_kw = dict(
            template=merge_template + [("MERGE_WARPS", MERGE_WARPS)],
            grid=(b * h_q * mw * 32, 1, 1),
            threadgroup=(mw * 32, 1, 1),
            output_shapes=[out_shape],
            output_dtypes=[q_dtype],
        )

    def __call__(self, q: mx.array, pool: KiviPool, k_new: mx.array | None = None,
                 v_new: mx.array | None = None) -> mx.array:
        """Attention of q over `pool`. With `k_new`, `v_new` ([B, H_kv, D] or the
        model's [B, H_kv, 1, D], the step's new token, in the pool's dtype) the tail's
        last row (tail_lens - 1) is read from them and written into the pool by the
        kernel (KIVI_TAIL_CHUNK): the caller writes no tail. Without them that row must
        already hold the token."""
        if k_new is None:
            inputs = [q, *pool, *self.meta, pool.tail_k, pool.tail_v]  # never read: params[5] = 0
        else:
            inputs = [q, *pool, *self.meta_new, k_new, v_new]
        part_acc, part_ml = self.split(inputs=inputs, **self.split_kw)
        return MERGE_KERNEL(inputs=[part_acc, part_ml, self.params], **self.merge_kw)[0]


def kivi_decode_attend(
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
    """One decode step of attention over the KIVI pool: 2 CUDA launches.

    Same contract as `kernels.kivi_reference.decode_attention`. The split kernel is
    the tensor-core one where `mma_supports` says so (K/V dequantized to the pool's
    dtype, then MMA with float32 accumulation), else the CUDA-core one (float32).
    A caller that attends several layers with the same metadata builds one
    `AttendPlan` and calls it per layer instead.

    Args:
        q: [B, H_q, D] fp16/bf16/fp32, RoPE applied.
        pool: the layer's KiviPool (fp16 or bf16 scales and tails), passed whole.
        block_tables: int32 [B, max_blocks]; entries past num_blocks[b] are never read.
        num_blocks: int32 [B].
        slots: int32 [B].
        tail_lens: int32 [B], including the current token.
        scale: softmax scale.
        bits: b in {2, 4, 8}.
        group_size: G.

    Returns:
        [B, H_q, D] in q's dtype.
    """
    if ATTEND_KERNEL is None:
        raise RuntimeError("MLX's CUDA backend is not available")
    if q.shape[0] == 0:
        return mx.zeros(q.shape, dtype=q.dtype)
    plan = AttendPlan(q.shape, q.dtype, pool, block_tables, num_blocks, slots, tail_lens,
                      scale=scale, bits=bits, group_size=group_size)
    return plan(q, pool)


def flush_prepare(pool: KiviPool, slots, new_block_ids, tail_lens, *, bits: int,
                  group_size: int):
    """Validate like `flush_tails`; returns (slots, ids) as int32 arrays, or None if F=0."""
    d = pool.k_codes.shape[2]
    if d not in HEAD_DIMS:
        raise ValueError(f"flush kernel: head_dim {d} not in {HEAD_DIMS}")
    return check_flush_args(pool, slots, new_block_ids, tail_lens, bits=bits, group_size=group_size)


def flush_apply(pool: KiviPool, slots, ids, rows_k, rows_v, quantized, group_size):
    """Shift the tails and scatter the new blocks, in place (see `flush_tails`)."""
    shifted = [shifted_tail(r, group_size) for r in (rows_k, rows_v)]
    # Every read of the pool (the gathers, the kernel) is finished before any write,
    # so the scatters below update the pool's buffers in place instead of copying.
    mx.eval(*quantized, *shifted)
    write_flushed(pool, slots, ids, *shifted, quantized)
    return pool


def _flush_template(pool: KiviPool, *, bits, group_size) -> list:
    """The compile-time constants of both flush kernels."""
    return [("SD", pool.k_scales.dtype), ("D", pool.tail_k.shape[-1]), ("G", group_size), ("BITS", bits)]


def flush_launch(pool: KiviPool, rows_k, *, bits, group_size):
    """(launch, template, params) of the gather flush kernel (FLUSH_SOURCE) for n
    entries of rows, rows_k [n, H_kv, T, D] (each entry's first G rows become a new
    block): one thread block per (new block, kv head) of D threads, and the six block
    arrays as outputs."""
    n = rows_k.shape[0]
    _, h_kv, _, d = pool.tail_k.shape
    g, p = group_size, 8 // bits
    sd = pool.k_scales.dtype
    launch = dict(
        grid=(n * h_kv * d, 1, 1),
        threadgroup=(d, 1, 1),
        output_shapes=[(n, h_kv, d, g // p), (n, h_kv, d), (n, h_kv, d),
                       (n, h_kv, g, d // p), (n, h_kv, g, d // g), (n, h_kv, g, d // g)],
        output_dtypes=[mx.uint8, sd, sd, mx.uint8, sd, sd],
    )
    template = _flush_template(pool, bits=bits, group_size=group_size)
    return launch, template, _const((rows_k.shape[2],), mx.int32)


def flush_meta(pool: KiviPool, slots: mx.array, ids: mx.array, blocks_per_slot: int = 1) -> tuple:
    """(slots, ids, params) of `fused_flush` for every layer of a flush: as views of one
    device array unless KIVIQ_KIVI_META=host (see `device_meta`: read once per flush
    instead of by every layer's launch)."""
    _, h_kv, rg, _ = pool.tail_k.shape
    params = _const((rg, h_kv, blocks_per_slot), mx.int32)
    if not _meta_on_device():
        return slots, ids, params
    return tuple(_packed_views([slots, ids, params]))


def fused_flush(pool: KiviPool, slots: mx.array, ids: mx.array, *, bits, group_size,
                blocks_per_slot: int = 1, meta: tuple | None = None) -> mx.array:
    """The in-place fused flush of one layer (FLUSH_FUSED_SOURCE: read its comment for
    the ordering the caller owns): k = blocks_per_slot new blocks per flushing slot at
    ``ids``, tails shifted. `meta`: `flush_meta`'s result, made once for all layers.
    Returns the launch's `done` array; evaluating it writes the pool."""
    f, k = slots.shape[0], blocks_per_slot
    _, h_kv, rg, d = pool.tail_k.shape
    slots, ids, params = meta if meta is not None else flush_meta(pool, slots, ids, k)
    return FLUSH_FUSED_KERNEL(
        inputs=[*pool, slots, ids, params],
        template=_flush_template(pool, bits=bits, group_size=group_size),
        grid=(f * h_kv * d, 1, 1), threadgroup=(d, 1, 1),
        output_shapes=[(1,)], output_dtypes=[mx.int32])[0]


def kivi_flush(
    pool: KiviPool,
    slots: mx.array,
    new_block_ids: mx.array,
    tail_lens: mx.array,
    *,
    bits: int,
    group_size: int = 32,
) -> KiviPool:
    """Quantize the oldest G tail tokens of some slots into new blocks; shift tails.

    Same contract as `kernels.kivi_reference.flush_tails` (one quantize launch for
    every flushing slot, K and V; codes/scales/zeros bit-identical to the reference).

    Returns:
        The same pool object, its arrays updated in place.
    """
    if FLUSH_KERNEL is None:
        raise RuntimeError("MLX's CUDA backend is not available")
    prepared = flush_prepare(pool, slots, new_block_ids, tail_lens, bits=bits,
                             group_size=group_size)
    if prepared is None:
        return pool
    slots, ids = prepared
    rows_k, rows_v = pool.tail_k[slots], pool.tail_v[slots]
    launch, template, params = flush_launch(pool, rows_k, bits=bits, group_size=group_size)
    quantized = FLUSH_KERNEL(inputs=[rows_k, rows_v, params], template=template, **launch)
    return flush_apply(pool, slots, ids, rows_k, rows_v, quantized, group_size)


__all__ = ["kivi_decode_attend", "kivi_flush", "split_plan", "supports"]
