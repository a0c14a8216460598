// The decode prologue of the split attention kernels (kernels/cuda/attend_split_mma.cu,
// attend_split.cu; PRO = 1), after kivi.cuh in the kernels' header (kernels/cuda_source.py
// HEADER): q, k and v of a step's token come as the fused q/k/v projection's row, and
// each thread block turns its kv head's heads into what attention reads: Qwen3's q/k
// RMSNorm (NORM), rotate-half RoPE, and for a 2r cache (ROT_IN) the Hadamard rotation.
// mlx-lm runs that as three strided copies, two rms_norm and two rope launches per
// layer; folded in here it costs no launch (a decode step is host-bound, ~10 us of host
// time per op). Bit-exact with MLX 0.32's kernels,
// so tokens do not change: the norm sums each lane's 8 squares in order (fma), then
// adds the lanes in the butterfly order of cooperative_groups::reduce (xor 16, 8, 4,
// 2, 1), as MLX's rms_norm_small does with 8 values per thread; y = w * T(x * rsqrt(mean
// + eps)) with the same two roundings; RoPE computes its angle, cos, sin and both
// rotated values with MLX's expressions, in float, from the normed values as rounded to
// T; the rotation is kivi_hadamard_row. A head's D values are held by the warp's first
// D / 8 lanes, 8 each (lane l: values 8l .. 8l+7); every lane must call these.

// RoPE's cos and sin at position pos for the D / 2 frequencies, into trig [D] (cos, then
// sin), by the thread block's threads together (every thread of the block must call
// it; a barrier follows). One token's: the same for all of its heads.
template <int D>
__device__ __forceinline__ void kivi_rope_table(float pos, float log2_base, float* trig) {
  const int threads = blockDim.x * blockDim.y * blockDim.z;
  for (int i = threadIdx.x; i < D / 2; i += threads) {
    const float d = static_cast<float>(i) / static_cast<float>(D / 2);
    const float inv_freq = exp2f(-d * log2_base);
    const float theta = pos * inv_freq;
    trig[i] = cosf(theta);
    trig[D / 2 + i] = sinf(theta);
  }
}

// One head of the row, as attention reads it: the lane's 8 values, packed. `value`: a
// value head (only rotated, with ROT_IN); else a q or k head, normed with `weight`
// (NORM) and turned by RoPE (trig from kivi_rope_table).
template <typename T, int D, int NORM, int ROT_IN>
__device__ __forceinline__ uint4 kivi_prologue_head(const T* head, const T* weight, bool value, float eps,
                                                    const float* trig) {
  constexpr int LANES = D / 8;  // lanes holding values
  constexpr int PAIR = D / 16;  // RoPE pairs value i with i + D/2: lane l with lane l ^ PAIR
  static_assert(D == 64 || D == 128, "decode prologue: head_dim 64 or 128");
  const int lane = threadIdx.x & 31;
  const bool holds = lane < LANES;
  const uint4 raw = holds ? kivi_ld16(head + 8 * lane) : make_uint4(0u, 0u, 0u, 0u);
  if (value) return ROT_IN ? kivi_hadamard_row<T, D>(raw) : raw;
  float x[8];
  kivi_unpack8f<T>(raw, x);
  if constexpr (NORM) {
    float s = 0.0f;
#pragma unroll
    for (int j = 0; j < 8; ++j) s = fmaf(x[j], x[j], s);
#pragma unroll
    for (int m = 16; m > 0; m >>= 1) s = s + __shfl_xor_sync(KIVI_FULL, s, m);
    const float r = rsqrtf(s / float(D) + eps);
    float w[8];
    kivi_unpack8f<T>(holds ? kivi_ld16(weight + 8 * lane) : raw, w);
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const float y = kivi_f(kivi_from_f<T>(x[j] * r));
      x[j] = kivi_f(kivi_from_f<T>(w[j] * y));  // exact product, one rounding (as T * T)
    }
  }
  const bool first = (lane % LANES) < PAIR;  // holds the first half of its pairs
  uint32_t packed[4];
#pragma unroll
  for (int j = 0; j < 8; j += 2) {
    float o[2];
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const float other = __shfl_xor_sync(KIVI_FULL, x[j + e], PAIR);
      const float x1 = first ? x[j + e] : other;
      const float x2 = first ? other : x[j + e];
      // MLX's x1 * cos - x2 * sin and x1 * sin + x2 * cos as nvcc contracted them
      // there; written out, since the select above lets the compiler contract
      // another product here (1 ulp apart, seen in fp16).
      const int f = 8 * (lane % PAIR) + j + e;  // the pair's frequency
      const float c = trig[f], sn = trig[D / 2 + f];
      const float rx1 = fmaf(x1, c, -(x2 * sn));
      const float rx2 = fmaf(x1, sn, x2 * c);
      o[e] = first ? rx1 : rx2;
    }
    packed[j / 2] = kivi_pack2f<T>(o[0], o[1]);
  }
  const uint4 out = make_uint4(packed[0], packed[1], packed[2], packed[3]);
  return ROT_IN ? kivi_hadamard_row<T, D>(out) : out;
}

// The decode prologue of a split kernel's thread block (all its warps attend to kv head
// h of sequence b): RoPE's table into trig [D], then the REP query heads into rows
// [REP][D] of T, warp w making heads w, w + NW, ...; every thread of the block must call
// it (two barriers). Computed once per block instead of once per warp: per warp, the
// trigonometry alone made the B=32 x 4k split kernel 27% slower (H100, 20 warps per
// (b, h)). Called, not inlined: inlined, it reshaped the register allocation of the MMA
// kernel's block loop (fp16 2-bit: 513 -> 531 instructions per tile, 520 called;
// `benchmarks/kernel_sass.py --prologue`).
template <typename T, int D, int NORM, int ROT_IN, int REP>
__device__ __noinline__ void kivi_prologue_block(const T* qkv, const T* q_norm, const float* rope,
                                                 const int* offsets, int b, int h, int H_kv, float* trig,
                                                 T* rows) {
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  kivi_rope_table<D>(rope[2] * static_cast<float>(offsets[b]), rope[1], trig);
  __syncthreads();
  const T* row = qkv + (size_t)b * (REP + 2) * H_kv * D + (size_t)h * REP * D;
  for (int r = warp; r < REP; r += blockDim.x >> 5) {
    const uint4 out = kivi_prologue_head<T, D, NORM, ROT_IN>(row + r * D, q_norm, false, rope[0], trig);
    if (lane < D / 8) *reinterpret_cast<uint4*>(rows + r * D + 8 * lane) = out;
  }
  __syncthreads();
}

// kv head h's new k and v rows (b's token) into kn, vn [D] (shared memory), by one warp
// (trig from kivi_prologue_block): what the tail's writer stores and attends to. O is
// the pool's dtype, T's wherever this runs (the split kernels compile it for other
// pairs too).
template <typename T, int D, int NORM, int ROT_IN, int REP, typename O>
__device__ __forceinline__ void kivi_prologue_kv(const T* qkv, const T* k_norm, const float* rope,
                                                 const float* trig, int b, int h, int H_kv, O* kn, O* vn) {
  const int lane = threadIdx.x & 31;
  const T* row = qkv + (size_t)b * (REP + 2) * H_kv * D;
  const uint4 k = kivi_prologue_head<T, D, NORM, ROT_IN>(row + (size_t)(REP * H_kv + h) * D, k_norm, false,
                                                         rope[0], trig);
  const uint4 v = kivi_prologue_head<T, D, NORM, ROT_IN>(row + (size_t)((REP + 1) * H_kv + h) * D, k_norm,
                                                         true, rope[0], trig);
  if (lane < D / 8) {
    *reinterpret_cast<uint4*>(kn + 8 * lane) = k;
    *reinterpret_cast<uint4*>(vn + 8 * lane) = v;
  }
}
