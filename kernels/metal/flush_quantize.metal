// The gather flush's quantize kernel, as kernels/cuda/flush_quantize.cu.
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
    if (kivi_lane_order<BITS, G, D>()) {  // a unit (4 tokens) at a time
      for (int u = 0; u < G / 4; ++u) {
        uint unit = 0u;
        for (int j = 0; j < 4; ++j) unit |= kivi_quantize<BITS>(kivi_f(x[size_t(4 * u + j) * D]), zf, sf) << (j * BITS);
        kivi_lane_store<BITS>(k_codes + size_t(fh) * D * (G / P), kivi_lane_k<D, BITS>(d, u), unit);
      }
    } else {
      device uint* dst = reinterpret_cast<device uint*>(k_codes + (size_t(fh) * D + d) * (G / P));
      for (int w = 0; w < G / CPW; ++w) {
        uint word = 0u;
        for (int j = 0; j < CPW; ++j) {
          const float v = kivi_f(x[size_t(w * CPW + j) * D]);
          word |= kivi_quantize<BITS>(v, zf, sf) << (j * BITS);
        }
        dst[w] = word;
      }
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
    if (kivi_lane_order<BITS, G, D>()) {  // a unit (4 channels) at a time
      for (int u = 0; u < G / 4; ++u) {
        uint unit = 0u;
        for (int j = 0; j < 4; ++j) unit |= kivi_quantize<BITS>(kivi_f(x[4 * u + j]), zf, sf) << (j * BITS);
        kivi_lane_store<BITS>(v_codes + size_t(fh) * G * (D / P), kivi_lane_v<D, BITS>(t, gi * (G / 4) + u), unit);
      }
    } else {
      device uint* dst = reinterpret_cast<device uint*>(
          v_codes + (size_t(fh) * G + t) * (D / P) + gi * (G / P));
      for (int w = 0; w < G / CPW; ++w) {
        uint word = 0u;
        for (int j = 0; j < CPW; ++j) {
          word |= kivi_quantize<BITS>(kivi_f(x[w * CPW + j]), zf, sf) << (j * BITS);
        }
        dst[w] = word;
      }
    }
    v_scales[size_t(fh) * D + gi * G + t] = scale;  // group-major: [D / G][G]
    v_zeros[size_t(fh) * D + gi * G + t] = zero;
  }
