"""KIVI decode attention and tail flush as Metal kernels (`mx.fast.metal_kernel`).

UNTESTED: no Apple hardware exists where this was written. This is the algorithm of
`kernels.kivi_cuda` transcribed for Metal and reviewed line by line against it (same
launch plan, same index math, same numerics); the CUDA version is the one measured
and parity-tested. The GPU tests run it on Apple silicon (tests/test_kernels_gpu.py)
and skip elsewhere. Read `kernels.kivi_cuda` for the design; differences:

  * SIMD groups of 32 (every Apple GPU): `simd_shuffle*`, `simd_max`, `simd_sum` stand
    in for warp shuffles; `simdgroup_barrier` for `__syncwarp`.
  * Threadgroup memory is capped at 32 KiB, so the split kernel uses fewer SIMD
    groups per threadgroup when rep is large (`warps_for`).
  * Flush numerics: `metal::precise::divide` (plain `/` is not correctly rounded in
    Metal even in safe math mode) and `rint` (Metal `round` is half away from zero,
    `rint` is half to even like `mx.round`); math_mode "safe".
"""

from __future__ import annotations

import mlx.core as mx

from kiviq.kernels.kivi_cuda import (
    HEAD_DIMS,
    POOL_DTYPES,
    STEP_TOKENS,
    attend_launch,
    attend_templates,
    flush_apply,
    flush_launch,
    flush_prepare,
    split_plan,
    supports,
)
from kiviq.kernels.layout import KiviPool

TG_MEMORY = 32768  # bytes of threadgroup memory on Apple GPUs


def _metal_available() -> bool:
    try:
        return bool(mx.metal.is_available())
    except AttributeError:
        return False


def warps_for(d: int, rep: int) -> int:
    """SIMD groups per threadgroup so that qs + ps fit in threadgroup memory."""
    for nw in (4, 2, 1):
        if 4 * (d * rep + nw * rep * STEP_TOKENS) <= TG_MEMORY:
            return nw
    return 1


HEADER = r"""
#define KIVI_NEG_INF (-INFINITY)

inline float kivi_f(float x) { return x; }
inline float kivi_f(half x) { return float(x); }
inline float kivi_f(bfloat16_t x) { return static_cast<float>(x); }

template <typename T> inline T kivi_from_f(float x) { return static_cast<T>(x); }

template <int BITS>
inline void kivi_load8(const device uint8_t* p, thread uint& lo, thread uint& hi) {
  if (BITS == 2) {
    lo = uint(*reinterpret_cast<const device ushort*>(p));
    hi = 0u;
  } else if (BITS == 4) {
    lo = *reinterpret_cast<const device uint*>(p);
    hi = 0u;
  } else {
    const uint2 w = *reinterpret_cast<const device uint2*>(p);
    lo = w.x;
    hi = w.y;
  }
}

template <int BITS>
inline float kivi_code(uint lo, uint hi, int j) {
  const int wb = j * BITS;
  const int o = wb & 31;
  uint w = (wb >= 32) ? hi : lo;
  const bool shift = o + BITS > 23;
  const int p = shift ? o - 16 : o;
  if (shift) w >>= 16;
  const uint mask = ((1u << BITS) - 1u) << p;
  const uint magic = uint(150 - p) << 23;
  return as_type<float>((w & mask) | magic) - as_type<float>(magic);
}

template <typename SD> inline float kivi_bits_f(uint bits);
template <> inline float kivi_bits_f<half>(uint bits) {
  return float(as_type<half>(ushort(bits)));
}
template <> inline float kivi_bits_f<bfloat16_t>(uint bits) {
  return as_type<float>(bits << 16);
}

template <typename SD>
inline void kivi_load8f(const device SD* p, thread float* x) {
  const uint4 u = *reinterpret_cast<const device uint4*>(p);
  const uint w[4] = {u.x, u.y, u.z, u.w};
  for (int k = 0; k < 4; ++k) {
    x[2 * k] = kivi_bits_f<SD>(w[k] & 0xffffu);
    x[2 * k + 1] = kivi_bits_f<SD>(w[k] >> 16);
  }
}

template <typename SD, int BITS>
inline void kivi_group_params(float mn, float mx, thread SD& zero, thread SD& scale,
                              thread float& zf, thread float& sf) {
  zero = kivi_from_f<SD>(mn);
  scale = kivi_from_f<SD>(metal::precise::divide(mx - mn, float((1 << BITS) - 1)));
  zf = kivi_f(zero);
  sf = kivi_f(scale);
}

template <int BITS>
inline uint kivi_quantize(float x, float zf, float sf) {
  if (sf == 0.0f) return 0u;
  float q = metal::rint(metal::precise::divide(x - zf, sf));
  q = metal::fmin(metal::fmax(q, 0.0f), float((1 << BITS) - 1));
  return uint(q);
}
"""

# Same inputs, outputs and grid as kivi_cuda.ATTEND_SOURCE.
ATTEND_SOURCE = r"""
  constexpr int P = 8 / BITS;
  constexpr int KROW = G / P;
  constexpr int VROW = D / P;
  constexpr int NG = D / G;
  constexpr int LPB = G / 8;
  constexpr int SB = 32 / LPB;
  constexpr int STEP = SB * G;
  constexpr int LR = D / 8;
  constexpr int TPI = 32 / LR;
  constexpr int VU = (G / TPI < 8) ? G / TPI : 8;

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
          for (int i = 0; i < 8; ++i) kivi_load8<BITS>(kc + (d0 + i) * KROW, lo[i], hi[i]);
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
        const device SD* vsp = v_scales + tile * (G * NG) + (cc * 8) / G;
        const device SD* vzp = v_zeros + tile * (G * NG) + (cc * 8) / G;
        const threadgroup float* pp = pw + jj * G;
        for (int t0 = to; t0 < G; t0 += VU * TPI) {
          uint lo[VU], hi[VU];
          float vs[VU], vz[VU];
          for (int i = 0; i < VU; ++i) {
            const int t = t0 + i * TPI;
            kivi_load8<BITS>(vc + t * VROW, lo[i], hi[i]);
            vs[i] = kivi_f(vsp[t * NG]);
            vz[i] = kivi_f(vzp[t * NG]);
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
"""

MERGE_SOURCE = r"""
  const int bh = int(threadgroup_position_in_grid.x);
  const int d = int(thread_position_in_threadgroup.x);
  const int nsu = params[2] + 1;
  const size_t first = size_t(bh / REP) * nsu * REP + (bh % REP);
  float mx = KIVI_NEG_INF;
  for (int i = 0; i < nsu; ++i) mx = metal::fmax(mx, part_ml[(first + size_t(i) * REP) * 2]);
  float lsum = 0.0f, a = 0.0f;
  if (mx != KIVI_NEG_INF) {
    for (int i = 0; i < nsu; ++i) {
      const size_t k = first + size_t(i) * REP;
      const float mi = part_ml[k * 2];
      if (mi != KIVI_NEG_INF) {
        const float w = metal::exp2(mi - mx);
        lsum = metal::fma(w, part_ml[k * 2 + 1], lsum);
        a = metal::fma(w, part_acc[k * D + d], a);
      }
    }
  }
  out[size_t(bh) * D + d] = kivi_from_f<T>(mx == KIVI_NEG_INF ? 0.0f : a / lsum);
"""

FLUSH_SOURCE = r"""
  constexpr int P = 8 / BITS;
  constexpr int NG = D / G;
  constexpr int CPW = 32 / BITS;
  const int fh = int(threadgroup_position_in_grid.x);
  const int d = int(thread_position_in_threadgroup.x);
  const int RG = params[0];
  const device SD* rk = rows_k + size_t(fh) * RG * D;
  const device SD* rv = rows_v + size_t(fh) * RG * D;
  {
    const device SD* x = rk + d;
    float mn = kivi_f(x[0]), mx = mn;
    for (int t = 1; t < G; ++t) {
      const float v = kivi_f(x[size_t(t) * D]);
      mn = metal::fmin(mn, v);
      mx = metal::fmax(mx, v);
    }
    SD zero, scale;
    float zf, sf;
    kivi_group_params<SD, BITS>(mn, mx, zero, scale, zf, sf);
    device uint* dst = reinterpret_cast<device uint*>(k_codes + (size_t(fh) * D + d) * (G / P));
    for (int w = 0; w < G / CPW; ++w) {
      uint word = 0u;
      for (int j = 0; j < CPW; ++j) {
        const float v = kivi_f(x[size_t(w * CPW + j) * D]);
        word |= kivi_quantize<BITS>(v, zf, sf) << (j * BITS);
      }
      dst[w] = word;
    }
    k_scales[size_t(fh) * D + d] = scale;
    k_zeros[size_t(fh) * D + d] = zero;
  }
  {
    const int t = d / NG;
    const int gi = d % NG;
    const device SD* x = rv + size_t(t) * D + gi * G;
    float mn = kivi_f(x[0]), mx = mn;
    for (int c = 1; c < G; ++c) {
      const float v = kivi_f(x[c]);
      mn = metal::fmin(mn, v);
      mx = metal::fmax(mx, v);
    }
    SD zero, scale;
    float zf, sf;
    kivi_group_params<SD, BITS>(mn, mx, zero, scale, zf, sf);
    device uint* dst = reinterpret_cast<device uint*>(
        v_codes + (size_t(fh) * G + t) * (D / P) + gi * (G / P));
    for (int w = 0; w < G / CPW; ++w) {
      uint word = 0u;
      for (int j = 0; j < CPW; ++j) {
        word |= kivi_quantize<BITS>(kivi_f(x[w * CPW + j]), zf, sf) << (j * BITS);
      }
      dst[w] = word;
    }
    v_scales[size_t(fh) * D + d] = scale;
    v_zeros[size_t(fh) * D + d] = zero;
  }
"""

_POOL = ("k_codes", "k_scales", "k_zeros", "v_codes", "v_scales", "v_zeros", "tail_k",
         "tail_v")


def _build():
    if not _metal_available():
        return None, None, None
    k = mx.fast.metal_kernel
    safe = {"math_mode": "safe"}
    return (
        k(name="kivi_attend_split",
          input_names=["q", *_POOL, "block_tables", "num_blocks", "slots", "tail_lens",
                       "params", "qscale_in"],
          output_names=["part_acc", "part_ml"], source=ATTEND_SOURCE, header=HEADER,
          compile_options=safe),
        k(name="kivi_attend_merge", input_names=["part_acc", "part_ml", "params"],
          output_names=["out"], source=MERGE_SOURCE, header=HEADER, compile_options=safe),
        k(name="kivi_flush_quantize", input_names=["rows_k", "rows_v", "params"],
          output_names=list(_POOL[:6]), source=FLUSH_SOURCE, header=HEADER,
          compile_options=safe),
    )


ATTEND_KERNEL, MERGE_KERNEL, FLUSH_KERNEL = _build()


def kivi_decode_attend(q, pool: KiviPool, block_tables, num_blocks, slots, tail_lens, *,
                       scale: float, bits: int, group_size: int = 32) -> mx.array:
    """Metal twin of `kernels.kivi_cuda.kivi_decode_attend` (same contract)."""
    if ATTEND_KERNEL is None:
        raise RuntimeError("MLX's Metal backend is not available")
    if q.shape[0] == 0:
        return mx.zeros(q.shape, dtype=q.dtype)
    b, h_q, d = q.shape
    nw = warps_for(d, h_q // pool.tail_k.shape[1])
    meta, split, _, rep = attend_launch(
        q.shape, q.dtype, pool, block_tables, num_blocks, slots, tail_lens, scale=scale,
        bits=bits, group_size=group_size, warps=nw, tail_rows=None)
    t_split, t_merge = attend_templates(q.dtype, pool, bits=bits, group_size=group_size,
                                        rep=rep, warps=nw)
    part_acc, part_ml = ATTEND_KERNEL(inputs=[q, *pool, *meta], template=t_split, **split)
    # One thread per output channel, looping over the splits (the CUDA merge spreads
    # the splits over warps; not ported: no Apple hardware to measure it on).
    return MERGE_KERNEL(inputs=[part_acc, part_ml, meta[4]], template=t_merge,
                        grid=(b * h_q * d, 1, 1), threadgroup=(d, 1, 1),
                        output_shapes=[(b, h_q, d)], output_dtypes=[q.dtype])[0]


def kivi_flush(pool: KiviPool, slots, new_block_ids, tail_lens, *, bits: int,
               group_size: int = 32) -> KiviPool:
    """Metal twin of `kernels.kivi_cuda.kivi_flush` (same contract)."""
    if FLUSH_KERNEL is None:
        raise RuntimeError("MLX's Metal backend is not available")
    prepared = flush_prepare(pool, slots, new_block_ids, tail_lens, bits=bits,
                             group_size=group_size)
    if prepared is None:
        return pool
    slots, ids = prepared
    rows_k, rows_v = pool.tail_k[slots], pool.tail_v[slots]
    launch, template, params = flush_launch(pool, rows_k, bits=bits, group_size=group_size)
    quantized = FLUSH_KERNEL(inputs=[rows_k, rows_v, params], template=template, **launch)
    return flush_apply(pool, slots, ids, rows_k, rows_v, quantized, group_size)


__all__ = ["HEAD_DIMS", "POOL_DTYPES", "kivi_decode_attend", "kivi_flush", "split_plan",
           "supports", "warps_for"]
