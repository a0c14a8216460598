// Decode attention's inputs from the fused q/k/v projection in one launch (kivi_qk_rope):
// the split into heads, Qwen3's q/k RMSNorm (NORM = 1) and rotate-half RoPE, which
// mlx-lm runs as three strided copies, two rms_norm and two rope launches per layer.
// With ROTATE = 1 (a 2r cache) q, k and v leave rotated along D by the normalized
// Hadamard matrix, as mx.hadamard_transform would rotate the three outputs: the ops a
// rotated store added per layer, in the same launch.
// Inputs: qkv T [B, 1, (HQ + 2 HKV) * D] (row-contiguous, one token per sequence),
// q_weight / k_weight T [D] (the norms' weights; unread when NORM = 0), offsets int32
// [B] (each sequence's RoPE position), params float [3] = (eps, log2(rope base), rope
// scale). Outputs: q [B, HQ, 1, D], k and v [B, HKV, 1, D]. T is fp16 or bf16.
// Grid: one warp per (head, sequence): blockIdx.x = head of the fused row (q heads, then
// k heads, then v heads), blockIdx.y = sequence; lane l < D / 8 holds values 8l .. 8l+7.
// Bit-exact with MLX 0.32's kernels, so tokens do not change: the norm sums each
// lane's 8 squares in order (fma), then adds the lanes in the butterfly order of
// cooperative_groups::reduce (xor 16, 8, 4, 2, 1), as MLX's rms_norm_small does with 8
// values per thread; y = w * T(x * rsqrt(mean + eps)) with the same two roundings; RoPE
// computes its angle, cos, sin and both rotated values with MLX's expressions, in
// float, from the normed values as rounded to T. The rotation is MLX 0.32's CUDA
// hadamard_n for D = 64 and 128 (one radix-16 pass, then one radix-D/16 pass, each
// adding in float and rounding to T, then T(x * scale)): the same additions of the
// same operands, across lanes by shuffles.
  constexpr int LANES = D / 8;   // lanes holding values
  constexpr int PAIR = D / 16;   // RoPE pairs value i with i + D/2: lane l with lane l ^ PAIR
  static_assert(D == 64 || D == 128, "qk_rope: head_dim 64 or 128");
  const int lane = threadIdx.x;
  const int head = blockIdx.x;
  const int b = blockIdx.y;
  const bool holds = lane < LANES;
  const T* src = qkv + (size_t)b * (HQ + 2 * HKV) * D + (size_t)head * D + 8 * lane;
  const uint4 raw = holds ? kivi_ld16(src) : make_uint4(0u, 0u, 0u, 0u);
  if (head >= HQ + HKV) {  // a value head: copied as it is (rotated with ROTATE)
    const uint4 out = ROTATE ? kivi_hadamard_row<T, D>(raw) : raw;
    if (holds) *reinterpret_cast<uint4*>(v + ((size_t)b * HKV + head - HQ - HKV) * D + 8 * lane) = out;
    return;
  }
  const bool is_q = head < HQ;
  float x[8];
  kivi_unpack8f<T>(raw, x);
  if constexpr (NORM) {
    float s = 0.0f;
#pragma unroll
    for (int j = 0; j < 8; ++j) s = fmaf(x[j], x[j], s);
#pragma unroll
    for (int m = 16; m > 0; m >>= 1) s = s + __shfl_xor_sync(KIVI_FULL, s, m);
    const float r = rsqrtf(s / float(D) + params[0]);
    float w[8];
    kivi_unpack8f<T>(holds ? kivi_ld16((is_q ? q_weight : k_weight) + 8 * lane) : raw, w);
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const float y = kivi_f(kivi_from_f<T>(x[j] * r));
      x[j] = kivi_f(kivi_from_f<T>(w[j] * y));  // exact product, one rounding (as T * T)
    }
  }
  const bool first = (lane % LANES) < PAIR;  // holds the first half of its pairs
  const float pos = params[2] * static_cast<float>(offsets[b]);
  uint32_t packed[4];
#pragma unroll
  for (int j = 0; j < 8; j += 2) {
    float o[2];
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const float other = __shfl_xor_sync(KIVI_FULL, x[j + e], PAIR);
      const float x1 = first ? x[j + e] : other;
      const float x2 = first ? other : x[j + e];
      const float d = static_cast<float>(8 * (lane % PAIR) + j + e) / static_cast<float>(D / 2);
      const float inv_freq = exp2f(-d * params[1]);
      const float theta = pos * inv_freq;
      const float costheta = cosf(theta);
      const float sintheta = sinf(theta);
      // MLX's x1 * cos - x2 * sin and x1 * sin + x2 * cos as nvcc contracted them
      // there; written out, since the select above lets the compiler contract
      // another product here (1 ulp apart, seen in fp16).
      const float rx1 = fmaf(x1, costheta, -(x2 * sintheta));
      const float rx2 = fmaf(x1, sintheta, x2 * costheta);
      o[e] = first ? rx1 : rx2;
    }
    packed[j / 2] = kivi_pack2f<T>(o[0], o[1]);
  }
  uint4 out = make_uint4(packed[0], packed[1], packed[2], packed[3]);
  if constexpr (ROTATE) out = kivi_hadamard_row<T, D>(out);
  if (holds) {
    T* dst = is_q ? q + ((size_t)b * HQ + head) * D : k + ((size_t)b * HKV + head - HQ) * D;
    *reinterpret_cast<uint4*>(dst + 8 * lane) = out;
  }
