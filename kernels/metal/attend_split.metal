// Split kernel: same inputs (without k_new / v_new), outputs and grid as
// kernels/cuda/attend_split.cu; the fp16 tail is one split.
  constexpr int P = 8 / BITS;
  constexpr int KROW = G / P;
  constexpr int VROW = D / P;
  constexpr int LPB = G / 8;
  constexpr int SB = 32 / LPB;
  constexpr int STEP = SB * G;
  constexpr int LR = D / 8;
  constexpr int TPI = 32 / LR;
  constexpr int VU = (G / TPI < 8) ? G / TPI : 8;
  constexpr bool LANE = kivi_lane_order<BITS, G, D>();

  threadgroup float qs[D * REP];
  threadgroup float ps[NW * REP * STEP];

  const int tid = int(thread_position_in_threadgroup.x);
  const int lane = int(thread_index_in_simdgroup);
  const int warp = int(simdgroup_index_in_threadgroup);
  const int h = int(threadgroup_position_in_grid.y);
  const int b = int(threadgroup_position_in_grid.z);
  const int H_kv = int(threadgroups_per_grid.y);
  const int mbs = params[0];
  const int bps = params[1];
  const int nsplit = params[2];
  const int RG = params[3];
  const int nsu = nsplit + 1;
  const int split = int(threadgroup_position_in_grid.x) * NW + warp;

  {
    const device T* qp = q + (size_t(b) * H_kv + h) * (REP * D);
    const float qscale = qscale_in[0];
    for (int i = tid; i < REP * D; i += NW * 32) {
      qs[(i % D) * REP + i / D] = kivi_f(qp[i]) * qscale;
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (split >= nsu) return;

  threadgroup float* pw = ps + warp * (REP * STEP);
  float m[REP], l[REP], acc[REP][8];
  for (int r = 0; r < REP; ++r) {
    m[r] = KIVI_NEG_INF;
    l[r] = 0.0f;
    for (int j = 0; j < 8; ++j) acc[r][j] = 0.0f;
  }
  const int cc = lane % LR;
  const int to = lane / LR;

  if (split < nsplit) {
    const int nb = min(num_blocks[b], mbs);
    const int blk0 = split * bps;
    const int blk1 = min(blk0 + bps, nb);
    const device int32_t* table = block_tables + size_t(b) * mbs;
    const int jl = lane / LPB;
    const int seg = lane % LPB;
    for (int sb = blk0; sb < blk1; sb += SB) {
      const int nblk = min(SB, blk1 - sb);
      const bool kvalid = jl < nblk;
      const int pb = kvalid ? table[sb + jl] : 0;
      float s[REP][8];
      for (int r = 0; r < REP; ++r)
        for (int j = 0; j < 8; ++j) s[r][j] = 0.0f;
      if (kvalid) {
        const size_t tile = size_t(pb) * H_kv + h;
        const device uint8_t* kc = k_codes + tile * (D * KROW) + seg * BITS;
        const device SD* ksp = k_scales + tile * D;
        const device SD* kzp = k_zeros + tile * D;
        for (int d0 = 0; d0 < D; d0 += 8) {
          uint lo[8], hi[8];
          for (int i = 0; i < 8; ++i) {
            if (LANE) {  // units 2 seg, 2 seg + 1 of channel d0 + i
              kivi_lane_load8<BITS>(k_codes + tile * (D * KROW), kivi_lane_k<D, BITS>(d0 + i, 2 * seg),
                                    kivi_lane_k<D, BITS>(d0 + i, 2 * seg + 1), lo[i], hi[i]);
            } else {
              kivi_load8<BITS>(kc + (d0 + i) * KROW, lo[i], hi[i]);
            }
          }
          float ks[8], kz[8];
          kivi_load8f<SD>(ksp + d0, ks);
          kivi_load8f<SD>(kzp + d0, kz);
          for (int i = 0; i < 8; ++i) {
            float qd[REP];
            for (int r = 0; r < REP; ++r) qd[r] = qs[(d0 + i) * REP + r];
            for (int j = 0; j < 8; ++j) {
              const float x = metal::fma(kivi_code<BITS>(lo[i], hi[i], j), ks[i], kz[i]);
              for (int r = 0; r < REP; ++r) s[r][j] = metal::fma(qd[r], x, s[r][j]);
            }
          }
        }
      }
      for (int r = 0; r < REP; ++r) {
        float mx = KIVI_NEG_INF;
        if (kvalid) {
          for (int j = 0; j < 8; ++j) mx = metal::fmax(mx, s[r][j]);
        }
        mx = metal::fmax(m[r], simd_max(mx));
        const float alpha = metal::exp2(m[r] - mx);
        m[r] = mx;
        l[r] *= alpha;
        for (int j = 0; j < 8; ++j) acc[r][j] *= alpha;
        float p8[8];
        float lsum = 0.0f;
        for (int j = 0; j < 8; ++j) {
          p8[j] = kvalid ? metal::exp2(s[r][j] - mx) : 0.0f;
          lsum += p8[j];
        }
        l[r] += lsum;
        threadgroup float4* dst = reinterpret_cast<threadgroup float4*>(pw + r * STEP + lane * 8);
        dst[0] = float4(p8[0], p8[1], p8[2], p8[3]);
        dst[1] = float4(p8[4], p8[5], p8[6], p8[7]);
      }
      simdgroup_barrier(mem_flags::mem_threadgroup);
      for (int jj = 0; jj < nblk; ++jj) {
        const int vb = simd_shuffle(pb, ushort(jj * LPB));
        const size_t tile = size_t(vb) * H_kv + h;
        const device uint8_t* vc = v_codes + tile * (G * VROW) + cc * BITS;
        const device SD* vsp = v_scales + tile * D + (cc * 8) / G * G;  // [NG][G]
        const device SD* vzp = v_zeros + tile * D + (cc * 8) / G * G;
        const threadgroup float* pp = pw + jj * G;
        for (int t0 = to; t0 < G; t0 += VU * TPI) {
          uint lo[VU], hi[VU];
          float vs[VU], vz[VU];
          for (int i = 0; i < VU; ++i) {
            const int t = t0 + i * TPI;
            if (LANE) {  // units 2 cc, 2 cc + 1 of token t
              kivi_lane_load8<BITS>(v_codes + tile * (G * VROW), kivi_lane_v<D, BITS>(t, 2 * cc),
                                    kivi_lane_v<D, BITS>(t, 2 * cc + 1), lo[i], hi[i]);
            } else {
              kivi_load8<BITS>(vc + t * VROW, lo[i], hi[i]);
            }
            vs[i] = kivi_f(vsp[t]);
            vz[i] = kivi_f(vzp[t]);
          }
          for (int i = 0; i < VU; ++i) {
            const int t = t0 + i * TPI;
            float pr[REP];
            for (int r = 0; r < REP; ++r) pr[r] = pp[r * STEP + t];
            for (int j = 0; j < 8; ++j) {
              const float x = metal::fma(kivi_code<BITS>(lo[i], hi[i], j), vs[i], vz[i]);
              for (int r = 0; r < REP; ++r) acc[r][j] = metal::fma(pr[r], x, acc[r][j]);
            }
          }
        }
      }
      simdgroup_barrier(mem_flags::mem_threadgroup);
    }
  } else {
    const int tl = min(tail_lens[b], RG);
    const size_t base = (size_t(slots[b]) * H_kv + h) * RG * D;
    const device SD* tk = tail_k + base;
    const device SD* tv = tail_v + base;
    for (int c0 = 0; c0 < tl; c0 += 32) {
      const int n = min(32, tl - c0);
      const bool valid = lane < n;
      float s[REP];
      for (int r = 0; r < REP; ++r) s[r] = 0.0f;
      if (valid) {
        const device SD* row = tk + size_t(c0 + lane) * D;
        for (int d0 = 0; d0 < D; d0 += 8) {
          float x[8];
          kivi_load8f<SD>(row + d0, x);
          for (int j = 0; j < 8; ++j)
            for (int r = 0; r < REP; ++r) s[r] = metal::fma(qs[(d0 + j) * REP + r], x[j], s[r]);
        }
      }
      for (int r = 0; r < REP; ++r) {
        const float mx = metal::fmax(m[r], simd_max(valid ? s[r] : KIVI_NEG_INF));
        const float alpha = metal::exp2(m[r] - mx);
        m[r] = mx;
        l[r] *= alpha;
        for (int j = 0; j < 8; ++j) acc[r][j] *= alpha;
        const float p = valid ? metal::exp2(s[r] - mx) : 0.0f;
        l[r] += p;
        pw[r * STEP + lane] = p;
      }
      simdgroup_barrier(mem_flags::mem_threadgroup);
      for (int t = to; t < n; t += TPI) {
        float x[8];
        kivi_load8f<SD>(tv + size_t(c0 + t) * D + cc * 8, x);
        for (int r = 0; r < REP; ++r) {
          const float pr = pw[r * STEP + t];
          for (int j = 0; j < 8; ++j) acc[r][j] = metal::fma(pr, x[j], acc[r][j]);
        }
      }
      simdgroup_barrier(mem_flags::mem_threadgroup);
    }
  }

  const size_t oi = (size_t(b * H_kv + h) * nsu + split) * REP;
  for (int r = 0; r < REP; ++r) {
    l[r] = simd_sum(l[r]);
    for (int o = LR; o < 32; o <<= 1)
      for (int j = 0; j < 8; ++j) acc[r][j] += simd_shuffle_xor(acc[r][j], ushort(o));
  }
  if (lane == 0) {
    for (int r = 0; r < REP; ++r) {
      part_ml[(oi + r) * 2] = m[r];
      part_ml[(oi + r) * 2 + 1] = l[r];
    }
  }
  if (lane < LR && m[0] != KIVI_NEG_INF) {
    for (int r = 0; r < REP; ++r) {
      device float4* dst = reinterpret_cast<device float4*>(part_acc + (oi + r) * D + cc * 8);
      dst[0] = float4(acc[r][0], acc[r][1], acc[r][2], acc[r][3]);
      dst[1] = float4(acc[r][4], acc[r][5], acc[r][6], acc[r][7]);
    }
  }
