// Device helpers of the KIVI Metal kernels (the header of every kernel in this folder).
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

// Lane order (kernels/layout.py, as kernels/cuda/kivi.cuh): tiles of G = 32 at 2 or 4
// bits, D 64 or 128, keep their 4-code units where the CUDA tensor-core kernel's lanes
// load them; these give a unit's index in its tile (times BITS / 2: its byte).
template <int BITS, int G, int D> constexpr bool kivi_lane_order() {
  return (BITS == 2 || BITS == 4) && G == 32 && (D == 64 || D == 128);
}
template <int BITS> inline int kivi_lane_ord(int i) { return BITS == 2 ? (((i & 1) << 1) | (i >> 1)) : i; }
template <int D, int BITS> inline int kivi_lane_k(int c, int u) {
  return ((u * 4 + ((c & 15) >> 2)) * (D / 16) + (c >> 4)) * 4 + kivi_lane_ord<BITS>(c & 3);
}
template <int D, int BITS> inline int kivi_lane_v(int t, int u) {
  return ((((u & 7) * 4 + (t >> 3)) * (D / 32) + (u >> 3)) * 2 + ((t & 7) >> 2)) * 4 + kivi_lane_ord<BITS>(t & 3);
}
// kivi_load8's words (8 codes: units a, b of one row) from a lane-order tile.
template <int BITS>
inline void kivi_lane_load8(const device uint8_t* tile, int a, int b, thread uint& lo, thread uint& hi) {
  if (BITS == 2) {
    lo = uint(tile[a]) | (uint(tile[b]) << 8);
  } else {
    const device ushort* t16 = reinterpret_cast<const device ushort*>(tile);
    lo = uint(t16[a]) | (uint(t16[b]) << 16);
  }
  hi = 0u;
}
// Store unit `unit` (4 codes, low bits first) at unit index i of a lane-order tile.
template <int BITS> inline void kivi_lane_store(device uint8_t* tile, int i, uint unit) {
  if (BITS == 2) {
    tile[i] = uint8_t(unit);
  } else {
    reinterpret_cast<device ushort*>(tile)[i] = ushort(unit);
  }
}
