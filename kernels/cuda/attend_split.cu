// The CUDA-core split kernel (kivi_attend_split): 8-bit, G != 32, D 32 / 256, and any
// layout the tensor-core kernel does not cover. float32 throughout.
//
// Body of the kernel MLX generates (mx.fast.cuda_kernel; kernels.cuda_attend builds it).
// Inputs: q [B, H_q, D] (T); the pool's 8 arrays (kernels/layout.py); block_tables [B, MBS],
// num_blocks, slots, tail_lens [B] int32; params int32 [MBS, bps, S, R + G, tail splits,
// new token]; qscale_in float32 = scale * log2(e); k_new, v_new [B, H_kv, D] (SD).
// Outputs: part_acc float32 [B, H_kv, S + tail splits, REP, D], part_ml float32 [.., REP, 2].
// Grid: x = ceil(splits / NW) blocks of NW warps, y = H_kv, z = B.
// PRO = 1 (D 64 or 128): q is the step's fused q/k/v row [B, (H_q + 2 H_kv) D]; the block
// makes its kv head's query rows first (kivi_prologue_block in kivi_prologue.cuh) and the
// tail's writer the new k and v, instead of reading q, k_new and v_new.
  constexpr int P = 8 / BITS;
  constexpr int KROW = G / P;        // bytes of one k_codes row (one channel, G tokens)
  constexpr int VROW = D / P;        // bytes of one v_codes row (one token, D channels)
  constexpr int LPB = G / 8;         // K phase: lanes per block (8 tokens each)
  constexpr int SB = 32 / LPB;       // blocks per warp step
  constexpr int STEP = SB * G;       // tokens per warp step (256)
  constexpr int LR = D / 8;          // V phase: lanes per token row (8 channels each)
  constexpr int TPI = 32 / LR;       // V phase: tokens per iteration
  constexpr int VU = (G / TPI < 8) ? G / TPI : 8;  // V phase: tokens loaded together

  __shared__ __align__(16) float qs[D * REP];         // [D][REP] q * scale * log2(e)
  __shared__ __align__(16) float ps[NW * REP * STEP];  // per warp: [REP][STEP] p
  constexpr int PD = PRO ? D : 64;  // the prologue's head_dim (it is instantiated for D 64 and 128 only)
  static_assert(!PRO || PD == D, "decode prologue: head_dim 64 or 128");
  static_assert(!PRO || kivi_same<T, SD>::value, "the prologue writes the model's dtype into the tail");
  __shared__ __align__(16) SD kv_rows[PRO ? NW * 2 * D : 1];  // per warp: the new k and v (PRO)
  __shared__ __align__(16) float trig[PRO ? PD : 1];           // RoPE's cos and sin (PRO)
  __shared__ __align__(16) T q_rows[PRO ? REP * PD : 1];       // the kv head's query rows (PRO)

  KIVI_SPLIT_INDICES

  // q rows of this kv head's query heads are contiguous: [REP][D].
  {
    const T* qp = q + ((size_t)b * H_kv + h) * (REP * D);
    if constexpr (PRO) {
      kivi_prologue_block<T, PD, NORM, ROT_IN, REP>(q, q_norm, rope, offsets, b, h, H_kv, trig, q_rows);
      qp = q_rows;
    }
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
        const SD* vsp = v_scales + tile * D + (cc * 8) / G * G;  // [NG][G]: group, then token
        const SD* vzp = v_zeros + tile * D + (cc * 8) / G * G;
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
            vs[i] = kivi_f(__ldg(vsp + t));
            vz[i] = kivi_f(__ldg(vzp + t));
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
    const SD* kn = k_new + kv;
    const SD* vn = v_new + kv;
    if constexpr (PRO) {
      if (nr >= 0) {
        SD* rows_kv = kv_rows + warp * 2 * D;
        kivi_prologue_kv<T, PD, NORM, ROT_IN, REP>(q, k_norm, rope, trig, b, h, H_kv, rows_kv, rows_kv + D);
        __syncwarp();
        kn = rows_kv;
        vn = rows_kv + D;
      }
    }
    kivi_tail_attend<SD, D, REP, STEP>(qs, pw, tail_k + base, tail_v + base, rows, nr, kn, vn, lane, m, l,
                                       acc);
  }
  kivi_write_part<D, REP>(m, l, acc, lane, part_acc, part_ml,
                          ((size_t)(b * H_kv + h) * nsu + split) * REP);
