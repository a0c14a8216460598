// Device helpers of the tensor-core split kernel (attend_split_mma.cu): MMA operands,
// dequantization and folding of 4-code units, cp.async staging of lane-order tiles.
// Read after kivi.cuh as one header (kernels.cuda_source.HEADER), same grammar.
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

// Stage one (block, kv head) tile into dst: [k codes][v codes][k scales][k zeros]
// [v scales][v zeros], all contiguous in global memory per tile; the codes in lane order.
template <typename SD, int D, int KTILE, int VTILE>
__device__ __forceinline__ void kivi_stage_tile(uint8_t* dst, int lane, size_t tile,
                                                const uint8_t* k_codes, const uint8_t* v_codes,
                                                const SD* k_scales, const SD* k_zeros,
                                                const SD* v_scales, const SD* v_zeros) {
  constexpr int SC = D / 8;  // 16-byte chunks of one scale or zero array (D values)
  constexpr int C = KTILE / 16 / 32;  // chunks per lane
  const uint8_t* kc = k_codes + tile * KTILE;
  const uint8_t* vc = v_codes + tile * VTILE;
  for (int i = lane; i < KTILE / 16; i += 32) kivi_cp16(dst + kivi_lane_chunk<C>(i) * 16, kc + i * 16);
  for (int i = lane; i < VTILE / 16; i += 32) kivi_cp16(dst + KTILE + kivi_lane_chunk<C>(i) * 16, vc + i * 16);
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
