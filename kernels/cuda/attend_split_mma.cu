// The tensor-core split kernel (kivi_attend_split_mma): same inputs, outputs, grid and
// merge as attend_split.cu; G = 32, bits 2 or 4, D 64 or 128, REP <= 8. A warp stages one
// block (K and V codes, scales, zeros) in shared memory, turns its codes into SD
// fragments and runs m16n8k16 MMAs with float32 accumulation:
//   K phase: scores[token][rep] = K_hat[32 tokens][D] . q^T, rows = tokens (2 m-tiles),
//     n = query heads (padded to 8). Lane (g = lane / 4, f = lane % 4) holds tokens
//     4g .. 4g+3 (one 4-code unit of a channel row) for channels 4f .. 4f+3 of each
//     16-channel k-tile (its k-pairs 2f, 2f+1 and 2f+8, 2f+9 are channels 4f, 4f+1 and
//     4f+2, 4f+3: any order of k works when q uses the same one).
//   V phase: out^T[channel][rep] += V_hat^T[D][32 tokens] . p^T, rows = channels, k =
//     tokens. Lane holds channels 32mp + 4g .. +3 (one unit of a token row) for tokens
//     8f .. 8f+7, so its value scales (stored group-major, [group][token]) are adjacent.
//   The pool is in lane order (kernels/layout.py): a lane's code units of a block are
//     D * BITS / 32 adjacent words of each tile, loaded with 16-byte loads
//     (kivi_lane_words) and split into operands by kivi_lane_operands.
//   p goes through shared memory in SD ([8][32] per warp): the transpose between the
//   two fragment layouts.
// No code is dequantized. Since K_hat = code * s + z per channel and V_hat = code * s + z
// per token and group,
//   scores = codes . (q * s) + z . q        out = codes^T . (p * s) + z^T . p
// so the scale goes onto the other operand (one HMUL2 per 2 channels of q per block,
// per 2 tokens of p per group), the zeros' terms are two small MMAs of their own
// (zc; zv for all channel groups at once), and a code pair costs one LOP3 (kivi_codes4:
// fp16 codes are subnormals, weighed back by 2^U per accumulator register; bf16 codes
// carry an offset, whose term is one more small MMA each: tk = sum of q * s, tv = sum
// of p * s per group). Dequantizing was LOP3 + HSUB2 + HFMA2 per pair, ~30-45% of a
// tile's instructions (offline SASS, kernels.cuda_offline).
// Numerics: K_hat and V_hat are never rounded; q * s and p * s are, once each to the
// pool dtype, with zeros' terms from the rounded q and p.
// PRO = 1: q is the step's fused q/k/v row [B, (H_q + 2 H_kv) D]; the thread block makes
// its kv head's query rows first (kivi_prologue_block in kivi_prologue.cuh, the block's
// only barriers), and the tail's writer the new k and v (instead of k_new / v_new).
  constexpr int P = 8 / BITS;
  constexpr int LW = D * BITS / 32;  // code words of a lane in a K (and in a V) tile
  constexpr int KT = D / 16;      // k-tiles of the K phase
  constexpr int MP = D / 32;      // channel m-tile pairs of the V phase (one group each)
  constexpr int KTILE = D * G / P;
  constexpr int VTILE = G * D / P;
  constexpr int SB = KTILE + VTILE + 4 * D * 2;  // one staged block
  constexpr int WB = 2 * SB + 16 * G;    // per warp: 2 stages, p
  static_assert(kivi_lane_order<BITS, G, D>(), "MMA kernel: G = 32, bits 2 or 4, D 64 or 128 (lane order)");
  constexpr bool OFF = !kivi_same<SD, __half>::value;  // codes carry an offset (bf16)
  static_assert(WB >= REP * (D + 32) * 4 + 2 * D * sizeof(SD), "tail warp scratch fits in its region");
  // Per warp: stages 0 and 1 (cp.async double buffer) and p as [8 heads][32 tokens] in
  // SD. The tail warp uses its region for q (float) and p instead. No block-wide
  // barrier but the prologue's.
  __shared__ __align__(16) uint8_t smem[NW * WB];
  __shared__ __align__(16) float trig[PRO ? D : 1];     // RoPE's cos and sin (PRO)
  __shared__ __align__(16) T q_rows[PRO ? REP * D : 1];  // the kv head's query rows (PRO)

  KIVI_SPLIT_INDICES
  uint8_t* ws = smem + warp * WB;
  // A quantized split stages its first block before anything else, so that the load
  // overlaps the prologue (or q's load) instead of following it. The next block's
  // table entry is read one block ahead: its load's latency hides behind a tile
  // instead of stalling the prefetch that needs it (the last block's entry is read
  // again at the end, in bounds and unused).
  const int nb = min(num_blocks[b], mbs);
  const int blk0 = split * bps;
  const int blk1 = min(blk0 + bps, nb);
  const int* table = block_tables + (size_t)b * mbs;
  const kivi_stager<SD, D, KTILE, VTILE> stager(lane, k_codes, v_codes, k_scales, k_zeros, v_scales, v_zeros);
  int tnext = 0;
  if (split < nsplit && blk0 < blk1) {
    stager.stage(ws, lane, (uint32_t)table[blk0] * H_kv + h);
    tnext = table[(unsigned)min(blk0 + 1, blk1 - 1)];
  }
  const T* qp = q + ((size_t)b * H_kv + h) * (REP * D);
  if constexpr (PRO) {
    kivi_prologue_block<T, D, NORM, ROT_IN, REP>(q, q_norm, rope, offsets, b, h, H_kv, trig, q_rows);
    qp = q_rows;
  }
  if (split >= nsu) return;
  const float qscale = qscale_in[0];
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
    const SD* kn = k_new + kv;
    const SD* vn = v_new + kv;
    if constexpr (PRO) {  // the new token's rows, after q and p in this warp's region
      if (nr >= 0) {
        SD* rows_kv = reinterpret_cast<SD*>(ws + REP * (D + 32) * 4);
        kivi_prologue_kv<T, D, NORM, ROT_IN, REP>(q, k_norm, rope, trig, b, h, H_kv, rows_kv, rows_kv + D);
        __syncwarp();
        kn = rows_kv;
        vn = rows_kv + D;
      }
    }
    kivi_tail_attend<SD, D, REP, 32>(qs, qs + D * REP, tail_k + base, tail_v + base, rows, nr, kn, vn,
                                     lane, m, l, acc);
    kivi_write_part<D, REP>(m, l, acc, lane, part_acc, part_ml, oi);
    return;
  }

  const int g = lane >> 2;
  const int f = lane & 3;
  SD* pt = reinterpret_cast<SD*>(ws + 2 * SB);  // [8][G] p

  // q of query head g as B fragments (zero rows pad REP to 8), unscaled: the softmax
  // scale is applied to the float32 scores.
  uint32_t qb[KT][2];
#pragma unroll
  for (int kt = 0; kt < KT; ++kt) {
    qb[kt][0] = 0u;
    qb[kt][1] = 0u;
    if (g < REP) {
      const T* qr = qp + g * D + kt * 16 + 4 * f;  // channels 4f .. 4f+3 (see the K phase)
      qb[kt][0] = kivi_pack2f<SD>(kivi_f(qr[0]), kivi_f(qr[1]));
      qb[kt][1] = kivi_pack2f<SD>(kivi_f(qr[2]), kivi_f(qr[3]));
    }
  }
  float m2[2] = {KIVI_NEG_INF, KIVI_NEG_INF};  // query heads 2f, 2f+1
  float l2[2] = {0.0f, 0.0f};                  // this lane's tokens only
  float oacc[2 * MP][4];
  // Sums over tokens of p * value zero (zv) and, with offsets, of p * value scale as
  // rounded (tv); rows g and g + 8 of lane (g, f) hold channel group g % MP, heads
  // 2f + {0, 1}.
  // Every row of zv's A is a zero, so rows g and g + 8 hold the same sums: zv[e] is read.
  float zv[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  float tv[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
  for (int i = 0; i < 2 * MP; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) oacc[i][j] = 0.0f;

  uint8_t* st = ws;         // this block's stage
  uint8_t* sn = ws + SB;    // the next block's
  for (int blk = blk0; blk < blk1; ++blk) {
    // Prefetch the next block into the other stage, then wait for this one.
    if (blk + 1 < blk1) {
      stager.stage(sn, lane, (uint32_t)tnext * H_kv + h);
      tnext = table[(unsigned)min(blk + 2, blk1 - 1)];
      kivi_cp_wait<1>();
    } else {
      kivi_cp_wait<0>();
    }
    __syncwarp();
    const uint8_t* kc = st;
    const uint8_t* vc = st + KTILE;
    const SD* ks = reinterpret_cast<const SD*>(st + KTILE + VTILE);
    const SD* kz = ks + D;
    const SD* vs = kz + D;  // [NG][G] value scales (zeros) of the block, group-major
    const SD* vz = vs + D;

    // ---- K phase: scores of tokens 4g + {0,1} (m-tile 0) and 4g + {2,3} (m-tile 1)
    // Two accumulators per m-tile (even and odd k-tiles): two independent MMA chains.
    // Every shared address below is a per-lane base plus a compile-time offset (one
    // LDS [R + imm] each; offsets kept in registers cost an IADD3 per load and registers).
    // The zeros' term in one m16n8k16 whose every row of A is the zeros (zc[e] = zc[2 + e]).
    // Two m16n8k8 chains on the zeros as loaded would save a MOV per register, but they
    // round the sum in another order, which changes greedy tokens.
    float sc[2][4], sc2[2][4], zc[4] = {0.0f, 0.0f, 0.0f, 0.0f}, tk[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
      for (int j = 0; j < 4; ++j) sc[i][j] = sc2[i][j] = 0.0f;
    const SD* ksl = ks + 4 * f;
    const SD* kzl = kz + 4 * f;
    uint32_t kw[LW];  // k-tile kt: tokens 4g .. 4g+3 of channels 16kt + 4f .. +3
    kivi_lane_words<LW>(kc, lane, kw);
#pragma unroll
    for (int kt = 0; kt < KT; ++kt) {
      // The four channels' scales (zeros) are adjacent: one 8-byte load each.
      const uint2 sv = *reinterpret_cast<const uint2*>(ksl + kt * 16);
      const uint2 zw = *reinterpret_cast<const uint2*>(kzl + kt * 16);
      const uint32_t s01 = sv.x, s89 = sv.y, z01 = zw.x, z89 = zw.y;
      uint32_t w01, w89;  // units of channels 4f|4f+1 and 4f+2|4f+3
      kivi_lane_operands<BITS>(kw, kt, w01, w89);
      uint32_t x01[4], x89[4];
      // codes * (q * scale) + zero . q (zc); the offsets' term from tk = sum of q * scale
      kivi_codes4<SD, BITS>(w01, x01);
      kivi_codes4<SD, BITS>(w89, x89);
      const uint32_t qa = kivi_hmul2<SD>(qb[kt][0], s01);
      const uint32_t qc = kivi_hmul2<SD>(qb[kt][1], s89);
      kivi_mma<SD>(zc, z01, z01, z89, z89, qb[kt][0], qb[kt][1]);
      if constexpr (OFF) kivi_mma<SD>(tk, KIVI_ONES_BF16, KIVI_ONES_BF16, KIVI_ONES_BF16, KIVI_ONES_BF16, qa, qc);
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
#pragma unroll
        for (int hi = 0; hi < 2; ++hi)
          sc[mt][2 * hi + e] = kivi_unfold<SD, BITS>(2 * mt + hi, sc[mt][2 * hi + e], tk[e], qscale, zc[e] * qscale);
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
      if constexpr (OFF) {
        tv[0] *= alpha[0];
        tv[1] *= alpha[1];
        tv[2] *= alpha[0];
        tv[3] *= alpha[1];
      }
    }
    __syncwarp();

    // ---- V phase: tokens 8f + 4kt + {0,1} (k 2f, 2f+1) and + {2,3} (k 2f+8, 2f+9) ----
    const uint4 pq = *reinterpret_cast<const uint4*>(pt + g * G + 8 * f);  // query head g
    // A lane's 8 tokens of one group: 16 adjacent bytes of the group-major scales (zeros).
    const uint4* vsl = reinterpret_cast<const uint4*>(vs + 8 * f);
    {  // the zeros' term of every channel group at once (see zv)
      const uint4 z = reinterpret_cast<const uint4*>(vz + 8 * f)[(g % MP) * (G / 8)];
      kivi_mma<SD>(zv, z.x, z.x, z.y, z.y, pq.x, pq.y);
      kivi_mma<SD>(zv, z.z, z.z, z.w, z.w, pq.z, pq.w);
    }
    uint32_t vw[LW];  // (mp, kt): channels 32mp + 4g .. +3 of tokens 8f + 4kt .. +3
    kivi_lane_words<LW>(vc, lane, vw);
#pragma unroll
    for (int mp = 0; mp < MP; ++mp) {
      const uint4 sv = vsl[mp * (G / 8)];
#pragma unroll
      for (int kt = 0; kt < 2; ++kt) {
        const uint32_t sa = kt ? sv.z : sv.x;  // tokens 8f + 4kt + {0, 1} and {2, 3}
        const uint32_t sb = kt ? sv.w : sv.y;
        uint32_t xa[4], xb[4];
        uint32_t wa, wb;  // units of tokens ta|ta+1 and ta+2|ta+3
        kivi_lane_operands<BITS>(vw, 2 * mp + kt, wa, wb);
        // codes * (p * scale); the zeros' term in zv, the offsets' in tv
        kivi_codes4<SD, BITS>(wa, xa);
        kivi_codes4<SD, BITS>(wb, xb);
        const uint32_t pa = kivi_hmul2<SD>(kt ? pq.z : pq.x, sa);
        const uint32_t pc = kivi_hmul2<SD>(kt ? pq.w : pq.y, sb);
        if constexpr (OFF) {  // rows of group mp: ones (rows g, g + 8 of lane (g, f))
          const uint32_t one = (g % MP == mp) ? KIVI_ONES_BF16 : 0u;
          kivi_mma<SD>(tv, one, one, one, one, pa, pc);
        }
#pragma unroll
        for (int i = 0; i < 2; ++i) {
          kivi_mma<SD>(oacc[2 * mp + i], xa[2 * i], xa[2 * i + 1], xb[2 * i], xb[2 * i + 1], pa, pc);
        }
      }
    }
    __syncwarp();  // the next iteration's prefetch overwrites this stage and pt
    uint8_t* const t = st;
    st = sn;
    sn = t;
  }

  // ---- (m, l, acc): oacc[2mp + i][2 * hi + e] = channel 32mp + 4g + 2i + hi, head 2f + e
#pragma unroll
  for (int e = 0; e < 2; ++e)
#pragma unroll
    for (int o = 4; o < 32; o <<= 1) l2[e] += __shfl_xor_sync(KIVI_FULL, l2[e], o);
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    const int r = 2 * f + e;
    float zm[MP], tm[MP];  // group mp's zeros' (offsets') term of head r, from lane (mp, f)
#pragma unroll
    for (int mp = 0; mp < MP; ++mp) {
      zm[mp] = __shfl_sync(KIVI_FULL, zv[e], mp * 4 + f);
      tm[mp] = OFF ? __shfl_sync(KIVI_FULL, tv[e], mp * 4 + f) : 0.0f;
    }
    if (r < REP) {
      if (g == 0) {
        part_ml[(oi + r) * 2] = m2[e];
        part_ml[(oi + r) * 2 + 1] = l2[e];
      }
      if (blk1 > blk0) {  // an empty split writes no acc; the merge never reads it
#pragma unroll
        for (int mp = 0; mp < MP; ++mp) {
          // code positions j = 0, 1, 2, 3
          const float4 o = make_float4(kivi_unfold<SD, BITS>(0, oacc[2 * mp][e], tm[mp], 1.0f, zm[mp]),
                                       kivi_unfold<SD, BITS>(1, oacc[2 * mp][2 + e], tm[mp], 1.0f, zm[mp]),
                                       kivi_unfold<SD, BITS>(2, oacc[2 * mp + 1][e], tm[mp], 1.0f, zm[mp]),
                                       kivi_unfold<SD, BITS>(3, oacc[2 * mp + 1][2 + e], tm[mp], 1.0f, zm[mp]));
          *reinterpret_cast<float4*>(part_acc + (oi + r) * D + mp * 32 + 4 * g) = o;
        }
      }
    }
  }
