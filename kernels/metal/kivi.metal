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
