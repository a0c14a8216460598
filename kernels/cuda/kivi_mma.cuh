// Device helpers of the tensor-core split kernel (attend_split_mma.cu): MMA operands,
// folding of 4-code units, cp.async staging of lane-order tiles.
// Read after kivi.cuh as one header (kernels.cuda_source.HEADER), same grammar.
template <typename A, typename B> struct kivi_same { static constexpr bool value = false; };
template <typename A> struct kivi_same<A, A> { static constexpr bool value = true; };

// (w & MASK) | MAGIC as one LOP3 (ptxas emitted an AND and an OR for the plain C++).
template <uint32_t MASK, uint32_t MAGIC>
__device__ __forceinline__ uint32_t kivi_and_or(uint32_t w) {
  uint32_t r;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(r) : "r"(w), "r"(MASK), "r"(MAGIC));
  return r;
}

// The scale moves onto the other MMA operand and the zero into a separate MMA, so no
// code is dequantized: code j of each 16-bit half of a unit word w becomes the exact SD
// number x_j = OFF_j + code * 2^-U_j (kivi_codes4), one LOP3 (and a shift where noted)
// per pair of codes, and the caller turns an MMA sum S_j over x_j * b into the sum over
// code * b as (S_j - OFF_j * sum(b)) * 2^U_j (kivi_code_offset, kivi_code_unit).
//   fp16: the code stays at its bit position P_j with a zero exponent field, the
//     subnormal code * 2^(P_j - 24): OFF 0, U_j = 24 - P_j. No shift at 2 bits, one per
//     word at 4 bits.
//   bf16: a subnormal (2^-133) would underflow float32 products, and a code must sit in
//     the 7-bit mantissa, so it goes to bit P_j <= 7 - BITS of 2^(7 - P_j):
//     x_j = 2^(7 - P_j) + code, OFF_j = 2^(7 - P_j), U_j = 0. Shifts bring codes 3
//     (2 bits) and 1, 2, 3 (4 bits) into range; the caller's sum(b) is one more MMA
//     with a matrix of ones.
template <typename SD, int BITS> __device__ __forceinline__ constexpr int kivi_code_pos(int j) {
  if constexpr (kivi_same<SD, __half>::value) return BITS == 2 ? 2 * j : 4 * (j & 1);
  else return BITS == 2 ? (j == 3 ? 4 : 2 * j) : 3 * (j & 1);
}
template <typename SD, int BITS> __device__ __forceinline__ constexpr float kivi_code_unit(int j) {
  return kivi_same<SD, __half>::value ? float(1 << (24 - kivi_code_pos<SD, BITS>(j))) : 1.0f;
}
template <typename SD, int BITS> __device__ __forceinline__ constexpr float kivi_code_offset(int j) {
  return kivi_same<SD, __half>::value ? 0.0f : float(1 << (7 - kivi_code_pos<SD, BITS>(j)));
}
// 1.0 in both halves (the matrix of ones for sum(b); bf16 only).
constexpr uint32_t KIVI_ONES_BF16 = 0x3F803F80u;

// The caller's side of the fold for code position j: (s - OFF_j * sum_b) * 2^U_j * scale
// + add, where s is an MMA sum over x_j * b and sum_b the same MMA's sum over b (bf16;
// unused for fp16, whose codes carry no offset).
template <typename SD, int BITS>
__device__ __forceinline__ float kivi_unfold(int j, float s, float sum_b, float scale, float add) {
  if constexpr (!kivi_same<SD, __half>::value) s = fmaf(-kivi_code_offset<SD, BITS>(j), sum_b, s);
  return fmaf(s, scale * kivi_code_unit<SD, BITS>(j), add);
}

// 2^(7 - P_j) as bf16 in both halves (the exponent field 127 + 7 - P_j, an empty
// mantissa): the base kivi_codes4 ors code j into.
template <typename SD, int BITS> __device__ __forceinline__ constexpr uint32_t kivi_bf16_base(int j) {
  return ((134u - kivi_code_pos<SD, BITS>(j)) << 7) * 0x00010001u;
}

template <typename SD, int BITS>
__device__ __forceinline__ void kivi_codes4(uint32_t w, uint32_t (&x)[4]) {
  constexpr uint32_t M = ((1u << BITS) - 1u) * 0x00010001u;
  if constexpr (kivi_same<SD, __half>::value) {
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
  } else {
    if constexpr (BITS == 2) {  // codes at bits 0, 2, 4, 6: code 3 moves to bit 4
      x[0] = kivi_and_or<M, kivi_bf16_base<SD, BITS>(0)>(w);
      x[1] = kivi_and_or<M << 2, kivi_bf16_base<SD, BITS>(1)>(w);
      x[2] = kivi_and_or<M << 4, kivi_bf16_base<SD, BITS>(2)>(w);
      x[3] = kivi_and_or<M << 4, kivi_bf16_base<SD, BITS>(3)>(w >> 2);
    } else {  // codes at bits 0, 4, 8, 12: to 0, 3, 0, 3
      x[0] = kivi_and_or<M, kivi_bf16_base<SD, BITS>(0)>(w);
      x[1] = kivi_and_or<M << 3, kivi_bf16_base<SD, BITS>(1)>(w >> 1);
      x[2] = kivi_and_or<M, kivi_bf16_base<SD, BITS>(2)>(w >> 8);
      x[3] = kivi_and_or<M << 3, kivi_bf16_base<SD, BITS>(3)>(w >> 9);
    }
  }
}

// Two SD products, rounded once each (the folded operand: q * scale, p * scale).
template <typename SD>
__device__ __forceinline__ uint32_t kivi_hmul2(uint32_t a, uint32_t b) {
  if constexpr (kivi_same<SD, __half>::value) {
    __half2 r = __hmul2(*reinterpret_cast<const __half2*>(&a), *reinterpret_cast<const __half2*>(&b));
    return *reinterpret_cast<uint32_t*>(&r);
  } else {
    __nv_bfloat162 r = __hmul2(*reinterpret_cast<const __nv_bfloat162*>(&a),
                               *reinterpret_cast<const __nv_bfloat162*>(&b));
    return *reinterpret_cast<uint32_t*>(&r);
  }
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

// A lane's code words of a staged lane-order tile: LW / 4 16-byte chunks, lane l's at
// chunks C l .. C l + C - 1 (C = LW / 4). The 8 lanes of one quarter-warp's 16-byte
// loads would hit the same banks for C > 1, so chunk h of lane l is staged at
// C l + (h ^ ((C l / 8) % C)) (kivi_lane_chunk): a bijection, conflict-free.
template <int C> __device__ __forceinline__ int kivi_lane_chunk(int i) { return i ^ ((i >> 3) & (C - 1)); }

template <int LW>
__device__ __forceinline__ void kivi_lane_words(const uint8_t* tile, int lane, uint32_t (&w)[LW]) {
  constexpr int C = LW / 4;
  const uint4* src = reinterpret_cast<const uint4*>(tile) + lane * C;
#pragma unroll
  for (int h = 0; h < C; ++h) {
    const uint4 v = src[h ^ (((lane * C) >> 3) & (C - 1))];
    w[4 * h] = v.x;
    w[4 * h + 1] = v.y;
    w[4 * h + 2] = v.z;
    w[4 * h + 3] = v.w;
  }
}

// The two MMA operands' code words of a lane's k-tile (keys) or token quad (values) i:
// units 0|1 and 2|3 (kernels/layout.py). 4 bits: words 2i, 2i + 1. 2 bits: word i holds
// units 0, 2 in its low bytes of each half and 1, 3 in its high bytes, so the word
// itself and the word >> 8 (kivi_codes4 masks the low byte of each half).
template <int BITS>
__device__ __forceinline__ void kivi_lane_operands(const uint32_t* w, int i, uint32_t& a, uint32_t& b) {
  if constexpr (BITS == 2) {
    a = w[i];
    b = w[i] >> 8;
  } else {
    a = w[2 * i];
    b = w[2 * i + 1];
  }
}

// Staging of (block, kv head) tiles into a warp's stages: [k codes][v codes][k scales]
// [k zeros][v scales][v zeros], all contiguous in global memory per tile; the codes in
// lane order. A lane's sources are per-lane bases made once (kivi_stager), so a tile
// costs one IMAD.WIDE per base (base + tile * bytes) and its copies take the rest as
// immediate offsets: a lane's chunks are lane + 32 k (k < C), and chunk lane + 32 k
// sits 512 k bytes after chunk lane on both sides (kivi_lane_chunk's swizzle reads bits
// 3-4 of the chunk index and flips bits 0-1, which 32 k leaves alone; the scales are
// staged in order).
template <typename SD, int D, int KTILE, int VTILE>
struct kivi_stager {
  static constexpr int C = KTILE / 16 / 32;  // code chunks per lane of a K (and a V) tile
  static constexpr int NS = D / 8 * 4 / 32;  // scale and zero chunks per lane
  const uint8_t* kc;
  const uint8_t* vc;
  const uint8_t* sz[NS];
  int code_at;  // the lane's first code chunk in a stage, bytes

  __device__ __forceinline__ kivi_stager(int lane, const uint8_t* k_codes, const uint8_t* v_codes,
                                         const SD* k_scales, const SD* k_zeros, const SD* v_scales,
                                         const SD* v_zeros) {
    constexpr int SC = D / 8;  // 16-byte chunks of one scale or zero array (D values)
    kc = k_codes + lane * 16;
    vc = v_codes + lane * 16;
    code_at = kivi_lane_chunk<C>(lane) * 16;
#pragma unroll
    for (int k = 0; k < NS; ++k) {
      const int i = lane + 32 * k, a = i / SC, c = i % SC;
      const SD* src = (a == 0 ? k_scales : a == 1 ? k_zeros : a == 2 ? v_scales : v_zeros);
      sz[k] = reinterpret_cast<const uint8_t*>(src + c * 8);
    }
  }

  // Stage tile `tile` into dst (a stage of KTILE + VTILE + 4 D sizeof(SD) bytes).
  __device__ __forceinline__ void stage(uint8_t* dst, int lane, uint32_t tile) const {
    const uint8_t* k = kc + (size_t)tile * KTILE;
    const uint8_t* v = vc + (size_t)tile * VTILE;
#pragma unroll
    for (int j = 0; j < C; ++j) kivi_cp16(dst + code_at + 512 * j, k + 512 * j);
#pragma unroll
    for (int j = 0; j < C; ++j) kivi_cp16(dst + KTILE + code_at + 512 * j, v + 512 * j);
#pragma unroll
    for (int j = 0; j < NS; ++j)
      kivi_cp16(dst + KTILE + VTILE + lane * 16 + 512 * j, sz[j] + (size_t)tile * (D * sizeof(SD)));
    kivi_cp_commit();
  }
};

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
