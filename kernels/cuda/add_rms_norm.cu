// A residual add and the RMSNorm after it in one launch (kivi_add_rms_norm): h = x + r,
// y = RMSNorm(h) * w. A decode step runs both between every two blocks of a layer (after
// attention and after the MLP, where the next norm is the next layer's or the final
// one): one launch instead of two, 72 fewer ops per Qwen3-4B step, whose time is mostly
// MLX's host work per op.
// Inputs: x, r T [rows, N] (row-contiguous), w T [N]; eps comes as EPS_BITS, its float32
// bits: a 4-byte input array would sit in MLX's managed pool of small host-made arrays,
// which the GPU pages in on every launch (a launch took 9.3 us instead of ~5).
// Outputs: h, y T [rows, N]. T is fp16 or bf16; N is a multiple of 8.
// Grid: one block of BLOCK threads per row; thread t holds the 8-value vectors t + BLOCK c
// (c < CHUNKS), zeros past N: MLX 0.32's rms_norm_small plan for N (kernels/add_rms_norm.py).
// Bit-exact with MLX's add and rms_norm, so tokens do not change: h = T + T as MLX's add
// rounds it (__hadd); each thread sums its squares in float chunk by chunk, value by value
// (fma); the block adds them as MLX's BlockBroadcastReduce does (each warp's butterfly,
// xor 16 .. 1, then the warps' sums, in lanes 0 .. WARPS-1 and zeros beyond, by the same
// butterfly); y = w * T(h * rsqrt(sum / N + eps)) with MLX's two roundings.
  constexpr int WARPS = BLOCK / 32;
  static_assert(BLOCK % 32 == 0 && CHUNKS >= 1 && N % 8 == 0, "add_rms_norm: plan");
  __shared__ float partial[WARPS];
  const int t = threadIdx.x;
  const int lane = t & 31;
  const size_t row = blockIdx.x;
  const T* xr = x + row * N;
  const T* rr = r + row * N;
  uint4 hv[CHUNKS], wv[CHUNKS];  // w loaded with x and r: no load after the reduction
  float s = 0.0f;
#pragma unroll
  for (int c = 0; c < CHUNKS; ++c) {
    const int at = 8 * (BLOCK * c + t);
    hv[c] = make_uint4(0u, 0u, 0u, 0u);
    wv[c] = hv[c];
    if (at < N) {
      const uint4 a = kivi_ld16(xr + at);
      const uint4 b = kivi_ld16(rr + at);
      wv[c] = kivi_ld16(w + at);
      hv[c] = kivi_add8<T>(a, b);
    }
    float f[8];
    kivi_unpack8f<T>(hv[c], f);
#pragma unroll
    for (int j = 0; j < 8; ++j) s = fmaf(f[j], f[j], s);
  }
#pragma unroll
  for (int m = 16; m > 0; m >>= 1) s = s + __shfl_xor_sync(KIVI_FULL, s, m);
  if constexpr (WARPS > 1) {
    if (lane == 0) partial[t >> 5] = s;
    __syncthreads();
    s = lane < WARPS ? partial[lane] : 0.0f;
#pragma unroll
    for (int m = 16; m > 0; m >>= 1) s = s + __shfl_xor_sync(KIVI_FULL, s, m);
  }
  const float inv = rsqrtf(s / float(N) + __int_as_float(EPS_BITS));
#pragma unroll
  for (int c = 0; c < CHUNKS; ++c) {
    const int at = 8 * (BLOCK * c + t);
    if (at < N) {
      float f[8], wf[8];
      kivi_unpack8f<T>(hv[c], f);
      kivi_unpack8f<T>(wv[c], wf);
      uint32_t packed[4];
#pragma unroll
      for (int j = 0; j < 8; j += 2) {
        const float y0 = kivi_f(kivi_from_f<T>(f[j] * inv));
        const float y1 = kivi_f(kivi_from_f<T>(f[j + 1] * inv));
        packed[j / 2] = kivi_pack2f<T>(wf[j] * y0, wf[j + 1] * y1);  // exact products, one rounding (as T * T)
      }
      *reinterpret_cast<uint4*>(h + row * N + at) = hv[c];
      *reinterpret_cast<uint4*>(y + row * N + at) = make_uint4(packed[0], packed[1], packed[2], packed[3]);
    }
  }
