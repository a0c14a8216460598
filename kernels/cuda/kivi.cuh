// Device helpers of the KIVI CUDA kernels, prefixed kivi_ / KIVI_ (outside MLX's namespace).
//
// Each kernel gets only the items its source reaches (kernels.cuda_source.kernel_header),
// comments and indentation stripped. The grammar that pruning relies on: every top-level
// item is a preprocessor line (with backslash continuations) or a declaration /
// definition ending at a `;` or `}` at brace depth 0; an item defines the first kivi_* /
// KIVI_* name it mentions; `//` only ever starts a comment.
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

// Two floats rounded to fp16/bf16 (to nearest) and packed in one word, lo first.
template <typename SD> __device__ __forceinline__ uint32_t kivi_pack2f(float lo, float hi);
template <> __device__ __forceinline__ uint32_t kivi_pack2f<__half>(float lo, float hi) {
  const __half2 v = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}
template <> __device__ __forceinline__ uint32_t kivi_pack2f<__nv_bfloat16>(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

// 8 fp16/bf16 values plus 8 others, each sum rounded once to SD: MLX's add (SD + SD).
template <typename SD>
__device__ __forceinline__ uint4 kivi_add8(const uint4 a, const uint4 b) {
  uint4 o;
  const SD* x = reinterpret_cast<const SD*>(&a);
  const SD* y = reinterpret_cast<const SD*>(&b);
  SD* z = reinterpret_cast<SD*>(&o);
#pragma unroll
  for (int k = 0; k < 8; ++k) z[k] = __hadd(x[k], y[k]);
  return o;
}

// A row of D values (D = 64 or 128) held by a warp's first D / 8 lanes, 8 each (lane l:
// values 8l .. 8l+7, as floats that SD holds exactly), times the normalized
// Sylvester-Hadamard matrix, in place, exactly as MLX 0.32's CUDA hadamard_transform
// computes it for SD rows: butterflies (x[j], x[j + h]) -> (a + b, a - b) in float over
// strides 1 .. 8, rounded to SD, over strides 16 .. D/2, rounded to SD, then
// SD(x * scale), scale = 1 / sqrt(D) computed as MLX does (in double, rounded to float).
// SD may be float (no rounding). Strides of 8 and more pair a lane with lane ^ (stride
// / 8); every lane of the warp must call it.
template <typename SD, int D>
__device__ __forceinline__ void kivi_hadamard8(float* x) {
  static_assert(D == 64 || D == 128, "kivi_hadamard8: D is 64 or 128");
  const int lane = threadIdx.x & 31;
  const float scale = static_cast<float>(1.0 / sqrt(static_cast<double>(D)));
#pragma unroll
  for (int h = 1; h < 8; h <<= 1) {
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      if ((j & h) == 0) {
        const float a = x[j], b = x[j + h];
        x[j] = a + b;
        x[j + h] = a - b;
      }
    }
  }
#pragma unroll
  for (int m = 1; m < D / 8; m <<= 1) {  // stride 8m; the lane with bit m set holds b
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const float other = __shfl_xor_sync(KIVI_FULL, x[j], m);
      x[j] = (lane & m) ? other - x[j] : x[j] + other;
    }
    if (m == 1 || m == D / 16) {  // the end of a pass: MLX keeps its rows in SD between passes
#pragma unroll
      for (int j = 0; j < 8; ++j) x[j] = kivi_f(kivi_from_f<SD>(x[j]));
    }
  }
#pragma unroll
  for (int j = 0; j < 8; ++j) x[j] = kivi_f(kivi_from_f<SD>(x[j] * scale));
}

// kivi_hadamard8 of 8 fp16/bf16 values packed in 16 bytes, packed again.
template <typename SD, int D>
__device__ __forceinline__ uint4 kivi_hadamard_row(const uint4 in) {
  float x[8];
  kivi_unpack8f<SD>(in, x);
  kivi_hadamard8<SD, D>(x);
  return make_uint4(kivi_pack2f<SD>(x[0], x[1]), kivi_pack2f<SD>(x[2], x[3]), kivi_pack2f<SD>(x[4], x[5]),
                    kivi_pack2f<SD>(x[6], x[7]));
}

// 8 consecutive fp16/bf16 values (16 bytes, aligned) as floats.
template <typename SD>
__device__ __forceinline__ void kivi_load8f(const SD* p, float* x) {
  kivi_unpack8f<SD>(__ldg(reinterpret_cast<const uint4*>(p)), x);
}

__device__ __forceinline__ uint4 kivi_ld16(const void* p) {
  return __ldg(reinterpret_cast<const uint4*>(p));
}

// 16 bytes from global or shared memory (a generic load; kivi_ld16 reads global only).
__device__ __forceinline__ uint4 kivi_ld16_any(const void* p) {
  return *reinterpret_cast<const uint4*>(p);
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

// Lane order (kernels/layout.py): tiles of G = 32 tokens at 2 or 4 bits, D 64 or 128,
// keep their 4-code units where the tensor-core kernel's lane loads them as words.
// Unit i of a lane's four (channels or tokens c0..c3 of one k-tile) sits at slot
// kivi_lane_ord<BITS>(i): c0, c2, c1, c3 at 2 bits (bytes; see kivi_lane_operands),
// c0..c3 at 4 bits (16-bit units).
template <int BITS, int G, int D> __device__ __forceinline__ constexpr bool kivi_lane_order() {
  return (BITS == 2 || BITS == 4) && G == 32 && (D == 64 || D == 128);
}
template <int BITS> __device__ __forceinline__ constexpr int kivi_lane_ord(int i) {
  return BITS == 2 ? (((i & 1) << 1) | (i >> 1)) : i;
}
// Unit index of key unit u (tokens 4u .. 4u+3) of channel c, and of value unit u
// (channels 4u .. 4u+3) of token t, within a lane-order tile (times BITS / 2: bytes).
template <int D, int BITS> __device__ __forceinline__ int kivi_lane_k(int c, int u) {
  return ((u * 4 + ((c & 15) >> 2)) * (D / 16) + (c >> 4)) * 4 + kivi_lane_ord<BITS>(c & 3);
}
template <int D, int BITS> __device__ __forceinline__ int kivi_lane_v(int t, int u) {
  return ((((u & 7) * 4 + (t >> 3)) * (D / 32) + (u >> 3)) * 2 + ((t & 7) >> 2)) * 4 +
         kivi_lane_ord<BITS>(t & 3);
}
// Store unit `unit` (4 codes, low bits first) at unit index i of a lane-order tile.
template <int BITS> __device__ __forceinline__ void kivi_lane_store(uint8_t* tile, int i, uint32_t unit) {
  if constexpr (BITS == 2) {
    tile[i] = (uint8_t)unit;
  } else {
    reinterpret_cast<unsigned short*>(tile)[i] = (unsigned short)unit;
  }
}

// N consecutive values' codes, packed low bits first (one 4-code unit or one word).
template <typename SD, int BITS, int N>
__device__ __forceinline__ uint32_t kivi_pack_codes(const SD* x, float zf, float sf) {
  uint32_t packed = 0u;
#pragma unroll
  for (int j = 0; j < N; ++j) packed |= kivi_quantize<BITS>(kivi_f(x[j]), zf, sf) << (j * BITS);
  return packed;
}

// One new block of one kv head, thread d of D: the key group of channel d (the G
// rows of rk) and the value group d (token d / NG, channel group d % NG of the rows
// of rv; its scale and zero stored group-major, at gi * G + t), written at output index fh (= new block * H_kv + kv head). Shared by both
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
  // in flight per thread (~89 us per layer at one flushing slot).
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
    if constexpr (kivi_lane_order<BITS, G, D>()) {  // a unit (4 tokens) at a time
#pragma unroll
      for (int u = 0; u < G / 4; ++u)
        kivi_lane_store<BITS>(k_codes + (size_t)fh * D * (G / P), kivi_lane_k<D, BITS>(d, u),
                              kivi_pack_codes<SD, BITS, 4>(xk + 4 * u, zf, sf));
    } else {
      uint32_t* dst = reinterpret_cast<uint32_t*>(k_codes + ((size_t)fh * D + d) * (G / P));
#pragma unroll
      for (int w = 0; w < G / CPW; ++w) dst[w] = kivi_pack_codes<SD, BITS, CPW>(xk + w * CPW, zf, sf);
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
    if constexpr (kivi_lane_order<BITS, G, D>()) {  // a unit (4 channels) at a time
#pragma unroll
      for (int u = 0; u < G / 4; ++u)
        kivi_lane_store<BITS>(v_codes + (size_t)fh * G * (D / P), kivi_lane_v<D, BITS>(t, gi * (G / 4) + u),
                              kivi_pack_codes<SD, BITS, 4>(xv + 4 * u, zf, sf));
    } else {
      uint32_t* dst = reinterpret_cast<uint32_t*>(v_codes + ((size_t)fh * G + t) * (D / P) + gi * (G / P));
#pragma unroll
      for (int w = 0; w < G / CPW; ++w) dst[w] = kivi_pack_codes<SD, BITS, CPW>(xv + w * CPW, zf, sf);
    }
    v_scales[(size_t)fh * D + gi * G + t] = scale;
    v_zeros[(size_t)fh * D + gi * G + t] = zero;
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
// steps (no other warp reads that row in this step: see KIVI_TAIL_CHUNK). kn and vn may
// be in shared memory (the decode prologue's rows): read with generic loads.
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
      *reinterpret_cast<uint4*>(const_cast<SD*>(tk) + (size_t)nr * D + 8 * i) = kivi_ld16_any(kn + 8 * i);
      *reinterpret_cast<uint4*>(const_cast<SD*>(tv) + (size_t)nr * D + 8 * i) = kivi_ld16_any(vn + 8 * i);
    }
  }
  if (valid) {
    const SD* row = tk + (size_t)lane * D;
    const bool mine = lane == nr;
#pragma unroll 1
    for (int d0 = 0; d0 < D; d0 += 8 * KB) {
      uint4 raw[KB];
#pragma unroll
      for (int i = 0; i < KB; ++i) raw[i] = mine ? kivi_ld16_any(kn + d0 + 8 * i) : kivi_ld16(row + d0 + 8 * i);
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
      raw[i] = t >= n ? make_uint4(0u, 0u, 0u, 0u)
                      : (t == nr ? kivi_ld16_any(vn + cc * 8) : kivi_ld16(tv + (size_t)t * D + cc * 8));
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
