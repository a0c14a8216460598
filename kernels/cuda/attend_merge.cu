// The merge of the splits (kivi_attend_merge): exact log-sum-exp, output cast to T;
// with ROTATE = 1 (a 2r cache, whose rows live in the Hadamard basis) the output row
// is then rotated back (kivi_hadamard8: mx.hadamard_transform's bits).
// Inputs: part_acc, part_ml (the split kernel's outputs), params. Output: out [B, H_q, D].
// Grid: B * H_q thread blocks of MW warps (MW = blockDim.x / 32, chosen per launch from
// the number of splits: kernels.cuda_attend.merge_warps).
// The splits' weights 2^(m_i - max) are computed once per block into shared memory,
// cooperatively. Then warp w sums splits w, w + MW, ... with each lane holding D / 32
// channels (vector loads; independent across splits, so they overlap), and the warps'
// partial sums meet in shared memory. At B = 1 there are only H_q blocks and hundreds
// of splits: one thread per channel looping over every split serially was the
// latency of the whole call.
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
    const T o = kivi_from_f<T>(mx == KIVI_NEG_INF ? 0.0f : s / lsum);
    if constexpr (ROTATE) {
      accs[d] = kivi_f(o);  // column d is this thread's alone: row 0 is free to take it
    } else {
      out[(size_t)bh * D + d] = o;
    }
  }
  if constexpr (ROTATE) {  // warp 0 rotates the row as T, as mx.hadamard_transform of out would
    __syncthreads();
    if (warp == 0) {
      const bool holds = lane < D / 8;
      float x[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
      if (holds) {
        const float4 lo = *reinterpret_cast<const float4*>(accs + 8 * lane);
        const float4 hi = *reinterpret_cast<const float4*>(accs + 8 * lane + 4);
        x[0] = lo.x, x[1] = lo.y, x[2] = lo.z, x[3] = lo.w, x[4] = hi.x, x[5] = hi.y, x[6] = hi.z, x[7] = hi.w;
      }
      kivi_hadamard8<T, D>(x);
      if (holds) {
#pragma unroll
        for (int j = 0; j < 8; ++j) out[(size_t)bh * D + 8 * lane + j] = kivi_from_f<T>(x[j]);
      }
    }
  }
